"""Benchmark every expert weight format (bf16, int8, int4, fp8, mxfp4) on the same weights, one process.

Usage: ``python bench_formats.py --out DIR [--quick] [--reps N] [--tokens T ...]
[--experts E] [--formats F ...]`` (``--formats``: a subset; bf16, the baseline, always runs). Writes ``DIR/bench_formats.json`` and ``DIR/bench_formats.md``.

1. The bf16 matmul peak: a square bf16 ``torch.mm`` (best of 3), GFLOP/s, with the same
   threads, measured at the start and again at the end (the larger is the peak: the cores are
   shared, so the slower one saw more interference).
2. Accuracy at the smallest T: forward ``y``, ``dx`` and the LoRA gradients of the native op
   on each base against the plain-PyTorch reference in fp32 on the original (unquantised)
   weights; relative Frobenius errors.
3. The medium shape of the format targets (Qwen3-30B-A3B's expert width, H=2048, I=768, with
   E=64, k=8; r=16 LoRA; ``--experts 128`` for the whole Qwen3-30B-A3B layer; ``--quick``:
   H=1024, I=384, E=32) at T in {64, 512, 2048}: forward+backward of ``moe_experts_forward`` (bf16 compute,
   fused bf16 LoRA, policy save) on each format, plus the bf16 base with GPT-OSS's
   ``ClampedSwiGLU(1.702, 7.0)`` in place of SwiGLU; repetitions interleaved with the order
   rotated each round (``_timing.interleaved``); medians of wall time and of process CPU time.
   GFLOP/s counts the base and LoRA GEMMs of forward and backward, and is compared to the peak.
   Every expert has its own memory, but only 8 have their own random values (the rest copy
   them): drawing and quantising 64-128 real-size experts takes minutes on 2 shared cores, and
   no kernel's speed depends on the values. At T=64 an expert sees about 8 rows: INT4 takes
   its small-row product there (no tile; ``torch.ops.kt_kernel.gemv_rows()``).
4. Per format, the kernel's per-phase thread CPU time summed over the timed reps
   (``torch.ops.kt_kernel.profile``): where each format's time goes; ``dequantize`` is the tile
   loader's share inside the two GEMM phases of each projection.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _timing module (a script)
import _timing as tm

import kt_kernel as kk

# (name, H, I, E, k, r, token counts); MEDIUM is the shape the targets are stated for.
MEDIUM = ("medium", 2048, 768, 64, 8, 16, (64, 512, 2048))
QUICK = ("quick", 1024, 384, 32, 8, 16, (64, 512))
FORMATS = (
    "bf16",
    "bf16-packed",
    "int8",
    "int8-packed",
    "int8-packed-a8",
    "int4",
    "int4-packed",
    "fp8",
    "mxfp4",
)
DISTINCT = 8  # experts with their own random values; the rest repeat them (own memory)
CLAMPED = "bf16_clamped_swiglu"  # the bf16 base with GPT-OSS's activation
CLAMPED_ACT = kk.ClampedSwiGLU(alpha=1.702, limit=7.0)
TARGETS = {  # speed = t_bf16 / t_format, forward+backward
    "int4_speed_at_2048_min": 0.9,
    "int4_speed_at_64_min": 1.0,  # strictly faster
    "fp8_speed_at_2048_min": 0.85,
    "mxfp4_speed_at_2048_min": 0.9,
    "clamped_swiglu_time_max": 1.05,  # t_clamped / t_swiglu
}


def gflop(tokens: int, k: int, h: int, i: int, r: int) -> float:
    """GFLOP of one forward+backward: base ``2 x 6NHI`` (N = T k), LoRA ``3 x 6Nr(H+I)``.

    Backward through the frozen base is the input gradient only (as much as forward); LoRA
    adds forward, input gradient and factor gradients.
    """
    n = tokens * k
    return (2 * 6 * n * h * i + 3 * 6 * n * r * (h + i)) / 1e9


def _profiled(fn: Callable[[], tm.Sample], acc: dict[str, float]) -> Callable[[], tm.Sample]:
    """``fn`` with the kernel's per-phase CPU seconds of each call added into ``acc``."""

    def run() -> tm.Sample:
        torch.ops.kt_kernel.profile(True)
        sample = fn()
        names, secs = torch.ops.kt_kernel.profile(True)
        for n, s in zip(names, secs, strict=True):
            acc[n] = acc.get(n, 0.0) + s
        return sample

    return run


def _kernel_cpu(phases: dict[str, float], reps: int) -> float:
    """Thread CPU seconds per call summed over the kernel's phases (``dequantize`` is inside
    the GEMM phases, so it is not added again); the phases cover ``reps`` + 1 warm-up calls."""
    return sum(s for p, s in phases.items() if p != "dequantize") / (reps + 1)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def _grads(x, ids, w, dy, weights, lora, reference: bool) -> dict[str, torch.Tensor]:
    """y, dx and the flattened LoRA gradients of one forward+backward."""
    for p in lora.parameters():
        p.grad = None
    dtype = torch.float32 if reference else torch.bfloat16
    xg = x.detach().to(dtype).requires_grad_(True)
    backend = "reference" if reference else "native"
    y = kk.moe_experts_forward(xg, ids, w, weights, lora, policy="save", backend=backend)
    y.backward(dy.to(dtype))
    d_lora = torch.cat([p.grad.float().flatten() for p in lora.parameters()])
    return {"y": y.detach(), "dx": xg.grad, "d_lora": d_lora}


def accuracy(
    spec: kk.ExpertSpec,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    bases: dict[str, kk.ExpertWeights],
    lora: kk.LoraBuffers,
    tokens: int,
    k: int,
) -> dict[str, dict[str, float]]:
    """Per format: relative errors of y, dx and the LoRA gradients against fp32 on the originals."""
    x, ids, w, dy = tm.make_inputs(tokens, spec.hidden_size, spec.num_experts, k, _gen(3))
    fp32 = kk.ExpertWeights.from_parts(
        spec, kk.Dense(torch.float32), (gate_up.float(),), (down.float(),)
    )
    ref = _grads(x, ids, w, dy, fp32, lora, reference=True)
    del fp32
    out = {}
    for fmt, wts in bases.items():
        got = _grads(x, ids, w, dy, wts, lora, reference=False)
        out[fmt] = {key: _rel(got[key], ref[key]) for key in ref}
    return out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tiled(parts: tuple[torch.Tensor, ...], e: int) -> tuple[torch.Tensor, ...]:
    """Parts of ``d`` experts repeated to ``e`` (expert ``x`` = expert ``x % d``), own memory."""
    d = parts[0].shape[0]
    return tuple(torch.cat([p] * (e // d)).contiguous() for p in parts)


def build_bases(
    spec: kk.ExpertSpec,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    distinct: int,
    formats: tuple[str, ...] = FORMATS,
) -> tuple[dict[str, kk.ExpertWeights], dict[str, dict]]:
    """Every format's :class:`ExpertWeights` of the same bf16 weights, and their sizes.

    Experts repeat with period ``distinct`` (:func:`_timing.make_weights`), so only the
    first ``distinct`` are quantised (in one batched call) and their parts repeated.
    """
    e = spec.num_experts
    bases: dict[str, kk.ExpertWeights] = {}
    info: dict[str, dict] = {}
    for name in formats:
        t0 = time.perf_counter()
        if name == "bf16":  # adopt the bf16 tensors as they are: no second copy
            fmt: kk.WeightFormat = kk.Dense(torch.bfloat16)
            gu, dn, err = (gate_up,), (down,), 0.0
        else:
            fmt = kk.FORMATS[name](torch.bfloat16)
            src = (gate_up[:distinct], down[:distinct])
            q = [fmt.quantize(w) for w in src]
            err = max(
                _rel(fmt.dequantize(p, torch.float32), w) for p, w in zip(q, src, strict=True)
            )
            gu, dn = _tiled(q[0], e), _tiled(q[1], e)
        wts = kk.ExpertWeights.from_parts(spec, fmt, gu, dn)
        info[name] = {
            "format": repr(fmt),
            "bytes": wts.nbytes,
            "build_seconds": round(time.perf_counter() - t0, 2),
            "weight_rel_fro_error": err,  # max over gate_up and down
        }
        bases[name] = wts
    for name in formats:
        info[name]["memory_ratio"] = info[name]["bytes"] / info["bf16"]["bytes"]
    return bases, info


def run_shape(
    shape: tuple, tokens_list: tuple[int, ...], reps: int, formats: tuple[str, ...] = FORMATS
) -> dict:
    """Accuracy, then the interleaved timings at each token count of ``shape``."""
    name, h, i, e, k, r, _ = shape
    spec = kk.ExpertSpec(e, h, i)
    gate_up, down = tm.make_weights(h, i, e, distinct=DISTINCT)
    bases, info = build_bases(spec, gate_up, down, DISTINCT, formats)
    lora = tm.make_lora(spec, r)
    acc = accuracy(spec, gate_up, down, bases, lora, min(tokens_list), k)
    for fmt in formats:
        info[fmt]["accuracy_vs_fp32"] = acc[fmt]
    variants = dict(bases)
    clamped_spec = kk.ExpertSpec(e, h, i, CLAMPED_ACT)
    variants[CLAMPED] = kk.ExpertWeights.from_parts(
        clamped_spec, kk.Dense(torch.bfloat16), (gate_up,), (down,)
    )
    loras = dict.fromkeys(bases, lora)
    loras[CLAMPED] = tm.make_lora(clamped_spec, r)  # the same values (same seed), its own spec
    gen = _gen(2)
    rows = []
    for tokens in tokens_list:
        x, ids, w, dy = tm.make_inputs(tokens, h, e, k, gen)
        phases: dict[str, dict[str, float]] = {v: {} for v in variants}
        fns = {
            v: _profiled(functools.partial(tm.step, x, ids, w, dy, wts, loras[v]), phases[v])
            for v, wts in variants.items()
        }
        samples = tm.interleaved(fns, reps, warmup=True)
        work = gflop(tokens, k, h, i, r)
        base_wall = tm.median_wall(samples["bf16"])
        base_cpu = tm.median_cpu(samples["bf16"])
        base_kernel = _kernel_cpu(phases["bf16"], reps)
        row: dict = {"tokens": tokens, "gflop": work, "loadavg": tm.loadavg()}
        for v in variants:
            wall, cpu = tm.median_wall(samples[v]), tm.median_cpu(samples[v])
            row[v] = {
                "seconds": wall,
                "cpu_seconds": cpu,
                "gflops": work / wall,
                "speed_vs_bf16": base_wall / wall,
                "cpu_speed_vs_bf16": base_cpu / cpu,
                # the kernel's own thread CPU time: the least disturbed by other users' load
                "kernel_cpu_seconds": _kernel_cpu(phases[v], reps),
                "kernel_cpu_speed_vs_bf16": base_kernel / _kernel_cpu(phases[v], reps),
                "samples": [s[0] for s in samples[v]],
                # warm-up included: the phases of reps + 1 calls, per call
                "phase_cpu_seconds": {
                    p: round(s / (reps + 1), 5) for p, s in phases[v].items() if s > 0
                },
            }
        rows.append(row)
        print(
            f"[{name}] T={tokens} (load {row['loadavg'][0]}): "
            + ", ".join(
                f"{v} {row[v]['seconds'] * 1e3:.0f} ms ({row[v]['speed_vs_bf16']:.2f}x)"
                for v in variants
            ),
            flush=True,
        )
    return {
        "shape": {"name": name, "H": h, "I": i, "E": e, "k": k, "r": r},
        "formats": info,
        "timings": rows,
    }


def check_targets(res: dict) -> dict[str, dict[str, bool] | None]:
    """Which of :data:`TARGETS` the measurements meet, by wall time and by the kernel's CPU time.

    None: that T was not run. On shared cores the wall-time ratio moves with other users'
    load; the kernel's summed thread CPU time (``kernel_cpu_speed_vs_bf16``) moves far less.
    """
    by_t = {row["tokens"]: row for row in res["timings"]}
    largest = max(by_t)
    checks = {  # name: (T, variant, minimum speed vs bf16, strictly above)
        "int4 >= 0.9x bf16 at T=2048": (2048, "int4", TARGETS["int4_speed_at_2048_min"], False),
        "int4 faster than bf16 at T=64": (64, "int4", TARGETS["int4_speed_at_64_min"], True),
        "fp8 >= 0.85x bf16 at T=2048": (2048, "fp8", TARGETS["fp8_speed_at_2048_min"], False),
        "mxfp4 >= 0.9x bf16 at T=2048": (2048, "mxfp4", TARGETS["mxfp4_speed_at_2048_min"], False),
        f"clamped_swiglu within 5% of swiglu at T={largest}": (
            largest,
            CLAMPED,
            1 / TARGETS["clamped_swiglu_time_max"],
            False,
        ),
    }
    out: dict[str, dict[str, bool] | None] = {}
    for name, (tokens, v, bound, strict) in checks.items():
        row = by_t.get(tokens)
        if row is None or v not in row:
            out[name] = None
            continue
        out[name] = {
            measure: (row[v][key] > bound if strict else row[v][key] >= bound)
            for measure, key in (
                ("wall", "speed_vs_bf16"),
                ("kernel_cpu", "kernel_cpu_speed_vs_bf16"),
            )
        }
    for fmt, bound in (("int4", 0.30), ("mxfp4", 0.27)):
        if fmt in res["formats"]:
            out[f"{fmt} memory <= {bound:.2f}x bf16"] = {
                "bytes": res["formats"][fmt]["memory_ratio"] <= bound
            }
    return out


def write_markdown(path: Path, meta: dict, res: dict, targets: dict) -> None:
    """Tables of times per T and variant, of bytes and accuracy per format, and the targets."""
    s = res["shape"]
    formats = tuple(res["formats"])
    variants = (*formats, CLAMPED)
    lines = [
        "# kt-kernel: expert weight formats (forward+backward)",
        "",
        f"Shape {s['name']}: H={s['H']}, I={s['I']}, E={s['E']}, k={s['k']}, r={s['r']}; bf16 "
        f"compute, fused bf16 LoRA, policy save; {meta['threads']} threads on {meta['cpus']} "
        f"shared cores ({meta['isa']}), {meta['reps']} interleaved reps, medians. bf16 matmul "
        f"peak {meta['peak_gflops']:.0f} GFLOP/s (start {meta['peak_gflops_start']:.0f}, end "
        f"{meta['peak_gflops_end']:.0f}). Load average (1, 5, 15 min) at start "
        f"{meta['loadavg_start']}, at end {meta['loadavg_end']}.",
        "",
        "| T | variant | ms | GFLOP/s | of peak | speed vs bf16 | process CPU speed vs bf16 "
        "| kernel CPU ms | kernel CPU speed vs bf16 | dequantize share of kernel CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["timings"]:
        for v in variants:
            c = row[v]
            ph = c["phase_cpu_seconds"]
            deq = ph.get("dequantize", 0.0) / max(
                sum(ph.values()) - ph.get("dequantize", 0.0), 1e-9
            )
            lines.append(
                f"| {row['tokens']} | {v} | {c['seconds'] * 1e3:.0f} | {c['gflops']:.0f} | "
                f"{c['gflops'] / meta['peak_gflops']:.2f} | {c['speed_vs_bf16']:.2f} | "
                f"{c['cpu_speed_vs_bf16']:.2f} | {c['kernel_cpu_seconds'] * 1e3:.0f} | "
                f"{c['kernel_cpu_speed_vs_bf16']:.2f} | {deq:.2f} |"
            )
    lines += [
        "",
        f"Accuracy at T={min(r['tokens'] for r in res['timings'])}: relative Frobenius error "
        "against the fp32 reference on the original weights.",
        "",
        "| format | expert MiB | bytes vs bf16 | weights | y | dx | LoRA grads |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt in formats:
        f = res["formats"][fmt]
        a = f["accuracy_vs_fp32"]
        lines.append(
            f"| {fmt} | {f['bytes'] / 2**20:.0f} | {f['memory_ratio']:.3f} | "
            f"{f['weight_rel_fro_error']:.2g} | {a['y']:.2g} | {a['dx']:.2g} | "
            f"{a['d_lora']:.2g} |"
        )
    lines += ["", "Targets:", ""]
    lines += [
        f"- {k}: "
        + (
            "not run"
            if ok is None
            else ", ".join(f"{m}: {'met' if v else 'MISSED'}" for m, v in ok.items())
        )
        for k, ok in targets.items()
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse the options, run, write JSON and markdown."""
    ap = tm.parser(__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts to time")
    ap.add_argument("--experts", type=int, default=None, help="experts E (a multiple of 8)")
    ap.add_argument(
        "--formats", nargs="+", choices=FORMATS, default=None, help="formats (bf16 always runs)"
    )
    args = ap.parse_args()
    formats = tuple(f for f in FORMATS if f == "bf16" or f in (args.formats or FORMATS))
    shape = QUICK if args.quick else MEDIUM
    if args.experts is not None:
        if args.experts < DISTINCT or args.experts % DISTINCT:
            ap.error(f"--experts must be a positive multiple of {DISTINCT}, got {args.experts}")
        shape = (f"{shape[0]}-e{args.experts}", *shape[1:3], args.experts, *shape[4:])
    tokens = tuple(args.tokens or shape[-1])
    reps = args.reps or (2 if args.quick else 3)
    peak_size = 2048 if args.quick else 4096
    loadavg_start = tm.loadavg()
    peak_start = tm.matmul_peak(torch.bfloat16, peak_size)
    print(f"bf16 matmul peak: {peak_start:.0f} GFLOP/s (load {loadavg_start})", flush=True)
    res = run_shape(shape, tokens, reps, formats)
    peak_end = tm.matmul_peak(torch.bfloat16, peak_size)
    meta = {"quick": args.quick, "reps": reps, **tm.run_meta(peak_start, peak_end, loadavg_start)}
    for row in res["timings"]:
        for v in (*formats, CLAMPED):
            row[v]["fraction_of_peak"] = row[v]["gflops"] / meta["peak_gflops"]
    targets = check_targets(res)
    tm.write_results(
        args.out,
        "bench_formats",
        {"meta": meta, "result": res, "targets": targets},
        functools.partial(write_markdown, meta=meta, res=res, targets=targets),
    )


if __name__ == "__main__":
    main()
