"""Benchmark every expert weight format (bf16, int8, int4, fp8) on the same weights, one process.

Usage: ``python bench_formats.py --out DIR [--quick] [--reps N]``. Writes
``DIR/bench_formats.json`` and ``DIR/bench_formats.md``.

1. The bf16 matmul peak: ``torch.matmul`` of two large bf16 square matrices (best of 3), in
   GFLOP/s, measured first, with the same threads.
2. The medium shape (H=2048, I=768, E=64, k=8, r=16; ``--quick``: H=1024, I=384, E=32), for
   T in {64, 512, 2048}: forward+backward of ``moe_experts_forward`` (bf16 compute, fused bf16
   LoRA, policy save) on each format, repetitions interleaved (bf16, int8, int4, fp8, bf16,
   ...) so load on shared cores hits all alike; medians. GFLOP/s counts the base GEMMs only:
   ``12 T k H I`` per step (forward ``6 T k H I``; backward's ``dh = dy W_down`` and
   ``dx = dgu W_gate_up`` as much again), and is compared to the peak.
3. Per format: expert bytes, quantisation error, the tile loader's throughput (a whole
   gate_up bank dequantised to bf16 through ``torch.ops.kt_kernel.dequantize_tile``), and the
   per-phase thread CPU time of one step at the smallest and largest T (the kernel's
   ``profile``), which says where each format's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import kt_kernel as kk

# (name, H, I, E, k, r, token counts)
MEDIUM = ("medium", 2048, 768, 64, 8, 16, (64, 512, 2048))
QUICK = ("quick", 1024, 384, 32, 8, 16, (64, 512))
FORMATS = ("bf16", "int8", "int4", "fp8")
TARGETS = {  # speed = t_bf16 / t_format, forward+backward
    "int4_speed_at_2048_min": 0.9,
    "int4_speed_at_64_min": 1.0,  # strictly faster
    "fp8_speed_at_2048_min": 0.85,
}


def matmul_peak(n: int) -> float:
    """GFLOP/s of ``torch.matmul`` on two bf16 ``[n, n]`` matrices, best of 3 after a warm-up."""
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _weights(h: int, i: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.empty(e, 2 * i, h, dtype=torch.bfloat16)
    down = torch.empty(e, h, i, dtype=torch.bfloat16)
    for x in range(e):  # expert by expert: no whole-model fp32 temporary
        gate_up[x].copy_(torch.randn(2 * i, h, generator=gen) / h**0.5)
        down[x].copy_(torch.randn(h, i, generator=gen) / i**0.5)
    return gate_up, down


def _lora(spec: kk.ExpertSpec, rank: int) -> kk.LoraBuffers:
    gen = torch.Generator().manual_seed(1)
    lora = kk.LoraBuffers(spec, rank, 2.0 * rank, "fused", dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return lora


def _step(x, ids, w, dy, weights, lora) -> float:
    """One forward+backward; wall seconds."""
    for p in lora.parameters():
        p.grad = None
    xg = x.detach().requires_grad_(True)
    wg = w.detach().requires_grad_(True)
    t0 = time.perf_counter()
    y = kk.moe_experts_forward(xg, ids, wg, weights, lora, policy="save", backend="native")
    y.backward(dy)
    return time.perf_counter() - t0


def _loader_ns_per_elem(weights: kk.ExpertWeights) -> float | None:
    """ns per element to dequantise the whole gate_up bank to bf16 tiles (None for dense)."""
    if not weights.is_quantized:
        return None
    fmt = weights.format
    args = list(fmt.native_args(weights.storage[0]))
    spec = weights.spec
    n, k = 2 * spec.intermediate_size, spec.hidden_size
    op = torch.ops.kt_kernel.dequantize_tile
    op(fmt.name, args, n, k, 0, 0, n, k, torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        op(fmt.name, args, n, k, 0, 0, n, k, torch.bfloat16)
        best = min(best, time.perf_counter() - t0)
    return best / (spec.num_experts * n * k) * 1e9


def _profile(x, ids, w, dy, weights, lora) -> dict[str, float]:
    torch.ops.kt_kernel.profile(True)
    _step(x, ids, w, dy, weights, lora)
    names, secs = torch.ops.kt_kernel.profile(True)
    return {n: round(s, 5) for n, s in zip(names, secs, strict=True) if s > 0}


def run_shape(shape: tuple, reps: int, peak: float) -> dict:
    """Time every format at each token count of ``shape``."""
    name, h, i, e, k, r, token_counts = shape
    spec = kk.ExpertSpec(e, h, i)
    gate_up, down = _weights(h, i, e)
    bases: dict[str, kk.ExpertWeights] = {}
    info: dict[str, dict] = {}
    for fmt in FORMATS:
        t0 = time.perf_counter()
        if fmt == "bf16":
            wts = kk.ExpertWeights.from_fused(spec, gate_up, down, dtype=torch.bfloat16)
        else:
            wts = kk.ExpertWeights.from_fused(spec, gate_up, down, weight_dtype=fmt)
        info[fmt] = {
            "format": repr(wts.format),
            "bytes": wts.nbytes,
            "quantize_seconds": time.perf_counter() - t0,
            "quantization_report": wts.quantization_report().as_dict()
            if wts.is_quantized
            else None,
            "loader_ns_per_elem_bf16": _loader_ns_per_elem(wts),
        }
        bases[fmt] = wts
    for fmt in FORMATS:
        info[fmt]["memory_ratio"] = info[fmt]["bytes"] / info["bf16"]["bytes"]
    del gate_up, down
    lora = _lora(spec, r)
    gen = torch.Generator().manual_seed(2)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, e, generator=gen).topk(k, dim=-1).indices
        w = torch.rand(tokens, k, generator=gen)
        dy = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
        for fmt in FORMATS:  # warm-up: oneDNN primitives, scratch pool
            _step(x, ids, w, dy, bases[fmt], lora)
        samples: dict[str, list[float]] = {f: [] for f in FORMATS}
        for rep in range(reps):
            order = FORMATS[rep % len(FORMATS) :] + FORMATS[: rep % len(FORMATS)]
            for fmt in order:  # rotated so no format always runs right after another
                samples[fmt].append(_step(x, ids, w, dy, bases[fmt], lora))
        gflop = 12 * tokens * k * h * i / 1e9
        row: dict = {"tokens": tokens, "gflop": gflop}
        for fmt in FORMATS:
            med = statistics.median(samples[fmt])
            row[fmt] = {
                "seconds": med,
                "gflops": gflop / med,
                "fraction_of_peak": gflop / med / peak,
                "speed_vs_bf16": statistics.median(samples["bf16"]) / med,
                "samples": samples[fmt],
            }
        if tokens in (min(token_counts), max(token_counts)):
            row["profile_cpu_seconds"] = {
                fmt: _profile(x, ids, w, dy, bases[fmt], lora) for fmt in FORMATS
            }
        rows.append(row)
        print(
            f"[{name}] T={tokens}: "
            + ", ".join(
                f"{f} {row[f]['seconds'] * 1e3:.1f} ms ({row[f]['speed_vs_bf16']:.2f}x)"
                for f in FORMATS
            ),
            flush=True,
        )
    return {
        "shape": {"name": name, "H": h, "I": i, "E": e, "k": k, "r": r},
        "formats": info,
        "timings": rows,
    }


def check_targets(res: dict) -> dict[str, bool | None]:
    """Which of :data:`TARGETS` the measurements meet (None: that T was not run)."""
    by_t = {row["tokens"]: row for row in res["timings"]}
    out: dict[str, bool | None] = {}
    big, small = by_t.get(2048), by_t.get(64)
    out["int4 >= 0.9x bf16 at T=2048"] = (
        None if big is None else big["int4"]["speed_vs_bf16"] >= TARGETS["int4_speed_at_2048_min"]
    )
    out["int4 faster than bf16 at T=64"] = (
        None if small is None else small["int4"]["speed_vs_bf16"] > TARGETS["int4_speed_at_64_min"]
    )
    out["fp8 >= 0.85x bf16 at T=2048"] = (
        None if big is None else big["fp8"]["speed_vs_bf16"] >= TARGETS["fp8_speed_at_2048_min"]
    )
    out["int4 memory <= 0.30x bf16"] = res["formats"]["int4"]["memory_ratio"] <= 0.30
    return out


def write_markdown(path: Path, meta: dict, res: dict, targets: dict) -> None:
    """One table of times and throughput per T and format, one of bytes and errors."""
    s = res["shape"]
    lines = [
        "# kt-kernel: expert weight formats (forward+backward)",
        "",
        f"Shape {s['name']}: H={s['H']}, I={s['I']}, E={s['E']}, k={s['k']}, r={s['r']}; bf16 "
        f"compute, fused bf16 LoRA, policy save; {meta['threads']} threads, {meta['reps']} "
        f"interleaved reps, medians. bf16 matmul peak {meta['peak_gflops']:.0f} GFLOP/s. "
        f"Load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}.",
        "",
        "| T | format | ms | GFLOP/s | of peak | speed vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for row in res["timings"]:
        for fmt in FORMATS:
            c = row[fmt]
            lines.append(
                f"| {row['tokens']} | {fmt} | {c['seconds'] * 1e3:.1f} | {c['gflops']:.0f} | "
                f"{c['fraction_of_peak']:.2f} | {c['speed_vs_bf16']:.2f} |"
            )
    lines += [
        "",
        "| format | expert MiB | vs bf16 | max rel Frobenius error | loader ns/elem (bf16 tile) |",
        "|---|---|---|---|---|",
    ]
    for fmt in FORMATS:
        f = res["formats"][fmt]
        rep = f["quantization_report"]
        err = max(p["rel_fro_error"] for p in rep.values()) if rep else 0.0
        ns = f["loader_ns_per_elem_bf16"]
        lines.append(
            f"| {fmt} | {f['bytes'] / 2**20:.0f} | {f['memory_ratio']:.3f} | {err:.3g} | "
            f"{'-' if ns is None else f'{ns:.2f}'} |"
        )
    lines += ["", "Targets:", ""]
    lines += [
        f"- {k}: {'not run' if ok is None else ('met' if ok else 'MISSED')}"
        for k, ok in targets.items()
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse ``--out``/``--quick``/``--reps``, run, write JSON and markdown."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--quick", action="store_true", help="a smaller shape and fewer reps")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions")
    args = ap.parse_args()
    shape = QUICK if args.quick else MEDIUM
    reps = args.reps or (3 if args.quick else 5)
    loadavg_start = os.getloadavg()
    peak = matmul_peak(2048 if args.quick else 4096)
    print(f"bf16 matmul peak: {peak:.0f} GFLOP/s", flush=True)
    res = run_shape(shape, reps, peak)
    meta = {
        "quick": args.quick,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kt_kernel": kk.__version__,
        "isa": kk.backend_info().isa,
        "cpu_features": list(kk.backend_info().cpu_features),
        "cpu": platform.processor() or platform.machine(),
        "peak_gflops": peak,
        "loadavg_start": [round(v, 2) for v in loadavg_start],
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
    }
    targets = check_targets(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_formats.json").write_text(
        json.dumps({"meta": meta, "result": res, "targets": targets}, indent=2)
    )
    write_markdown(args.out / "bench_formats.md", meta, res, targets)
    print((args.out / "bench_formats.md").read_text())


if __name__ == "__main__":
    main()
