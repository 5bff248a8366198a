"""The op's bf16 LoRA products: the kernel's own routines (AVX512_BF16, AMX) against ATen's.

Usage: ``python bench_lora_products.py --out DIR [--quick] [--reps N] [--tokens T ...]
[--formats F ...] [--stem NAME]``. Writes ``DIR/<stem>.{json,md}`` (stem
``bench_lora_products``).

For issue 25's shapes (H=2048, I=1408, E=64, k=6 and the Qwen3-30B-A3B layer H=2048, I=768,
E=128, k=8; ``--quick``: H=512, I=256, E=16, k=4) at T=512 and 2048, on the dense bf16 base
and on ``bf16-packed``: forward + backward of ``moe_experts_forward`` (bf16, fused rank-16
LoRA, policy save), with ``torch.ops.kt_kernel.set_lora_products`` switched on ("kernel") and
off ("aten") in interleaved repetitions (``_timing.interleaved``), on every kernel thread.
Reported per variant: the medians of wall and process CPU time, GFLOP/s against the
same-process 2-thread bf16 matmul peak (measured at start and end), and the thread CPU time of
the LoRA phases (``torch.ops.kt_kernel.profile``) summed over the timed steps.
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path

import _timing as tm
import bench_profile
import torch
from _impls import Shape, flops

import kt_kernel as kk

SHAPES = tuple(bench_profile.SHAPES.values())  # issue 25's two shapes
QUICK = Shape("quick", 512, 256, 16, 4, 16)
LORA_PHASES = (*bench_profile.LORA_PHASES, "prepare_lora")  # packing the factors, too
VARIANTS = ("aten", "kernel")


def _step(
    variant: str,
    lora_cpu: dict[str, float],
    inputs: tuple[torch.Tensor, ...],
    weights: kk.ExpertWeights,
    lora: kk.LoraBuffers,
) -> tm.Sample:
    """One step with the products of ``variant``; adds its LoRA phases' CPU time."""
    ops = torch.ops.kt_kernel
    ops.set_lora_products(int(variant == "kernel"))
    ops.profile(True)
    sample = tm.step(*inputs, weights, lora)
    names, secs = ops.profile(True)
    lora_cpu[variant] += sum(v for n, v in zip(names, secs, strict=True) if n in LORA_PHASES)
    return sample


def run_shape(s: Shape, tokens: list[int], formats: list[str], reps: int) -> list[dict]:
    """Rows of (shape, format, T): both variants' medians and the LoRA phases' CPU time."""
    spec = kk.ExpertSpec(s.experts, s.hidden, s.inter)
    gate_up, down = tm.make_weights(s.hidden, s.inter, s.experts, distinct=8)
    lora = tm.make_lora(spec, s.rank)
    rows = []
    for fmt in formats:
        weights = kk.ExpertWeights.from_fused(
            spec, gate_up, down, dtype=torch.bfloat16, weight_dtype=fmt
        )
        for t in tokens:
            gen = torch.Generator().manual_seed(t)
            x, ids, w, dy = tm.make_inputs(t, s.hidden, s.experts, s.top_k, gen)
            lora_cpu = dict.fromkeys(VARIANTS, 0.0)
            step = functools.partial(_step, inputs=(x, ids, w, dy), weights=weights, lora=lora)
            samples = tm.interleaved(
                {v: functools.partial(step, v, lora_cpu) for v in VARIANTS}, reps
            )
            torch.ops.kt_kernel.set_lora_products(-1)
            gflop = flops(s, t, backward=True) / 1e9
            row: dict = {"shape": s.name, "format": fmt, "tokens": t, "gflop": gflop}
            for v in VARIANTS:
                # The warm-up step is in lora_cpu too: reps + 1 steps.
                row[v] = {
                    "wall_s": tm.median_wall(samples[v]),
                    "cpu_s": tm.median_cpu(samples[v]),
                    "wall_samples": [round(a, 4) for a, _ in samples[v]],
                    "lora_cpu_ms_per_step": 1e3 * lora_cpu[v] / (reps + 1),
                }
            row["speedup_wall"] = row["aten"]["wall_s"] / row["kernel"]["wall_s"]
            row["speedup_cpu"] = row["aten"]["cpu_s"] / row["kernel"]["cpu_s"]
            rows.append(row)
            print({k: v for k, v in row.items() if k not in VARIANTS}, flush=True)
    return rows


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    """The table: per shape, format and T, both variants against the peak, and the ratios."""
    peak = meta["peak_gflops"]
    lines = [
        "# kt-kernel: the op's bf16 LoRA products, kernel routines vs ATen",
        "",
        f"Command: `{meta['command']}`. Machine: {meta['cpu']}, {meta['threads']} threads, isa "
        f"{meta['isa']}, kt-kernel {meta['kt_kernel']}, torch {meta['torch']}; load average "
        f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end. 2-thread bf16 matmul "
        f"peak {peak:.0f} GFLOP/s (start {meta['peak_gflops_start']:.0f}, end "
        f"{meta['peak_gflops_end']:.0f}). Forward + backward, fused bf16 LoRA r=16, policy "
        f"save; medians of {meta['reps']} interleaved reps. LoRA ms: thread CPU time of the "
        "LoRA phases per step (both threads).",
        "",
        "| shape | format | T | aten ms (of peak) | kernel ms (of peak) | wall speed-up "
        "| CPU speed-up | LoRA CPU ms aten -> kernel |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, k = r["aten"], r["kernel"]
        lines.append(
            f"| {r['shape']} | {r['format']} | {r['tokens']} | {1e3 * a['wall_s']:.0f} "
            f"({r['gflop'] / a['wall_s'] / peak:.0%}) | {1e3 * k['wall_s']:.0f} "
            f"({r['gflop'] / k['wall_s'] / peak:.0%}) | {r['speedup_wall']:.2f}x "
            f"| {r['speedup_cpu']:.2f}x | {a['lora_cpu_ms_per_step']:.0f} -> "
            f"{k['lora_cpu_ms_per_step']:.0f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse the options, time both variants, write JSON and markdown."""
    ap = tm.parser(__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts")
    ap.add_argument("--formats", nargs="+", default=None, help="weight formats (bf16, bf16-packed)")
    ap.add_argument("--stem", default="bench_lora_products", help="output file name stem")
    args = ap.parse_args()
    torch.ops.kt_kernel.set_lora_products(1)  # whatever KT_KERNEL_LORA_PRODUCTS said
    if not torch.ops.kt_kernel.lora_products():
        print("bench_lora_products: skipped: this CPU has no AVX512_BF16 (the products are off)")
        return
    torch.ops.kt_kernel.set_lora_products(-1)
    shapes = (QUICK,) if args.quick else SHAPES
    tokens = args.tokens or ([64] if args.quick else [512, 2048])
    formats = args.formats or ["bf16", "bf16-packed"]
    reps = args.reps or (2 if args.quick else 5)
    loadavg_start = tm.loadavg()
    peak_start = tm.matmul_peak(torch.bfloat16, 1024 if args.quick else 4096)
    rows = [r for s in shapes for r in run_shape(s, tokens, formats, reps)]
    peak_end = tm.matmul_peak(torch.bfloat16, 1024 if args.quick else 4096)
    meta = {
        "command": "python benchmarks/bench_lora_products.py " + " ".join(sys.argv[1:]),
        "reps": reps,
        **tm.run_meta(peak_start, peak_end, loadavg_start),
    }
    payload = {
        "meta": meta,
        "results": rows,
        "median_speedup_wall": statistics.median(r["speedup_wall"] for r in rows),
    }
    tm.write_results(args.out, args.stem, payload, lambda p: write_markdown(p, meta, rows))


if __name__ == "__main__":
    main()
