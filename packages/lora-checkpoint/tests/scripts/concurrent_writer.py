"""A writer for the concurrency tests: saves into a shared root and reports each save.

Usage: ``concurrent_writer.py ROOT PREFIX COUNT KEEP_LAST [ELEMENTS]``. Waits for a line on
stdin, then saves ``COUNT`` checkpoints named ``<PREFIX>-<i>`` (parameter values encode the
prefix and i), printing ``S <name>`` after each ``save`` returned; ``KEEP_LAST`` 0 means no pruning;
``ELEMENTS`` sizes the second parameter (default 256), so loads take longer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import lora_checkpoint as lc
from lora_core.contracts import AdaptationResult, ComponentVersion


def value(prefix: str, i: int, index: int) -> float:
    """The value every element of parameter ``index`` holds in checkpoint ``<prefix>-<i>``."""
    return (sum(map(ord, prefix)) % 97) * 1000.0 + i + index / 8.0


def main() -> None:
    root, prefix, count, keep = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    elements = int(sys.argv[5]) if len(sys.argv) > 5 else 256
    torch.set_num_threads(1)
    shapes = [(64, 64), (elements,)]
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    result = AdaptationResult.create(
        adapted_layers=["x"],
        named_optimizer_parameters=params,
        ownership={n: "replicated" for n, _ in params},
        producer=ComponentVersion("lora-core", "0.1.0"),
    )
    print("READY", flush=True)
    sys.stdin.readline()
    for i in range(count):
        with torch.no_grad():
            for index, (_, p) in enumerate(params):
                p.fill_(value(prefix, i, index))
        name = f"{prefix}-{i:03d}"
        # A training state adds a JSON file, which a load reads after the tensor files.
        state = lc.TrainingState(step=i, data_position={"writer": prefix})
        lc.save(root, result, name=name, keep_last=keep or None, training_state=state)
        print(f"S {name}", flush=True)


if __name__ == "__main__":
    main()
