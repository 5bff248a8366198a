"""What ``load_pretrained``'s checks of hostile input cost, against the load they guard.

The checkpoints of ``bench_load.py`` (a Qwen3-30B-A3B-shaped model, random bf16 weights, per
expert keys; ``--quick``: 1 layer, E=16; and the same saved as FP8 blocks) are loaded in this
process ``--repeats`` times each, alternating two variants:

* ``checks``: as shipped; every header validated, every floating tensor scanned for NaN/inf as
  it is read, the config checked and the host memory estimated on a meta-device build;
* ``no NaN scan``: the same with the per-tensor scan replaced by ``return False``.

Reported per checkpoint: the fastest and median load of each variant, the seconds spent in the
scan itself (timed around every call, in the ``checks`` runs: the figure the 5% budget is
about) as a share of the load in wall time and in CPU time (``process_time``, every thread:
on a shared machine the wall-clock share is inflated by waiting for a core), and the seconds of
the config and memory checks before allocating (the meta build). Writes ``bench_load_checks.json`` and
``.md`` under ``--out``.

Usage: ``python bench_load_checks.py --out DIR [--quick] [--layers N] [--repeats N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules
from _common import shape, write_results
from bench_load import save

VARIANTS = ("checks", "no NaN scan")


class _Timed:
    """Wraps ``fn``; adds the wall and CPU (all threads) seconds of every call to the totals."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.total = self.cpu = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start
            self.cpu += time.process_time() - cpu


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _load_once(path: Path, variant: str) -> tuple[float, float, float, float, float]:
    """Wall ``(load, scan, pre-allocation checks)`` and CPU ``(load, scan)`` seconds of one load."""
    import torch

    import moe_experts
    from moe_experts import _safetensors, loading
    from moe_experts.memory import trim_host_heap

    scan = _Timed(_safetensors._non_finite)
    fits = _Timed(loading.check_load_fits)
    replacement = scan if variant == "checks" else (lambda t: False)
    with (
        _patched(_safetensors, "_non_finite", replacement),
        _patched(loading, "check_load_fits", fits),
    ):
        start, cpu = time.perf_counter(), time.process_time()
        model = moe_experts.load_pretrained(path, dtype=torch.bfloat16)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del model
    gc.collect()
    trim_host_heap()
    return seconds, scan.total, fits.total, cpu, scan.cpu


def measure(root: Path, repeats: int) -> list[dict[str, Any]]:
    """Alternate the variants ``repeats`` times on each checkpoint; one row per pair."""
    rows = []
    for storage in ("bf16", "fp8"):
        path = root / storage
        _load_once(path, "checks")  # warm: page cache, lazy imports
        runs: dict[str, list[tuple[float, ...]]] = {v: [] for v in VARIANTS}
        for _ in range(repeats):
            for variant in VARIANTS:
                runs[variant].append(_load_once(path, variant))
        load = {v: [r[0] for r in runs[v]] for v in VARIANTS}
        scans = [r[1] for r in runs["checks"]]
        fits = [r[2] for r in runs["checks"]]
        cpu_shares = [r[4] / r[3] for r in runs["checks"]]
        fastest = min(load["checks"])
        rows.append(
            {
                "checkpoint": storage,
                "bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
                "load_s_min": fastest,
                "load_s_median": statistics.median(load["checks"]),
                "no_scan_load_s_min": min(load["no NaN scan"]),
                "no_scan_load_s_median": statistics.median(load["no NaN scan"]),
                "scan_s_min": min(scans),
                "scan_s_median": statistics.median(scans),
                "scan_share_of_fastest_load": min(scans) / fastest,
                "scan_share_median": statistics.median(
                    s / t for s, t in zip(scans, load["checks"], strict=True)
                ),
                "scan_cpu_share_min": min(cpu_shares),
                "scan_cpu_share_median": statistics.median(cpu_shares),
                "load_cpu_s_min": min(r[3] for r in runs["checks"]),
                "pre_allocation_checks_s_min": min(fits),
                "pre_allocation_share_of_fastest_load": min(fits) / fastest,
            }
        )
    return rows


def main() -> None:
    """Save once (or reuse ``--keep``), measure, write JSON and a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; 1 quick)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--keep", type=Path, default=None, help="reuse/keep the checkpoint here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    layers = args.layers or (1 if args.quick else 4)
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="bench-load-checks-")
    root = args.keep or Path(tmp.name)  # type: ignore[union-attr]
    if not (root / "bf16" / "config.json").is_file() or not (root / "fp8").is_dir():
        save(root, args.quick, layers)
    rows = measure(root, args.repeats)
    command = "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    when = datetime.date.today().isoformat()
    meta = {
        "date": when,
        "machine": machine,
        "command": command,
        "layers": layers,
        "quick": args.quick,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "shape": shape(args.quick),
        "target": {"scan_share_of_load": 0.05},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_load_checks" + ("_quick" if args.quick else "")
    stem += f"_threads{args.threads}" if args.threads else ""
    write_results(
        args.out,
        stem,
        meta,
        rows,
        f"load_pretrained's hostile-input checks, Qwen3-30B-A3B-shaped, {layers} layer(s), "
        f"{args.repeats} repeats, {torch.get_num_threads()} torch threads ({when}; {machine}; "
        f"`{command}`)",
        [
            "checkpoint",
            "MB",
            "load s (min / median)",
            "without NaN scan s (min / median)",
            "NaN scan s (min)",
            "scan share of load, wall (min / median)",
            "scan share of load, CPU (min / median)",
            "config + memory checks s (min), share",
        ],
        lambda r: [
            r["checkpoint"],
            f"{r['bytes'] / 1e6:.0f}",
            f"{r['load_s_min']:.3f} / {r['load_s_median']:.3f}",
            f"{r['no_scan_load_s_min']:.3f} / {r['no_scan_load_s_median']:.3f}",
            f"{r['scan_s_min']:.4f}",
            f"{r['scan_share_of_fastest_load']:.1%} / {r['scan_share_median']:.1%}",
            f"{r['scan_cpu_share_min']:.1%} / {r['scan_cpu_share_median']:.1%}",
            f"{r['pre_allocation_checks_s_min']:.3f}, "
            f"{r['pre_allocation_share_of_fastest_load']:.1%}",
        ],
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
