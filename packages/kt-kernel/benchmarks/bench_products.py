"""One thread's expert products at 16-256 rows: dense bf16 (oneDNN) against bf16-packed.

Usage: ``python bench_products.py --out DIR [--quick] [--reps N] [--experts E]``. Writes
``DIR/bench_products.{json,md}``. Each variant runs ``torch.ops.kt_kernel.project`` (the op's
own per-task product) over ``E`` distinct experts in turn, so every expert's weights come
from DRAM as in a real step (E=48 experts of a Qwen3-30B-A3B layer are 450 MB, 14x the L3).
Products: ``x W^T`` (forward) and ``dy W`` (backward) of gate_up (N=1536, K=2048) and down
(N=2048, K=768), one kernel thread, interleaved repetitions, medians; the single-thread bf16
matmul peak is measured before and after in the same process.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import _timing as tm
import torch

import kt_kernel as kk

PROJECTIONS = {"gate_up": (1536, 2048), "down": (2048, 768)}  # (N, K) of Qwen3-30B-A3B
ROWS = (16, 32, 64, 128, 256)
VARIANTS = ("bf16", "bf16-packed")


def expert_bank(name: str, n: int, k: int, experts: int) -> tuple[str, list[torch.Tensor]]:
    """Native name and arguments of ``experts`` random ``[N, K]`` weights in format ``name``."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(experts, n, k, generator=gen).to(torch.bfloat16) / k**0.5
    fmt = kk.FORMATS[name](torch.bfloat16)
    return fmt.name, list(fmt.native_args(fmt.quantize(w)))


def run(experts: int, rows: tuple[int, ...], reps: int) -> list[dict]:
    """GFLOP/s of every (projection, product, rows, variant), medians of interleaved reps."""
    ops = torch.ops.kt_kernel
    out = []
    for proj, (n, k) in PROJECTIONS.items():
        banks = {v: expert_bank(v, n, k, experts) for v in VARIANTS}
        for nn in (False, True):
            for m in rows:
                x = torch.randn(m, n if nn else k).to(torch.bfloat16)
                samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for rep in range(reps + 1):  # the first round warms up
                    order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
                    for v in order:
                        fname, args = banks[v]
                        t0 = time.perf_counter()
                        for e in range(experts):
                            ops.project(fname, args, n, k, e, x, nn)
                        if rep:
                            samples[v].append(time.perf_counter() - t0)
                flop = 2.0 * m * n * k * experts
                row = {"projection": proj, "product": "dy W" if nn else "x W^T", "rows": m}
                for v in VARIANTS:
                    row[v] = flop / statistics.median(samples[v]) / 1e9
                row["ratio"] = row["bf16-packed"] / row["bf16"]
                out.append(row)
                print(row, flush=True)
    return out


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    """The table: GFLOP/s per variant, fraction of the 1-thread peak, packed / dense."""
    peak = meta["peak_gflops"]
    lines = [
        "# kt-kernel: one thread's expert products, dense bf16 vs bf16-packed",
        "",
        f"Command: `{meta['command']}`. Machine: {meta['cpu']}, isa {meta['isa']}, "
        f"kt-kernel {meta['kt_kernel']}, torch {meta['torch']}; load average "
        f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end. {meta['experts']} "
        f"distinct experts per pass (weights from DRAM); 1-thread bf16 matmul peak "
        f"{peak:.0f} GFLOP/s (start {meta['peak_gflops_start']:.0f}, end "
        f"{meta['peak_gflops_end']:.0f}). Medians of {meta['reps']} interleaved reps.",
        "",
        "| projection | product | rows | bf16 GFLOP/s (of peak) | bf16-packed GFLOP/s (of peak) "
        "| packed / bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['projection']} | {r['product']} | {r['rows']} | {r['bf16']:.0f} "
            f"({r['bf16'] / peak:.0%}) | {r['bf16-packed']:.0f} ({r['bf16-packed'] / peak:.0%}) "
            f"| {r['ratio']:.2f}x |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse the options, run on one thread, write JSON and markdown."""
    import sys

    ap = tm.parser(__doc__)
    ap.add_argument("--experts", type=int, default=48, help="distinct experts per pass")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kk.set_num_threads(1)
    rows = ROWS[:3] if args.quick else ROWS
    reps = args.reps or (2 if args.quick else 5)
    experts = 12 if args.quick else args.experts
    loadavg_start = tm.loadavg()
    peak_start = tm.matmul_peak(torch.bfloat16, 2048)
    result = run(experts, rows, reps)
    peak_end = tm.matmul_peak(torch.bfloat16, 2048)
    meta = {
        "command": "python benchmarks/bench_products.py " + " ".join(sys.argv[1:]),
        "experts": experts,
        "reps": reps,
        **tm.run_meta(peak_start, peak_end, loadavg_start),
    }
    payload = {"meta": meta, "results": result}
    tm.write_results(args.out, "bench_products", payload, lambda p: write_markdown(p, meta, result))


if __name__ == "__main__":
    main()
