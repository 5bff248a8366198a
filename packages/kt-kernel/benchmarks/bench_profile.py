"""Per-phase profile of the native expert op (forward + backward, bf16, rank-16 LoRA): issue 25.

Usage: ``python bench_profile.py --out DIR [--quick] [--reps N] [--shapes NAME ...]
[--tokens T ...] [--stem NAME] [--format bf16|bf16-packed]``. Writes ``DIR/<stem>.json``
and ``DIR/<stem>.md`` (stem ``bench_profile``).

For each shape and token count (defaults: issue 25's table, H=2048, I=1408, E=64, k=6 and the
Qwen3-30B-A3B layer H=2048, I=768, E=128, k=8, each at T=512 and T=2048; bf16 Dense base or
``--format bf16-packed``, fused bf16 LoRA r=16, policy save, uniform random top-k routing),
after one warm-up step, ``--reps`` steps (default 3), each with the kernel's counters reset,
and per phase the median of:

- thread CPU seconds summed over threads (``torch.ops.kt_kernel.profile``) and its share of
  the kernel's CPU time;
- the phase's FLOPs, counted from the products it runs on the ``N = T k`` routed rows (e.g.
  gate_up ``2 N H 2I``; LoRA products with rank r; backward ``dx``, ``dh`` and the LoRA factor
  gradients), and its rate per thread CPU second against the **single-thread bf16 matmul peak
  per CPU second** (a 2048^3 ``torch.mm`` on one thread timed by thread CPU time, best of 5,
  at start and end; the larger is the peak). The kernel's GEMMs are single-threaded, one per
  task, so this is the bound a phase's products can reach. Element-wise phases report bytes;
- thread imbalance of each parallel region (``torch.ops.kt_kernel.profile_regions``):
  the largest thread's busy (CPU) time over the mean, busy over threads x wall, and the tail
  (wall from the first thread's last task end to the last thread's);
- the rows-per-expert distribution of the routing, and single-thread ``torch.mm`` rates of
  the kernel's four base products at 16-256 rows (the small-row gap the issue names).

The 2-thread wall peak (a 4096^3 ``torch.mm``, as ``bench_formats`` measures it) and each
step's wall time are recorded too, but on the shared cores wall time moves with other
users' load; thread CPU time moves far less. The analysis in the markdown is written by
hand after a run (the script leaves a marker for it).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _timing, _impls modules
import _timing as tm
from _impls import Shape  # issue 25's expert layers, rank 16

import kt_kernel as kk

SHAPES = {
    "e64_i1408_k6": Shape("e64_i1408_k6", 2048, 1408, 64, 6, 16),
    "qwen3_30b_a3b": Shape("qwen3_30b_a3b", 2048, 768, 128, 8, 16),
}
QUICK = Shape("quick", 512, 256, 16, 4, 16)
TOKENS = (512, 2048)
DISTINCT = 8  # experts with their own random values; the rest repeat them (own memory)
GEMM_ROWS = (16, 32, 64, 128, 256)
COLD_EXPERTS = 32  # experts a cold product pass streams (>= 150 MB of weights at these shapes)
BASE_PHASES = ("gemm_gate_up", "gemm_down", "bwd_gemm_down", "bwd_gemm_gate_up")
LORA_PHASES = (
    "lora_gate_up",
    "lora_down",
    "bwd_lora_down",
    "bwd_lora_gate_up",
    "lora_weight_grad",
    "lora_weight_grad_prep",
)
# Kernel phases in the order they run; "dequantize" is inside the GEMM phases (zero for bf16).
PHASE_ORDER = (
    "setup",
    "route",
    "prepare_lora",
    "gather",
    "gemm_gate_up",
    "lora_gate_up",
    "activation",
    "gemm_down",
    "lora_down",
    "scatter",
    "recompute",
    "bwd_gemm_down",
    "bwd_lora_down",
    "activation_bwd",
    "bwd_lora_gate_up",
    "bwd_gemm_gate_up",
    "lora_weight_grad",
    "lora_weight_grad_prep",
    "bwd_scatter",
)
# Run on the calling thread only.
SERIAL_PHASES = ("setup", "route", "prepare_lora", "lora_weight_grad_prep")


def phase_work(s: Shape, tokens: int) -> dict[str, dict[str, float]]:
    """Per phase: FLOPs and bytes moved (read + write) of one forward + backward (policy save).

    Counted on the ``N = T k`` routed rows, fused LoRA layout (A_gu ``[r, H]``, B_gu
    ``[2I, r]``, A_d ``[r, I]``, B_d ``[H, r]``). Element-wise phases have no matmul FLOPs.
    """
    n, h, i, r = tokens * s.top_k, s.hidden, s.inter, s.rank
    b = 2  # bf16 bytes

    def w(flops: float = 0.0, nbytes: float = 0.0) -> dict[str, float]:
        return {"flops": flops, "bytes": nbytes}

    return {
        "gather": w(nbytes=3 * 2 * n * h * b),  # x (fwd), x and dy (bwd): read + write
        "gemm_gate_up": w(2 * n * h * 2 * i),
        "lora_gate_up": w(2 * n * h * r + 2 * n * r * 2 * i),
        "activation": w(nbytes=n * 3 * i * b),
        "gemm_down": w(2 * n * i * h),
        "lora_down": w(2 * n * i * r + 2 * n * r * h),
        "scatter": w(nbytes=(n + tokens) * h * b),
        "bwd_gemm_down": w(2 * n * h * i),  # dh = dy_rows @ W_down
        "bwd_lora_down": w(2 * n * h * r + 2 * n * r * i),
        "activation_bwd": w(nbytes=n * 6 * i * b),
        "bwd_lora_gate_up": w(2 * n * 2 * i * r),  # dz = dgu @ B_gu
        "bwd_gemm_gate_up": w(2 * n * 2 * i * h + 2 * n * r * h),  # dx rows, + dz @ A_gu
        # d B_down, d A_down, d B_gu, d A_gu: (out x r) or (r x in) summed over the rows
        "lora_weight_grad": w(2 * n * h * r + 2 * n * r * i + 2 * n * 2 * i * r + 2 * n * r * h),
        "bwd_scatter": w(nbytes=(n + tokens) * h * b),
    }


def gemm_rows(s: Shape, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, dict[int, float]]:
    """Single-thread GFLOP per CPU second of the op's base products at few rows.

    ``gate_up_nt``: ``x [m, H] @ W_gu^T``; ``down_nt``: ``h [m, I] @ W_d^T``; ``dx_nn``:
    ``dgu [m, 2I] @ W_gu``; ``dh_nn``: ``dy [m, H] @ W_d`` (ATen ``mm`` as the kernel calls it).
    Plain names: one expert's weights again and again (they stay in cache); ``_cold``: one
    pass over the first :data:`COLD_EXPERTS` experts (hundreds of MB, far beyond the last-level
    cache), the weights streamed from memory once per product as in the op.
    """
    h, i = s.hidden, s.inter
    cold = min(COLD_EXPERTS, s.experts)
    prods = {
        "gate_up_nt": (h, lambda a, o, e: torch.mm(a, gate_up[e].t(), out=o), 2 * i),
        "down_nt": (i, lambda a, o, e: torch.mm(a, down[e].t(), out=o), h),
        "dx_nn": (2 * i, lambda a, o, e: torch.mm(a, gate_up[e], out=o), h),
        "dh_nn": (h, lambda a, o, e: torch.mm(a, down[e], out=o), i),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, dict[int, float]] = {}
    try:
        for name, (k_dim, fn, n_dim) in prods.items():
            out[name], out[f"{name}_cold"] = {}, {}
            for m in GEMM_ROWS:
                a = torch.randn(m, k_dim).to(torch.bfloat16)
                o = torch.empty(m, n_dim, dtype=torch.bfloat16)
                fn(a, o, 0)
                best = float("inf")
                for _ in range(3):
                    c0 = time.thread_time()
                    fn(a, o, 0)
                    best = min(best, time.thread_time() - c0)
                out[name][m] = 2.0 * m * k_dim * n_dim / best / 1e9
                c0 = time.thread_time()
                for e in range(cold):
                    fn(a, o, e)
                out[f"{name}_cold"][m] = (
                    2.0 * m * k_dim * n_dim * cold / (time.thread_time() - c0) / 1e9
                )
    finally:
        torch.set_num_threads(threads)
    return out


def rows_per_expert(ids: torch.Tensor, experts: int, tile_rows: int) -> dict:
    """Distribution of routed rows per expert and the resulting (expert, row tile) tasks."""
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    q = statistics.quantiles(counts, n=10)
    tiles = [-(-c // tile_rows) for c in counts]
    return {
        "min": min(counts),
        "p10": q[0],
        "median": statistics.median(counts),
        "p90": q[-1],
        "max": max(counts),
        "mean": sum(counts) / experts,
        "experts_hit": sum(c > 0 for c in counts),
        "tasks": sum(tiles),
        "tile_rows": tile_rows,
    }


def _counters(op: str) -> dict[str, float]:
    names, vals = getattr(torch.ops.kt_kernel, op)(True)
    return dict(zip(names, vals, strict=True))


def profile_config(
    s: Shape, tokens: int, reps: int, gen: torch.Generator, weight_dtype: str = "bf16"
) -> dict:
    """Warm-up plus ``reps`` profiled steps of one shape at ``tokens``; per-rep counters."""
    spec = kk.ExpertSpec(s.experts, s.hidden, s.inter)
    gate_up, down = tm.make_weights(s.hidden, s.inter, s.experts, distinct=min(DISTINCT, s.experts))
    if weight_dtype == "bf16":  # adopt the tensors: no second copy
        fmt: kk.WeightFormat = kk.Dense(torch.bfloat16)
        weights = kk.ExpertWeights.from_parts(spec, fmt, (gate_up,), (down,))
    else:
        weights = kk.ExpertWeights.from_fused(
            spec, gate_up, down, dtype=torch.bfloat16, weight_dtype=weight_dtype
        )
        fmt = weights.format
    lora = tm.make_lora(spec, s.rank)
    x, ids, w, dy = tm.make_inputs(tokens, s.hidden, s.experts, s.top_k, gen)
    step = functools.partial(tm.step, x, ids, w, dy, weights, lora)
    step()  # warm-up: oneDNN primitives, scratch pool, first-touch pages
    _counters("profile")
    _counters("profile_regions")
    runs = []
    for _ in range(reps):
        wall, cpu = step()
        runs.append(
            {
                "wall": wall,
                "process_cpu": cpu,
                "phases": _counters("profile"),
                "regions": _counters("profile_regions"),
            }
        )
    return {
        "runs": runs,
        "rows_per_expert": rows_per_expert(ids, s.experts, fmt.tile_rows),
        "gemm_rows_gflops": gemm_rows(s, gate_up, down),
        "loadavg": tm.loadavg(),
    }


def summarise(s: Shape, tokens: int, raw: dict, peak: float) -> dict:
    """Medians over the reps: phases (CPU s, share, GFLOP, rate, of peak), regions, the step."""
    med = statistics.median
    runs = [dict(r) for r in raw["runs"]]  # the raw counters stay as measured
    work = phase_work(s, tokens)
    for r in runs:
        # The weight-gradient phase holds a serial prologue (routing-weighted copies, zeroed
        # gradients) on the calling thread plus the per-expert tasks; the tasks' busy time
        # is the region's, so the prologue is the rest.
        ph = r["phases"] = dict(r["phases"])
        tasks_cpu = min(r["regions"].get("lora_weight_grad.busy", 0.0), ph["lora_weight_grad"])
        ph["lora_weight_grad_prep"] = ph["lora_weight_grad"] - tasks_cpu
        ph["lora_weight_grad"] = tasks_cpu
    names = [p for p in PHASE_ORDER if any(r["phases"].get(p, 0) > 0 for r in runs)]
    kernel = med(
        sum(v for p, v in r["phases"].items() if p != "dequantize") for r in runs
    )  # dequantize is inside the GEMM phases
    phases = {}
    for p in names:
        sec = med(r["phases"][p] for r in runs)
        wk = work.get(p, {"flops": 0.0, "bytes": 0.0})
        rate = wk["flops"] / sec / 1e9 if sec > 0 and wk["flops"] else None
        phases[p] = {
            "cpu_seconds": sec,
            "over_peak_seconds": sec - wk["flops"] / peak / 1e9,
            "share": sec / kernel,
            "gflop": wk["flops"] / 1e9,
            "gflops_per_cpu_s": rate,
            "of_peak": rate / peak if rate else None,
            "gbytes_per_cpu_s": wk["bytes"] / sec / 1e9 if sec > 0 and wk["bytes"] else None,
        }
    total_flops = sum(v["flops"] for v in work.values())
    groups = {"base GEMMs": BASE_PHASES, "LoRA": LORA_PHASES}
    groups["rest"] = tuple(p for p in phases if not any(p in g for g in groups.values()))
    lost_total = kernel - total_flops / peak / 1e9
    loss = {}
    for g, members in groups.items():
        cpu = sum(phases[p]["cpu_seconds"] for p in members if p in phases)
        over = sum(phases[p]["over_peak_seconds"] for p in members if p in phases)
        loss[g] = {
            "cpu_seconds": cpu,
            "share": cpu / kernel,
            "over_peak_seconds": over,
            "share_of_loss": over / lost_total,
        }
    regions = {}
    for reg in ("forward_tasks", "backward_tasks", "lora_weight_grad"):
        get = {
            f: med(r["regions"][f"{reg}.{f}"] for r in runs)
            for f in ("calls", "threads", "wall", "slots", "busy", "max_busy", "tail")
        }
        if not get["calls"]:
            continue
        mean_busy = get["busy"] / (get["threads"] / get["calls"])
        regions[reg] = {
            **get,
            "max_over_mean_busy": get["max_busy"] / mean_busy if mean_busy else None,
            "busy_over_slots": get["busy"] / get["slots"] if get["slots"] else None,
        }
    wall, proc = med(r["wall"] for r in runs), med(r["process_cpu"] for r in runs)
    threads = torch.ops.kt_kernel.get_num_threads()
    return {
        "shape": asdict(s),
        "tokens": tokens,
        "gflop": total_flops / 1e9,
        "wall_seconds": wall,
        "wall_samples": [r["wall"] for r in runs],
        "process_cpu_seconds": proc,
        "kernel_cpu_seconds": kernel,
        "outside_kernel_cpu_seconds": proc - kernel,
        "serial_cpu_seconds": sum(phases[p]["cpu_seconds"] for p in SERIAL_PHASES if p in phases),
        "kernel_gflops_per_cpu_s": total_flops / kernel / 1e9,
        "kernel_of_peak": total_flops / kernel / 1e9 / peak,
        "wall_gflops": total_flops / wall / 1e9,
        "wall_x_threads_over_process_cpu": wall * threads / proc,
        "phases": phases,
        "loss_by_group": loss,
        "regions": regions,
        "rows_per_expert": raw["rows_per_expert"],
        "gemm_rows_gflops": raw["gemm_rows_gflops"],
        "loadavg": raw["loadavg"],
    }


def machine_info() -> dict:
    """CPU model and the ISA features that matter here (AVX-512-BF16, AMX), from /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        **tm.machine(),
        "cpu_model": model,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "amx_tile": "amx_tile" in flags,
        "kernel_threads": int(torch.ops.kt_kernel.get_num_threads()),
    }


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    """Summary, per-phase tables, imbalance, rows per expert and small-row GEMM rates."""
    flags = ", ".join(
        f"{k}: {'yes' if meta[k] else 'no'}" for k in ("avx512_bf16", "amx_bf16", "amx_tile")
    )
    lines = [
        "# kt-kernel: per-phase profile of forward + backward (issue 25)",
        "",
        f"Date {meta['date']}; command `{meta['command']}`.",
        f"Machine: {meta['cpu_model']}, {meta['cpus']} cores, {flags}; kernel ISA path "
        f"{meta['isa']}; {meta['kernel_threads']} kernel threads; torch {meta['torch']}, "
        f"kt-kernel {meta['kt_kernel']}. The cores are **shared** with other jobs: load average "
        f"(1, 5, 15 min) {meta['loadavg_start']} at start, {meta['loadavg_end']} at end. Rates "
        "below use thread CPU time, which that load disturbs least; wall figures are for "
        "reference only.",
        "",
        f"Peak: single-thread bf16 matmul **{meta['peak_1t']:.1f} GFLOP per CPU-second** "
        f"(start {meta['peak_1t_start']:.1f}, end {meta['peak_1t_end']:.1f}); 2-thread wall "
        f"peak {meta['peak_wall']:.0f} GFLOP/s (start {meta['peak_wall_start']:.0f}, end "
        f"{meta['peak_wall_end']:.0f}). {meta.get('format', 'bf16')} base (bf16 compute), fused bf16 "
        "LoRA r=16, policy save, "
        f"uniform random top-k routing, {meta['reps']} reps after a warm-up, medians.",
        "",
        "## Whole op",
        "",
        "| shape | T | GFLOP | kernel CPU ms | GFLOP/CPU-s | of 1-thread peak | process CPU "
        "ms | outside kernel phases ms | serial phases ms | wall ms (loaded) | wall x threads "
        "/ CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']['name']} | {r['tokens']} | {r['gflop']:.1f} | "
            f"{r['kernel_cpu_seconds'] * 1e3:.0f} | {r['kernel_gflops_per_cpu_s']:.1f} | "
            f"{r['kernel_of_peak']:.0%} | {r['process_cpu_seconds'] * 1e3:.0f} | "
            f"{r['outside_kernel_cpu_seconds'] * 1e3:.0f} | {r['serial_cpu_seconds'] * 1e3:.1f} | "
            f"{r['wall_seconds'] * 1e3:.0f} | {r['wall_x_threads_over_process_cpu']:.2f} |"
        )
    lines += [
        "",
        "Where the CPU time above the peak goes (ms over peak = CPU ms minus the phase's "
        "FLOPs at the single-thread peak; element-wise phases count whole):",
        "",
        "| shape | T | group | CPU ms | share of kernel CPU | ms over peak | share of the loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for g, v in r["loss_by_group"].items():
            lines.append(
                f"| {r['shape']['name']} | {r['tokens']} | {g} | {v['cpu_seconds'] * 1e3:.0f} | "
                f"{v['share']:.0%} | {v['over_peak_seconds'] * 1e3:.0f} | "
                f"{v['share_of_loss']:.0%} |"
            )
    lines += [
        "",
        "## Phases (thread CPU time summed over threads, per step)",
        "",
        "FLOP rates are per CPU-second against the single-thread peak; element-wise and "
        "copy phases show GB moved (read + write) per CPU-second instead.",
    ]
    for r in rows:
        lines += [
            "",
            f"### {r['shape']['name']} (H={r['shape']['hidden']}, I={r['shape']['inter']}, "
            f"E={r['shape']['experts']}, k={r['shape']['top_k']}), T={r['tokens']}",
            "",
            "| phase | CPU ms | share | GFLOP | GFLOP/CPU-s | of peak | ms over peak | GB/CPU-s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p, v in r["phases"].items():
            lines.append(
                f"| {p} | {v['cpu_seconds'] * 1e3:.1f} | {v['share']:.1%} | "
                f"{_f(v['gflop'] or None, '.2f')} | {_f(v['gflops_per_cpu_s'], '.1f')} | "
                f"{_f(v['of_peak'], '.0%')} | {v['over_peak_seconds'] * 1e3:.1f} | "
                f"{_f(v['gbytes_per_cpu_s'], '.1f')} |"
            )
    lines += [
        "",
        "## Thread imbalance of the parallel regions (per step)",
        "",
        "max/mean busy: the busiest thread's CPU time over the mean (1.00 = even; from CPU "
        "time). busy/(threads x wall) and tail come from wall time and so include other "
        "users' preemption on the shared cores.",
        "",
        "| shape | T | region | tasks' wall ms | busy CPU ms | max/mean busy | busy / "
        "(threads x wall) | tail ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for reg, v in r["regions"].items():
            lines.append(
                f"| {r['shape']['name']} | {r['tokens']} | {reg} | {v['wall'] * 1e3:.0f} | "
                f"{v['busy'] * 1e3:.0f} | {_f(v['max_over_mean_busy'], '.3f')} | "
                f"{_f(v['busy_over_slots'], '.2f')} | {v['tail'] * 1e3:.1f} |"
            )
    lines += [
        "",
        "## Rows per expert (uniform random routing)",
        "",
        "| shape | T | min | p10 | median | p90 | max | mean | (expert, tile) tasks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["rows_per_expert"]
        lines.append(
            f"| {r['shape']['name']} | {r['tokens']} | {d['min']} | {d['p10']:.0f} | "
            f"{d['median']:.0f} | {d['p90']:.0f} | {d['max']} | {d['mean']:.1f} | "
            f"{d['tasks']} (tile {d['tile_rows']}) |"
        )
    lines += [
        "",
        "## Single-thread `torch.mm` of one expert's base products at m rows (GFLOP/CPU-s, "
        "of peak)",
        "",
        "| shape | product | " + " | ".join(f"m={m}" for m in GEMM_ROWS) + " |",
        "|---|---|" + "---|" * len(GEMM_ROWS),
    ]
    seen = set()
    for r in rows:
        if r["shape"]["name"] in seen:
            continue
        seen.add(r["shape"]["name"])
        for prod, by_m in r["gemm_rows_gflops"].items():
            cells = " | ".join(
                f"{by_m[m]:.0f} ({by_m[m] / meta['peak_1t']:.0%})" for m in GEMM_ROWS
            )
            lines.append(f"| {r['shape']['name']} | {prod} | {cells} |")
    lines += ["", "## Analysis", "", "<!-- written by hand after the run -->", ""]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse the options, profile every configuration, write JSON and markdown."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--quick", action="store_true", help="a tiny shape at T=64, 1 rep")
    ap.add_argument("--reps", type=int, default=None, help="profiled steps per configuration")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts")
    ap.add_argument("--stem", default="bench_profile", help="output file name stem")
    ap.add_argument(
        "--format",
        choices=("bf16", "bf16-packed"),
        default="bf16",
        help="the experts' weight format (products of their own where it has them)",
    )
    ap.add_argument(
        "--render", type=Path, default=None, help="re-summarise a previous run's JSON (no timing)"
    )
    args = ap.parse_args()
    if args.render is not None:
        prev = json.loads(args.render.read_text())
        meta, raws = prev["meta"], prev["raw"]
        for raw in raws:  # JSON keys are strings
            raw["gemm_rows_gflops"] = {
                k: {int(m): v for m, v in by_m.items()}
                for k, by_m in raw["gemm_rows_gflops"].items()
            }
        rows = [
            summarise(Shape(**r["shape"]), r["tokens"], raw, meta["peak_1t"])
            for r, raw in zip(prev["results"], raws, strict=True)
        ]
        tm.write_results(
            args.out,
            args.stem,
            {"meta": meta, "results": rows, "raw": raws},
            functools.partial(write_markdown, meta=meta, rows=rows),
        )
        return
    if not kk.backend_info().native_available:
        ap.error("the native kt-kernel extension is not available")
    shapes = [QUICK] if args.quick else [SHAPES[n] for n in (args.shapes or SHAPES)]
    tokens = tuple(args.tokens or ((64,) if args.quick else TOKENS))
    reps = args.reps or (1 if args.quick else 3)
    meta: dict = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "reps": reps,
        "format": args.format,
        **machine_info(),
        "loadavg_start": tm.loadavg(),
    }
    peak_size = 512 if args.quick else 2048
    p1_start = tm.peak_1t(peak_size)
    pw_start = tm.matmul_peak(torch.bfloat16, 2 * peak_size)
    print(f"peak: 1 thread {p1_start:.1f} GFLOP/CPU-s, wall {pw_start:.0f} GFLOP/s", flush=True)
    gen = torch.Generator().manual_seed(2)
    raws = []
    for s in shapes:
        for t in tokens:
            raw = profile_config(s, t, reps, gen, args.format)
            raws.append((s, t, raw))
            print(f"[{s.name}] T={t} done (load {raw['loadavg']})", flush=True)
    p1_end = tm.peak_1t(peak_size)
    pw_end = tm.matmul_peak(torch.bfloat16, 2 * peak_size)
    meta.update(
        peak_1t=max(p1_start, p1_end),
        peak_1t_start=p1_start,
        peak_1t_end=p1_end,
        peak_wall=max(pw_start, pw_end),
        peak_wall_start=pw_start,
        peak_wall_end=pw_end,
        loadavg_end=tm.loadavg(),
    )
    rows = [summarise(s, t, raw, meta["peak_1t"]) for s, t, raw in raws]
    tm.write_results(
        args.out,
        args.stem,
        {"meta": meta, "results": rows, "raw": [r for _, _, r in raws]},
        functools.partial(write_markdown, meta=meta, rows=rows),
    )


if __name__ == "__main__":
    main()
