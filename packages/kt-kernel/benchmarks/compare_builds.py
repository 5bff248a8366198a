"""Two builds of the kernel against each other, in alternating child processes.

A change to the native code cannot be timed against its baseline in one process: each build
is its own ``_C`` library. This runs the same work under each build in turn (the order
swapped every round, so neither always follows the other) and reports medians and ratios.

Usage::

    # after building each version: copy its package (with the built _C*.so) aside
    cp -r src/kt_kernel /tmp/base/      # at the baseline commit
    cp -r src/kt_kernel /tmp/cand/      # at the candidate
    python benchmarks/compare_builds.py --baseline /tmp/base --candidate /tmp/cand \\
        --out DIR [--rounds 4] [--tokens 512 2048] [--experts 128] [--rows 16 48 112 144] \\
        [--format bf16-packed]

Writes ``DIR/compare_builds.{json,md}``:
- the whole op (forward + backward, experts in ``--format``, default bf16-packed, fused bf16
  LoRA r=16, policy save, 2 kernel threads): H=2048, I=768, E=``--experts``, k=8
  (Qwen3-30B-A3B's layer), wall and process CPU time per token count;
- one thread's expert products (``x W^T`` and ``dy W`` of gate_up and down) at ``--rows``
  rows, over 32 distinct experts (weights from DRAM), GFLOP/s.
Set ``KT_KERNEL_AMX=0`` and ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` in the environment to
compare the AVX-512 paths on an AMX CPU; the children inherit it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PRODUCT_EXPERTS = 32


def child_op(fmt: str, tokens: list[int], experts: int) -> dict[str, list[float]]:
    """Median (wall s, process CPU s) of 3 forward + backward steps per token count."""
    import _timing as tm
    import torch
    from bench_formats import DISTINCT, build_bases

    import kt_kernel as kk

    h, i, k, r = 2048, 768, 8, 16
    spec = kk.ExpertSpec(experts, h, i)
    gate_up, down = tm.make_weights(h, i, experts, distinct=DISTINCT)
    # build_bases sizes every format against bf16's (adopted, not copied)
    bases, _ = build_bases(spec, gate_up, down, DISTINCT, tuple(dict.fromkeys(("bf16", fmt))))
    lora = tm.make_lora(spec, r)
    out = {}
    for t in tokens:
        x, ids, w, dy = tm.make_inputs(t, h, experts, k, torch.Generator().manual_seed(2))
        tm.step(x, ids, w, dy, bases[fmt], lora)  # warm-up
        s = [tm.step(x, ids, w, dy, bases[fmt], lora) for _ in range(3)]
        out[str(t)] = [statistics.median(a[0] for a in s), statistics.median(a[1] for a in s)]
    return out


def child_products(fmt: str, rows: list[int]) -> dict[str, float]:
    """GFLOP/s (best of 3 passes over the experts) of each product at each row count."""
    import torch
    from bench_products import PROJECTIONS, expert_bank

    import kt_kernel as kk

    torch.set_num_threads(1)
    kk.set_num_threads(1)
    ops = torch.ops.kt_kernel
    out = {}
    for proj, (n, k) in PROJECTIONS.items():
        gen = torch.Generator().manual_seed(n * k)
        name, args = expert_bank(fmt, n, k, PRODUCT_EXPERTS)
        for nn in (False, True):
            for m in rows:
                x = torch.randn(m, n if nn else k, generator=gen).to(torch.bfloat16)
                times = []
                for rep in range(4):  # the first pass warms up
                    t0 = time.perf_counter()
                    for e in range(PRODUCT_EXPERTS):
                        ops.project(name, args, n, k, e, x, nn)
                    if rep:
                        times.append(time.perf_counter() - t0)
                flop = 2.0 * m * n * k * PRODUCT_EXPERTS
                out[f"{proj} {'dy W' if nn else 'x W^T'} {m}"] = flop / min(times) / 1e9
    return out


# Not _timing.loadavg: _timing imports torch and kt_kernel, which the parent neither needs nor
# may have (only the builds under test hold a kernel).
def _loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(v, 2) for v in os.getloadavg()]


def _run_child(package_dir: Path, argv: list[str]) -> dict:
    """Run this script's child mode with ``package_dir`` first on the path; its JSON."""
    env = dict(os.environ, PYTHONPATH=str(package_dir))
    proc = subprocess.run(
        [sys.executable, __file__, *argv], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"child under {package_dir} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_package(path: Path) -> Path:
    """``path`` if it holds a kt_kernel package with a built library, else exit with why."""
    if not (path / "kt_kernel" / "__init__.py").is_file() or not list(
        (path / "kt_kernel").glob("_C*.so")
    ):
        raise SystemExit(
            f"{path} holds no built kt_kernel package: build the version, then "
            f"`cp -r src/kt_kernel {path}/`"
        )
    return path


def write_markdown(path: Path, meta: dict, op: dict, products: dict) -> None:
    """The two tables: the whole op's times and the products' rates, with ratios."""
    lines = [
        "# kt-kernel: two builds in alternating child processes",
        "",
        f"Command: `{meta['command']}`. Baseline `{meta['baseline']}`, candidate "
        f"`{meta['candidate']}`; {meta['rounds']} rounds, order swapped each round, medians. "
        f"Machine: {meta['cpu']}, {meta['cpus']} CPUs; load average {meta['loadavg_start']} at "
        f"start, {meta['loadavg_end']} at end; KT_KERNEL_AMX={meta['kt_kernel_amx']}.",
        "",
    ]
    if op:
        lines += [
            f"Whole op, forward + backward: H=2048, I=768, E={meta['experts']}, k=8, "
            f"{meta['format']}, "
            "2 kernel threads.",
            "",
            "| T | baseline wall ms | candidate wall ms | speed-up (wall) | baseline CPU ms "
            "| candidate CPU ms | speed-up (CPU) |",
            "|---|---|---|---|---|---|---|",
        ]
        for t, v in op.items():
            lines.append(
                f"| {t} | {v['baseline'][0] * 1e3:.0f} | {v['candidate'][0] * 1e3:.0f} | "
                f"{v['baseline'][0] / v['candidate'][0]:.2f}x | {v['baseline'][1] * 1e3:.0f} | "
                f"{v['candidate'][1] * 1e3:.0f} | {v['baseline'][1] / v['candidate'][1]:.2f}x |"
            )
        lines.append("")
    if products:
        lines += [
            f"One thread's {meta['format']} products, {PRODUCT_EXPERTS} distinct experts per "
            "pass (GFLOP/s).",
            "",
            "| product | rows | baseline | candidate | speed-up |",
            "|---|---|---|---|---|",
        ]
        for key, v in products.items():
            proj, rest = key.split(" ", 1)
            prod, rows = rest.rsplit(" ", 1)
            lines.append(
                f"| {proj} {prod} | {rows} | {v['baseline']:.0f} | {v['candidate']:.0f} | "
                f"{v['candidate'] / v['baseline']:.2f}x |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Parse the options; run the children in alternating order; write JSON and markdown."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", type=Path, help="directory holding the baseline kt_kernel")
    ap.add_argument("--candidate", type=Path, help="directory holding the candidate kt_kernel")
    ap.add_argument("--out", type=Path, help="output directory")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of both builds")
    ap.add_argument("--tokens", type=int, nargs="*", default=[512, 2048], help="op token counts")
    ap.add_argument("--experts", type=int, default=128, help="experts E of the op (multiple of 8)")
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 48, 112, 128, 144])
    ap.add_argument("--format", default="bf16-packed", help="weight format of the experts")
    args = ap.parse_args()
    if args.child:
        kind, fmt, values = args.child[0], args.child[1], [int(v) for v in args.child[2:]]
        if kind == "op":
            res: dict = child_op(fmt, values[1:], values[0])
        else:
            res = child_products(fmt, values)
        print(json.dumps(res))
        return
    if args.baseline is None or args.candidate is None or args.out is None:
        ap.error("--baseline, --candidate and --out are required")
    builds = {
        "baseline": _check_package(args.baseline),
        "candidate": _check_package(args.candidate),
    }
    loadavg_start = _loadavg()
    samples: dict[str, list[tuple[dict, dict]]] = {b: [] for b in builds}
    for rnd in range(args.rounds):
        order = list(builds) if rnd % 2 == 0 else list(builds)[::-1]
        for b in order:
            op = (
                _run_child(
                    builds[b],
                    ["--child", "op", args.format, str(args.experts), *map(str, args.tokens)],
                )
                if args.tokens
                else {}
            )
            prods = (
                _run_child(builds[b], ["--child", "products", args.format, *map(str, args.rows)])
                if args.rows
                else {}
            )
            samples[b].append((op, prods))
            print(f"round {rnd + 1}: {b} done", flush=True)
    op_res = {
        t: {b: [statistics.median(s[0][t][i] for s in samples[b]) for i in (0, 1)] for b in builds}
        for t in samples["baseline"][0][0]
    }
    prod_res = {
        key: {b: statistics.median(s[1][key] for s in samples[b]) for b in builds}
        for key in samples["baseline"][0][1]
    }
    meta = {
        "command": "python benchmarks/compare_builds.py " + " ".join(sys.argv[1:]),
        "baseline": str(args.baseline),
        "candidate": str(args.candidate),
        "rounds": args.rounds,
        "experts": args.experts,
        "format": args.format,
        "cpus": os.cpu_count(),
        "cpu": os.uname().machine,
        "kt_kernel_amx": os.environ.get("KT_KERNEL_AMX", "unset"),
        "loadavg_start": loadavg_start,
        "loadavg_end": _loadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "op": op_res, "products": prod_res}
    (args.out / "compare_builds.json").write_text(json.dumps(payload, indent=2))
    write_markdown(args.out / "compare_builds.md", meta, op_res, prod_res)
    print((args.out / "compare_builds.md").read_text())


if __name__ == "__main__":
    main()
