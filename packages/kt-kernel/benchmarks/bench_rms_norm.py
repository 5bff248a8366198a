"""kt-kernel's fused RMSNorm against the torch chain of transformers' RMSNorm modules.

Forward + backward (input gradient, frozen weight) of the Llama-form norm on the shapes of a
Qwen3-30B-A3B decoder layer at T tokens: the hidden-state norms ``[T, 2048]`` and the per-head
q/k norms ``[T, 32, 128]`` and ``[T, 4, 128]``, in bf16. Both run in this process, interleaved
(rotated order per round); the table gives median wall and CPU milliseconds, the ratio, and
the bytes per second each reaches against the bytes the op must move (read x, write y; read
x and dy, write dx).

Usage: ``python bench_rms_norm.py --out DIR [--quick] [--reps N] [--tokens 2048]``.
Writes ``bench_rms_norm.json`` and ``bench_rms_norm.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from _timing import (
    Sample,
    interleaved,
    loadavg,
    matmul_peak,
    median_cpu,
    median_wall,
    parser,
    run_meta,
    write_results,
)

import kt_kernel as kk

EPS = 1e-6


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward (Qwen3-MoE, DeepSeek-V3, GLM-4.5, Mixtral, ...)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def _fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kk.rms_norm(x, w, EPS)


def _sample(
    norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
) -> Callable[[], Sample]:
    def run() -> Sample:
        xg = x.detach().requires_grad_()
        c0, t0 = time.process_time(), time.perf_counter()
        norm(xg, w).backward(dy)
        return time.perf_counter() - t0, time.process_time() - c0

    return run


def main() -> None:
    """Parse arguments, time both variants per shape, write JSON and markdown."""
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default 2048; quick 256)")
    args = ap.parse_args()
    tokens = args.tokens or (256 if args.quick else 2048)
    reps = args.reps or (3 if args.quick else 9)
    load0 = loadavg()
    peak0 = matmul_peak(torch.bfloat16, 1024)
    rows = []
    for name, shape in (
        ("hidden [T, 2048]", (tokens, 2048)),
        ("q_norm [T, 32, 128]", (tokens, 32, 128)),
        ("k_norm [T, 4, 128]", (tokens, 4, 128)),
    ):
        gen = torch.Generator().manual_seed(0)
        x = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16)
        dy = torch.randn(shape, generator=gen).to(torch.bfloat16)
        w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(torch.bfloat16)
        samples = interleaved(
            {"torch chain": _sample(_chain, x, w, dy), "kt-kernel": _sample(_fused, x, w, dy)},
            reps,
        )
        moved = 5 * x.numel() * x.element_size()  # x, y; x, dy, dx
        med = {k: (median_wall(v), median_cpu(v)) for k, v in samples.items()}
        rows.append(
            {
                "shape": name,
                "elements": x.numel(),
                "wall_ms": {k: 1e3 * v[0] for k, v in med.items()},
                "cpu_ms": {k: 1e3 * v[1] for k, v in med.items()},
                "wall_speedup": med["torch chain"][0] / med["kt-kernel"][0],
                "cpu_speedup": med["torch chain"][1] / med["kt-kernel"][1],
                "gb_per_s": {k: moved / v[0] / 1e9 for k, v in med.items()},
            }
        )
    payload = {
        "benchmark": "kt-kernel/bench_rms_norm",
        "tokens": tokens,
        "reps": reps,
        "meta": run_meta(peak0, matmul_peak(torch.bfloat16, 1024), load0),
        "rows": rows,
    }

    def markdown(path: Path) -> None:
        lines = [
            f"# RMSNorm forward + backward, bf16, T={tokens}: kt-kernel's fused op vs the "
            f"torch chain (median of {reps} interleaved rounds, {payload['meta']['threads']} "
            f"threads, load {load0[0]} -> {payload['meta']['loadavg_end'][0]})",
            "",
            "| shape | torch chain ms (CPU) | kt-kernel ms (CPU) | x wall | x CPU | "
            "kt-kernel GB/s moved |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['shape']} | {r['wall_ms']['torch chain']:.1f} "
                f"({r['cpu_ms']['torch chain']:.1f}) | {r['wall_ms']['kt-kernel']:.1f} "
                f"({r['cpu_ms']['kt-kernel']:.1f}) | {r['wall_speedup']:.2f} | "
                f"{r['cpu_speedup']:.2f} | {r['gb_per_s']['kt-kernel']:.1f} |"
            )
        path.write_text("\n".join(lines) + "\n")

    write_results(args.out, "bench_rms_norm", payload, markdown)


if __name__ == "__main__":
    main()
