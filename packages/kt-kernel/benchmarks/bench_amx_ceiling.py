"""The AMX-BF16 tile loop's own rate against the matmul peak: how far any AMX product can go here.

Usage: ``python bench_amx_ceiling.py --out DIR [--quick] [--reps N]``. Writes
``DIR/bench_amx_ceiling.{json,md}``; on a CPU or OS without AMX tiles (or without g++) it
writes why and exits 0.

``amx_tile_loop.cpp`` (beside this file, built here with g++) is the innermost loop of an AMX
product and nothing else: B already in tile layout, no gather or conversion, 2 x 2 C tiles per
32-row tile. With its operands in L2 its rate is the ceiling of the tile arithmetic; reading
its B tiles from memory (with or without a software prefetch of the next pass) it shows what
feeding the tiles from memory costs. Each round measures, on one thread, in thread CPU time:
- the single-thread bf16 ``torch.mm`` peak at 2048^3 (the peak the kernel benchmarks use);
- the loop with its operands in L1, with one pass's weights in L2, and with the weights of
  Qwen3-30B-A3B's gate_up ``x W^T`` (K=2048) streamed pass after pass from memory (1 GiB of
  them, twice this machine's L3) at 128 rows per expert (T=2048, E=128, k=8) and at 32 (T=512);
- the kernel's own bf16-packed ``x W^T`` (``torch.ops.kt_kernel.project``) at those rows over
  128 distinct experts (768 MiB: one Qwen3-30B-A3B layer's gate_up);
- at 128 rows, the loop that builds B as the kernel does, its read alone and its tile products
  alone: whether reading the weights hides behind the arithmetic;
- where the CPU has AMX-INT8, the same tile products on int8 tiles, and the built loop over
  int8 weights (an int8 x int8 product's ceiling);
- one thread's memory read rate.
Ratios to the peak are taken per round, then the median.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _timing as tm
import torch
from bench_products import expert_bank

import kt_kernel as kk

SOURCE = Path(__file__).with_name("amx_tile_loop.cpp")
N, K = 1536, 2048  # gate_up of Qwen3-30B-A3B
# (name, what it stands for, row tiles, steps, passes, reps, prefetch, mode): `steps` 64 is
# K=2048; `mode` as in amx_tile_loop.cpp (0: B straight from memory; 1: built as the kernel
# does; 2: the build's reads alone; 3: the tile products alone; 4: 3 on AMX-INT8 tiles; 5: 1 on
# AMX-INT8 tiles, from int8 weights).
T2048 = "gate_up x W^T at T=2048 (E=128), weights from memory"
T512 = "gate_up x W^T at T=512 (E=128), weights from memory"
BUILT = "B tiles built from the weights by the first row tile and reused, as the kernel does"
LOOPS = (
    ("loop, L1", "operands in L1 (32 rows, K=256)", 1, 8, 1, 20000, 0, 0),
    ("loop, L2", "one pass's weights in L2, 128 rows, K=2048", 4, 64, 1, 400, 0, 0),
    ("loop, memory, 128 rows", T2048 + ", hardware prefetch only", 4, 64, 8192, 1, 0, 0),
    (
        "loop, memory, 128 rows, prefetched",
        T2048 + ", next pass prefetched to L2",
        4,
        64,
        4096,
        1,
        1,
        0,
    ),
    ("loop, memory, 32 rows", T512 + ", hardware prefetch only", 1, 64, 8192, 1, 0, 0),
    (
        "loop, memory, 32 rows, prefetched",
        T512 + ", next pass prefetched to L2",
        1,
        64,
        8192,
        1,
        1,
        0,
    ),
    ("built, 128 rows", T2048 + "; " + BUILT, 4, 64, 8192, 1, 0, 1),
    ("built, 32 rows", T512 + "; " + BUILT, 1, 64, 8192, 1, 0, 1),
    (
        "built, 128 rows, prefetched",
        T2048 + "; " + BUILT + ", next pass prefetched",
        4,
        64,
        8192,
        1,
        1,
        1,
    ),
    (
        "read alone, 128 rows",
        "the built loop's reads, shuffles and stores, no tile product",
        4,
        64,
        8192,
        1,
        0,
        2,
    ),
    (
        "products alone, 128 rows",
        "the built loop's tile products, nothing read from memory",
        4,
        64,
        8192,
        1,
        0,
        3,
    ),
    (
        "products alone, int8 tiles, 128 rows",
        "the same products on AMX-INT8 tiles (TDPBSSD), multiply-adds counted",
        4,
        64,
        8192,
        1,
        0,
        4,
    ),
    (
        "built, int8 tiles, 128 rows",
        T2048
        + "; the built loop on AMX-INT8 tiles, int8 weights (half the bytes per multiply-add)",
        4,
        64,
        8192,
        1,
        0,
        5,
    ),
    (
        "built, int8 tiles, 32 rows",
        T512 + "; the built loop on AMX-INT8 tiles, int8 weights",
        1,
        64,
        8192,
        1,
        0,
        5,
    ),
    (
        "products alone, 128 rows, prefetching",
        "the same while prefetching every next pass to L2 (the read, but no build)",
        4,
        64,
        8192,
        1,
        1,
        3,
    ),
)
OURS_ROWS = (128, 32)


def build(tmp: Path) -> tuple[Path | None, str]:
    """The compiled loop, or ``None`` and why not."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None, "no g++ on PATH"
    exe = tmp / "amx_tile_loop"
    cmd = [gxx, "-O2", "-std=c++17", str(SOURCE), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"g++ could not build {SOURCE.name}: {done.stderr.strip()[-500:]}"
    return exe, ""


def loop_rate(
    exe: Path,
    row_tiles: int,
    steps: int,
    passes: int,
    reps: int,
    trials: int,
    prefetch: int,
    mode: int,
) -> float:
    """GFLOP per thread CPU second of the loop (best of ``trials``)."""
    args = [str(exe), *map(str, (row_tiles, steps, passes, reps, trials, prefetch, mode))]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def ours_rate(rows: int, bank: tuple[str, list[torch.Tensor]], experts: int) -> float:
    """GFLOP per thread CPU second of bf16-packed ``x W^T`` over ``experts`` distinct experts."""
    fname, args = bank
    x = torch.randn(rows, K).to(torch.bfloat16)
    ops = torch.ops.kt_kernel
    ops.project(fname, args, N, K, 0, x, False)
    t0 = time.thread_time()
    for e in range(experts):
        ops.project(fname, args, N, K, e, x, False)
    return 2.0 * rows * N * K * experts / (time.thread_time() - t0) / 1e9


def read_gbps(mib: int, threads: int, reps: int = 3) -> tuple[float, float]:
    """GB/s read from memory by one thread and by ``threads`` (``torch.sum`` of fp32, best).

    One thread is timed in thread CPU time, several in wall time; one tensor serves both.
    """
    t = torch.ones(mib * 2**18)
    before = torch.get_num_threads()
    rates = []
    try:
        for n, clock in ((1, time.thread_time), (threads, time.perf_counter)):
            torch.set_num_threads(n)
            t.sum()
            best = float("inf")
            for _ in range(reps):
                c0 = clock()
                t.sum()
                best = min(best, clock() - c0)
            rates.append(t.nbytes / best / 1e9)
    finally:
        torch.set_num_threads(before)
    return rates[0], rates[1]


def run(exe: Path, rounds: int, experts: int, quick: bool) -> dict:
    """Per round: the peak, every loop, ours; medians of rates and of per-round ratios."""
    bank = expert_bank("bf16-packed", N, K, experts)
    names = [name for name, *_ in LOOPS] + [f"ours, bf16-packed, {m} rows" for m in OURS_ROWS]
    rates: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    peaks, reads, reads_all = [], [], []
    cores = os.cpu_count() or 1
    for r in range(rounds):
        peak = tm.peak_1t()
        peaks.append(peak)
        one, every = read_gbps(64 if quick else 1024, cores)
        reads.append(one)
        reads_all.append(every)
        got = {}
        for name, _, row_tiles, steps, passes, reps, prefetch, mode in LOOPS:
            if mode >= 4 and not torch.ops.kt_kernel.amx_int8():
                continue
            if quick:
                passes, reps = min(passes, 256), max(1, reps // 10)
            got[name] = loop_rate(exe, row_tiles, steps, passes, reps, 3, prefetch, mode)
        for m in OURS_ROWS:
            got[f"ours, bf16-packed, {m} rows"] = ours_rate(m, bank, experts)
        for name, v in got.items():
            rates[name].append(v)
            ratios[name].append(v / peak)
        print(
            f"round {r + 1}: peak {peak:.0f}, read {reads[-1]:.1f} GB/s "
            f"({reads_all[-1]:.1f} on {cores} threads), "
            + ", ".join(f"{k} {v:.0f}" for k, v in got.items())
        )
    what = {name: desc for name, desc, *_ in LOOPS}
    what.update(
        {
            f"ours, bf16-packed, {m} rows": f"the kernel's gate_up x W^T, {experts} distinct experts"
            for m in OURS_ROWS
        }
    )
    names = [n for n in names if rates[n]]
    rows = [
        {
            "name": n,
            "what": what[n],
            "gflops": statistics.median(rates[n]),
            "of_peak": statistics.median(ratios[n]),
            "of_peak_range": [min(ratios[n]), max(ratios[n])],
        }
        for n in names
    ]
    return {
        "peaks": peaks,
        "read_gbps": reads,
        "read_gbps_all_threads": reads_all,
        "threads": cores,
        "rows": rows,
    }


def write_markdown(path: Path, meta: dict, result: dict) -> None:
    """The table of loop and kernel rates against the same-round peak."""
    peaks = result["peaks"]
    lines = [
        "# kt-kernel: the AMX-BF16 tile loop's ceiling against the matmul peak",
        "",
        f"Date {meta['date']}; command `{meta['command']}`. Machine: {meta['machine']['cpu']}, "
        f"{meta['machine']['cpus']} cores, AMX: yes; kt-kernel {meta['machine']['kt_kernel']}, "
        f"torch {meta['machine']['torch']}. Load average {meta['loadavg_start']} at start, "
        f"{meta['loadavg_end']} at end. One thread; rates in GFLOP per thread CPU second.",
        "",
        f"Single-thread bf16 `torch.mm` peak at 2048^3, per round: "
        f"{', '.join(f'{p:.0f}' for p in peaks)} (median {statistics.median(peaks):.0f}).",
        "",
        "| what runs | stands for | GFLOP/CPU-s (median) | of the same-round peak (median, range) |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        lo, hi = row["of_peak_range"]
        lines.append(
            f"| {row['name']} | {row['what']} | {row['gflops']:.0f} | "
            f"{row['of_peak']:.0%} ({lo:.0%}-{hi:.0%}) |"
        )
    peak, read = statistics.median(peaks), statistics.median(result["read_gbps"])
    read_all = statistics.median(result["read_gbps_all_threads"])
    by_name = {r["name"]: r for r in result["rows"]}
    lines += [
        "",
        f"One thread reads {read:.1f} GB/s from memory, {result['threads']} threads together "
        f"{read_all:.1f} GB/s (`torch.sum` of 1 GiB of fp32, medians). "
        "An expert's weights are read once per product, so at m rows per expert the product "
        "does m FLOP per weight byte (bf16): at 90% of the median peak it must stream "
        + ", ".join(f"{0.9 * peak / m:.1f} GB/s at {m} rows" for m in (128, 32))
        + " per thread, besides the activations the op moves.",
        "",
        "- The tile loop itself is not the limit: with its operands in L2 it runs at "
        f"{by_name['loop, L2']['of_peak']:.0%} of the peak.",
        "- The limit is bringing the weights from memory: the same loop reading its B tiles from "
        f"memory runs at {by_name['loop, memory, 128 rows']['of_peak']:.0%} (128 rows) and "
        f"{by_name['loop, memory, 32 rows']['of_peak']:.0%} (32 rows), "
        f"{by_name['loop, memory, 128 rows, prefetched']['of_peak']:.0%} and "
        f"{by_name['loop, memory, 32 rows, prefetched']['of_peak']:.0%} with the next pass "
        "prefetched; the kernel, which builds each pass's B tiles from prefetched lines, "
        f"{by_name['ours, bf16-packed, 128 rows']['of_peak']:.0%} and "
        f"{by_name['ours, bf16-packed, 32 rows']['of_peak']:.0%}.",
    ]
    read_r, prod_r = by_name["read alone, 128 rows"], by_name["products alone, 128 rows"]
    t_read, t_prod = 1 / read_r["gflops"], 1 / prod_r["gflops"]
    serial, overlapped = 1 / (t_read + t_prod), 1 / max(t_read, t_prod)
    built = by_name["built, 128 rows"]["gflops"]
    built_pf = by_name["built, 128 rows, prefetched"]["gflops"]
    lines += [
        "- Whether the read hides behind the arithmetic (128 rows, the kernel's build): the read "
        f"alone runs at the equivalent of {read_r['gflops']:.0f} GFLOP/s, the tile products alone "
        f"at {prod_r['gflops']:.0f}. Done one after the other they would give {serial:.0f}, fully "
        f"overlapped {overlapped:.0f}; the loop that does both runs at {built:.0f} "
        f"({built_pf:.0f} with the next pass prefetched), so "
        f"{max(0.0, (1 / serial - 1 / max(built, built_pf)) / min(t_read, t_prod)):.0%} of the "
        "shorter of the two hides behind the other. Prefetching alone, without the build, "
        f"slows the products from {prod_r['gflops']:.0f} to "
        f"{by_name['products alone, 128 rows, prefetching']['gflops']:.0f}.",
    ]
    int8 = by_name.get("products alone, int8 tiles, 128 rows")
    if int8 is not None:
        lines.append(
            f"- AMX-INT8 tiles multiply-add at {int8['gflops'] / prod_r['gflops']:.2f}x the bf16 "
            "tiles' rate on the same loop: an int8 x int8 product (activations quantised) would "
            "halve the arithmetic that the weights' read does not hide."
        )
    for m in (128, 32):
        i8, bf = by_name.get(f"built, int8 tiles, {m} rows"), by_name.get(f"built, {m} rows")
        if i8 is not None and bf is not None:
            lines.append(
                f"- Built from int8 weights onto AMX-INT8 tiles at {m} rows: {i8['gflops']:.0f} "
                f"({i8['gflops'] / bf['gflops']:.2f}x the bf16 loop's {bf['gflops']:.0f})."
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse, skip without AMX or g++, run the rounds, write JSON and markdown."""
    ap = tm.parser(__doc__)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kk.set_num_threads(1)
    reason = ""
    if "amx-bf16" not in kk.backend_info().cpu_features or not torch.ops.kt_kernel.amx():
        reason = "this CPU, OS or process offers no AMX-BF16 tiles (or KT_KERNEL_AMX=0)"
    with tempfile.TemporaryDirectory() as tmp:
        exe = None
        if not reason:
            exe, reason = build(Path(tmp))
        if exe is None:
            print(f"bench_amx_ceiling: skipped ({reason})")
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_amx_ceiling.json").write_text(json.dumps({"skipped": reason}))
            return
        rounds = args.reps or (1 if args.quick else 5)
        experts = 8 if args.quick else 128
        loadavg_start = tm.loadavg()
        result = run(exe, rounds, experts, args.quick)
    meta = {
        "command": "python benchmarks/bench_amx_ceiling.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rounds": rounds,
        "experts": experts,
        "machine": tm.machine(),
        "loadavg_start": loadavg_start,
        "loadavg_end": tm.loadavg(),
    }
    payload = {"meta": meta, "results": result}
    tm.write_results(
        args.out, "bench_amx_ceiling", payload, lambda p: write_markdown(p, meta, result)
    )


if __name__ == "__main__":
    main()
