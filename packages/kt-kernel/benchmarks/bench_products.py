"""One thread's expert products at 16-256 rows: dense bf16 (oneDNN), bf16-packed and others.

Usage: ``python bench_products.py --out DIR [--quick] [--reps N] [--experts E]
[--variants V ...]`` (formats with bf16 compute; the first is the baseline of the ratios;
default ``bf16 bf16-packed``). Writes
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


def run(
    experts: int, rows: tuple[int, ...], reps: int, variants: tuple[str, ...] = VARIANTS
) -> list[dict]:
    """GFLOP/s of every (projection, product, rows, variant), medians of interleaved reps."""
    ops = torch.ops.kt_kernel
    out = []
    for proj, (n, k) in PROJECTIONS.items():
        banks = {v: expert_bank(v, n, k, experts) for v in variants}
        for nn in (False, True):
            for m in rows:
                x = torch.randn(m, n if nn else k).to(torch.bfloat16)
                samples: dict[str, list[float]] = {v: [] for v in variants}
                for rep in range(reps + 1):  # the first round warms up
                    order = variants if rep % 2 == 0 else variants[::-1]
                    for v in order:
                        fname, args = banks[v]
                        t0 = time.perf_counter()
                        for e in range(experts):
                            ops.project(fname, args, n, k, e, x, nn)
                        if rep:
                            samples[v].append(time.perf_counter() - t0)
                flop = 2.0 * m * n * k * experts
                row = {"projection": proj, "product": "dy W" if nn else "x W^T", "rows": m}
                for v in variants:
                    row[v] = flop / statistics.median(samples[v]) / 1e9
                # each variant against the first (bf16-packed against bf16 by default)
                row["ratios"] = {v: row[v] / row[variants[0]] for v in variants[1:]}
                out.append(row)
                print(row, flush=True)
    return out


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    """The table: GFLOP/s per variant, fraction of the 1-thread peak, each / the first."""
    peak = meta["peak_gflops"]
    variants = meta["variants"]
    base, others = variants[0], variants[1:]
    lines = [
        f"# kt-kernel: one thread's expert products, {', '.join(variants)}",
        "",
        f"Command: `{meta['command']}`. Machine: {meta['cpu']}, isa {meta['isa']}, "
        f"kt-kernel {meta['kt_kernel']}, torch {meta['torch']}; load average "
        f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end. {meta['experts']} "
        f"distinct experts per pass (weights from DRAM); 1-thread bf16 matmul peak "
        f"{peak:.0f} GFLOP/s (start {meta['peak_gflops_start']:.0f}, end "
        f"{meta['peak_gflops_end']:.0f}). Medians of {meta['reps']} interleaved reps.",
        "",
        "| projection | product | rows | "
        + " | ".join(f"{v} GFLOP/s (of peak)" for v in variants)
        + " | "
        + " | ".join(f"{v} / {base}" for v in others)
        + " |",
        "|---|---|---|" + "---|" * (len(variants) + len(others)),
    ]
    for r in rows:
        cells = [f"{r[v]:.0f} ({r[v] / peak:.0%})" for v in variants]
        cells += [f"{r['ratios'][v]:.2f}x" for v in others]
        lines.append(
            f"| {r['projection']} | {r['product']} | {r['rows']} | " + " | ".join(cells) + " |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse the options, run on one thread, write JSON and markdown."""
    import sys

    ap = tm.parser(__doc__)
    ap.add_argument("--experts", type=int, default=48, help="distinct experts per pass")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="formats; first: base")
    args = ap.parse_args()
    variants = tuple(args.variants)
    torch.set_num_threads(1)
    kk.set_num_threads(1)
    rows = ROWS[:3] if args.quick else ROWS
    reps = args.reps or (2 if args.quick else 5)
    experts = 12 if args.quick else args.experts
    loadavg_start = tm.loadavg()
    peak_start = tm.matmul_peak(torch.bfloat16, 2048)
    result = run(experts, rows, reps, variants)
    peak_end = tm.matmul_peak(torch.bfloat16, 2048)
    meta = {
        "command": "python benchmarks/bench_products.py " + " ".join(sys.argv[1:]),
        "experts": experts,
        "reps": reps,
        "variants": list(variants),
        **tm.run_meta(peak_start, peak_end, loadavg_start),
    }
    payload = {"meta": meta, "results": result}
    tm.write_results(args.out, "bench_products", payload, lambda p: write_markdown(p, meta, result))


if __name__ == "__main__":
    main()
