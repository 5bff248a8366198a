"""What the loading benchmarks share: the Qwen3-30B-A3B shape, the smaps_rollup reader and
the JSON + Markdown results writer.

``bench_load.py`` and ``bench_shared.py`` build the same model (real layer dimensions, random
weights, ``--quick``: 16 experts instead of 128) and read the same per-process memory counters.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

# Qwen3-30B-A3B's layer dimensions (H=2048, I=768, E=128, k=8), vocab cut to 32000.
SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}
QUICK: dict[str, Any] = {**SHAPE, "num_experts": 16}
# The LoRA of the step and load benchmarks: rank 16 on these projections, the routers, the experts.
RANK = 16
DENSE = ["q_proj", "k_proj", "v_proj", "o_proj"]


def shape(quick: bool) -> dict[str, Any]:
    """The config overrides of a run: the full shape or the quick one."""
    return QUICK if quick else SHAPE


def config(quick: bool, layers: int) -> Any:
    """The benchmark's ``Qwen3MoeConfig`` with ``layers`` decoder layers."""
    from moe_experts.testing import tiny_config

    return tiny_config("qwen3_moe", **shape(quick), num_hidden_layers=layers)


def kernel_timing() -> ModuleType:
    """kt-kernel's benchmark helper ``_timing``, so every benchmark times and rates work alike."""
    path = str(Path(__file__).resolve().parents[2] / "kt-kernel" / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    import _timing

    return _timing


def matmul_peak(size: int = 2048) -> float:
    """GFLOP/s of a square bf16 ``torch.mm`` with this process's threads: the peak."""
    import torch

    return float(kernel_timing().matmul_peak(torch.bfloat16, size))


def rollup_bytes(field: str) -> int:
    """One counter of ``/proc/self/smaps_rollup`` (``"Rss"``, ``"Pss"``, ...) in bytes."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/smaps_rollup")


def write_results(
    out: Path,
    stem: str,
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    title: str,
    header: list[str],
    cells: Callable[[dict[str, Any]], list[str]],
) -> None:
    """Write ``out/stem.json`` (meta and rows) and ``out/stem.md`` (a titled table), print it."""
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    table = "\n".join([title, "", *lines])
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
