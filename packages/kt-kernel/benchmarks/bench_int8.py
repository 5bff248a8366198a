"""Benchmark the INT8 expert base against the bf16 base in the same process, on the same weights.

Usage: ``python bench_int8.py --out DIR [--quick]``. Writes ``DIR/bench_int8.json`` and
``DIR/bench_int8.md``. Both bases hold the same (bf16) weights; the INT8 one is quantised from
them. Compute is bf16 with bf16 LoRA (fused layout, policy ``save``) in both. Repetitions of
the two are interleaved, the order alternating each round (``_timing.interleaved``), so load
on the shared cores hits both alike, and medians are reported. ``speedup = t_bf16 / t_int8`` (> 1: INT8 is faster).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _timing module (a script)
import _timing as tm

import kt_kernel as kk

# (name, H, I, E, k, r, token counts)
MEDIUM = ("medium", 2048, 768, 64, 8, 16, (64, 256, 2048))
QUICK = ("quick", 1024, 384, 32, 8, 16, (64, 256, 1024))
TARGETS = {
    "memory_ratio_max": 0.55,  # int8 nbytes / bf16 nbytes
    "speedup_min_large_t": 0.9,  # at the largest T
    "speedup_min_small_t": 1.0,  # at T = 64 and 256: weight streaming dominates
}


def run_shape(shape: tuple, reps: int) -> dict:
    """Time bf16 vs int8 forward and forward+backward at each token count of ``shape``."""
    name, h, i, e, k, r, token_counts = shape
    spec = kk.ExpertSpec(e, h, i)
    gate_up, down = tm.make_weights(h, i, e, seed=0)
    t0 = time.perf_counter()
    w_int8 = kk.ExpertWeights.from_fused(spec, gate_up, down, weight_dtype="int8")
    quant_s = time.perf_counter() - t0
    w_bf16 = kk.ExpertWeights.from_fused(spec, gate_up, down, dtype=torch.bfloat16)
    del gate_up, down
    lora = tm.make_lora(spec, r, seed=1)
    out = {
        "shape": {"name": name, "H": h, "I": i, "E": e, "k": k, "r": r},
        "bytes_bf16": w_bf16.nbytes,
        "bytes_int8": w_int8.nbytes,
        "memory_ratio": w_int8.nbytes / w_bf16.nbytes,
        "quantize_seconds": quant_s,
        "quantization_report": w_int8.quantization_report().as_dict(),
        "timings": [],
    }
    gen = torch.Generator().manual_seed(2)
    for tokens in token_counts:
        x, ids, w, dy = tm.make_inputs(tokens, h, e, k, gen)
        row = {"tokens": tokens}
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            samples = tm.interleaved(
                {
                    fmt: functools.partial(tm.step, x, ids, w, dy, wts, lora, backward)
                    for fmt, wts in (("bf16", w_bf16), ("int8", w_int8))
                },
                reps,
            )
            med = {key: tm.median_wall(v) for key, v in samples.items()}
            cpu = {key: tm.median_cpu(v) for key, v in samples.items()}
            row[mode] = {
                "bf16_s": med["bf16"],
                "int8_s": med["int8"],
                "speedup": med["bf16"] / med["int8"],
                # CPU time (all threads) is less sensitive to other load on shared cores.
                "bf16_cpu_s": cpu["bf16"],
                "int8_cpu_s": cpu["int8"],
                "cpu_speedup": cpu["bf16"] / cpu["int8"],
                "bf16_samples": [a for a, _ in samples["bf16"]],
                "int8_samples": [a for a, _ in samples["int8"]],
            }
        out["timings"].append(row)
        print(
            f"[{name}] T={tokens}: fwd {row['fwd']['speedup']:.2f}x, "
            f"fwd+bwd {row['fwd_bwd']['speedup']:.2f}x (CPU time "
            f"{row['fwd_bwd']['cpu_speedup']:.2f}x) "
            f"(bf16 {row['fwd_bwd']['bf16_s'] * 1e3:.1f} ms, "
            f"int8 {row['fwd_bwd']['int8_s'] * 1e3:.1f} ms)",
            flush=True,
        )
    return out


def check_targets(res: dict) -> dict[str, bool]:
    """Which of :data:`TARGETS` the measurements meet."""
    timings = res["timings"]
    largest = max(timings, key=lambda t: t["tokens"])
    small = [t for t in timings if t["tokens"] in (64, 256)]
    return {
        "memory_ratio<=0.55": res["memory_ratio"] <= TARGETS["memory_ratio_max"],
        f"fwd_bwd_speedup@T={largest['tokens']}>=0.9": largest["fwd_bwd"]["speedup"]
        >= TARGETS["speedup_min_large_t"],
        "fwd_bwd_speedup@T=64,256>1": all(
            t["fwd_bwd"]["speedup"] > TARGETS["speedup_min_small_t"] for t in small
        ),
    }


def write_markdown(path: Path, meta: dict, res: dict, targets: dict[str, bool]) -> None:
    """The table: one row per token count, medians and speedups."""
    s = res["shape"]
    lines = [
        "# kt-kernel: INT8 vs bf16 expert base",
        "",
        f"Shape {s['name']}: H={s['H']}, I={s['I']}, E={s['E']}, k={s['k']}, r={s['r']}; "
        f"bf16 compute, fused bf16 LoRA, policy save; {meta['threads']} threads, "
        f"{meta['reps']} interleaved reps, medians. Load average at start: {meta['loadavg']}.",
        "",
        f"Expert weight memory: bf16 {res['bytes_bf16'] / 2**20:.1f} MiB, int8 "
        f"{res['bytes_int8'] / 2**20:.1f} MiB (ratio {res['memory_ratio']:.3f}); quantised "
        f"in {res['quantize_seconds']:.1f} s.",
        "",
        "| T | fwd bf16 ms | fwd int8 ms | fwd speedup | fwd+bwd bf16 ms | fwd+bwd int8 ms "
        "| fwd+bwd speedup | fwd+bwd CPU-time speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in res["timings"]:
        f, fb = t["fwd"], t["fwd_bwd"]
        lines.append(
            f"| {t['tokens']} | {f['bf16_s'] * 1e3:.1f} | {f['int8_s'] * 1e3:.1f} | "
            f"{f['speedup']:.2f} | {fb['bf16_s'] * 1e3:.1f} | {fb['int8_s'] * 1e3:.1f} | "
            f"{fb['speedup']:.2f} | {fb['cpu_speedup']:.2f} |"
        )
    lines += ["", "Quantisation error (vs the bf16 weights):", ""]
    lines += [
        "| projection | max abs error | rel Frobenius error | max step |",
        "|---|---|---|---|",
    ]
    for proj, v in res["quantization_report"].items():
        lines.append(
            f"| {proj} | {v['max_abs_error']:.3g} | {v['rel_fro_error']:.3g} | "
            f"{v['max_step']:.3g} |"
        )
    lines += ["", "Targets:", ""]
    lines += [f"- {k}: {'met' if ok else 'MISSED'}" for k, ok in targets.items()]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse ``--out``/``--quick``, run, write JSON and markdown."""
    args = tm.parser(__doc__).parse_args()
    shape = QUICK if args.quick else MEDIUM
    reps = args.reps or (3 if args.quick else 9)
    meta = {
        "quick": args.quick,
        "reps": reps,
        **tm.machine(),
        "int8_isa": str(torch.ops.kt_kernel.int8_isa()),
        "loadavg": tm.loadavg(),
    }
    res = run_shape(shape, reps)
    targets = check_targets(res)
    tm.write_results(
        args.out,
        "bench_int8",
        {"meta": meta, "result": res, "targets": targets},
        functools.partial(write_markdown, meta=meta, res=res, targets=targets),
    )


if __name__ == "__main__":
    main()
