"""Zygote for the SIGKILL test: imports torch once, then forks writers and kills them.

Protocol on stdout: ``READY``; per round the forked writer prints ``S <step>`` after each
published save; the zygote prints ``K <round>`` after it SIGKILLed and reaped the writer, then
waits for a line on stdin before the next round. Usage: ``crash_writer.py ROOT ROUNDS SEED``.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

import lora_checkpoint as lc
from lora_core.contracts import AdaptationResult, ComponentVersion

SHAPES = [(128, 256), (256, 128), (64, 64), (512,)]


def make_result() -> AdaptationResult:
    """Four parameters whose values are a function of the step only (see expected_value)."""
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(SHAPES)]
    return AdaptationResult.create(
        adapted_layers=["x"],
        named_optimizer_parameters=params,
        ownership={n: "replicated" for n, _ in params},
        producer=ComponentVersion("lora-core", "0.1.0"),
    )


def expected_value(step: int, index: int) -> float:
    """The value every element of parameter ``index`` holds at ``step``."""
    return float(step) + index / 8.0


def _next_step(root: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in root.glob("step-*")]
    return max(steps, default=0) + 1


def writer(root: Path) -> None:
    result = make_result()
    step = _next_step(root)
    while True:
        with torch.no_grad():
            for i, p in enumerate(result.parameters()):
                p.fill_(expected_value(step, i))
        state = lc.TrainingState(step=step, data_position={"step": step})
        lc.save(root, result, training_state=state, keep_last=3)
        sys.stdout.write(f"S {step}\n")
        sys.stdout.flush()
        step += 1


def main() -> None:
    root, rounds, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    rng = random.Random(seed)
    # Warm up lazy imports (torch.distributed.tensor, pydantic schemas) so a forked writer
    # spends its time saving, not importing.
    lc.save(root.with_name(root.name + "-warmup"), make_result(), step=1)
    print("READY", flush=True)
    for r in range(rounds):
        pid = os.fork()
        if pid == 0:
            try:
                writer(root)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.002, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(f"K {r}", flush=True)
        if not sys.stdin.readline():
            return


if __name__ == "__main__":
    main()
