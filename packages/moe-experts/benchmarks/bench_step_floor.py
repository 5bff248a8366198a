"""The matmul floor of ``bench_step.py``'s training step on this machine, and what it caps.

A LoRA step on a frozen base cannot skip these products (forward, and the input gradient in
backward; the base needs no weight gradient):

- q/k/v/o, the routers and the LM head, each timed alone here as the ``F.linear`` /
  ``torch.mm`` of its own shape with this process's threads (best of ``--reps``);
- the routed experts' base products, ``T*k`` rows through ``[2I, H]`` and ``[H, I]``;
- causal attention's block products: ``QK^T`` and ``PV`` forward, ``dV``, ``dP``, ``dQ``
  and ``dK`` backward, each over the causal half.

Experts and attention are many small products, so they are charged at the best rate any
large product reached here (a square bf16 matmul or one of the dense shapes), which they
cannot beat. LoRA, softmax, norms, routing and the optimizer are left out. The sum is
therefore a lower bound on any implementation's step, ours and PEFT's alike, and
``PEFT step / floor`` is the most any implementation can be faster than PEFT here.

With ``--step-json`` (a ``bench_step.py`` result at the same shape; repeatable) a second
table sets each measured variant's step against the floor.

Usage: ``python bench_step_floor.py --out DIR [--quick] [--tokens 2048] [--step-json FILE]``.
Writes ``bench_step_floor.json`` and ``bench_step_floor.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules
from _common import write_results
from bench_step import FULL, QUICK


def _best_seconds(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
    """Best wall time of ``torch.nn.functional.linear(a, b)`` after one warm-up."""
    torch.nn.functional.linear(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def dense_products(m: dict[str, Any], tokens: int) -> list[tuple[str, int, int, int]]:
    """``(part, rows, in, out)`` of every dense product in one layer's and the head's step."""
    h, q = m["hidden_size"], m["num_attention_heads"] * m["head_dim"]
    kv = m["num_key_value_heads"] * m["head_dim"]
    shapes = [
        ("q", h, q),
        ("k", h, kv),
        ("v", h, kv),
        ("o", q, h),
        ("router", h, m["num_experts"]),
    ]
    out = []
    for part, fan_in, fan_out in shapes:
        out.append((f"{part} forward", tokens, fan_in, fan_out))
        out.append((f"{part} input gradient", tokens, fan_out, fan_in))
    return out


def run(tokens: int, layers: int, reps: int, quick: bool = False) -> dict[str, Any]:
    """Time the dense shapes, charge experts and attention at the best rate, sum the floor."""
    m = {**(QUICK if quick else FULL), "num_hidden_layers": layers}
    h, v = m["hidden_size"], m["vocab_size"]
    rows: list[dict[str, Any]] = []
    best_rate = 0.0
    # Square products: the rate that the experts' many small products cannot beat.
    for size in (512,) if quick else (2048, 4096):
        a = torch.randn(size, size).to(torch.bfloat16)
        s = _best_seconds(a, a, reps)
        best_rate = max(best_rate, 2.0 * size**3 / s / 1e9)
    layer_s = 0.0
    head_s = 0.0
    head = (("lm_head forward", tokens, h, v), ("lm_head input gradient", tokens, v, h))
    for per, products in (("layer", dense_products(m, tokens)), ("step", head)):
        for part, n, fan_in, fan_out in products:
            a = torch.randn(n, fan_in).to(torch.bfloat16)
            w = torch.randn(fan_out, fan_in).to(torch.bfloat16)
            s = _best_seconds(a, w, reps)
            gflop = 2.0 * n * fan_in * fan_out / 1e9
            best_rate = max(best_rate, gflop / s)
            rows.append({"part": part, "per": per, "gflop": gflop, "seconds": s})
            if per == "layer":
                layer_s += s
            else:
                head_s += s
    routed = tokens * m["num_experts_per_tok"]
    i = m["moe_intermediate_size"]
    # forward gate_up + down, backward the same two products for the input gradient
    expert_gflop = 2 * (2.0 * routed * h * 2 * i + 2.0 * routed * i * h) / 1e9
    d, heads = m["head_dim"], m["num_attention_heads"]
    # six [T, d] x [d, T]-sized products per head over the causal half (T^2 / 2 pairs)
    attention_gflop = 6 * 2.0 * (tokens * tokens / 2) * d * heads / 1e9
    for part, gflop in (("experts (base)", expert_gflop), ("attention", attention_gflop)):
        s = gflop / best_rate
        rows.append({"part": part, "per": "layer", "gflop": gflop, "seconds": s})
        layer_s += s
    floor_s = layers * layer_s + head_s
    return {
        "tokens": tokens,
        "layers": layers,
        "model": m,
        "best_rate_gflops": best_rate,
        "rows": rows,
        "floor_s": floor_s,
        "floor_gflop": layers * sum(r["gflop"] for r in rows if r["per"] == "layer")
        + sum(r["gflop"] for r in rows if r["per"] == "step"),
    }


def against_steps(result: dict[str, Any], step_json: Path) -> dict[str, Any]:
    """Each measured variant's median step against the floor, and PEFT's ceiling ratio."""
    payload = json.loads(step_json.read_text())
    at = payload["lengths"][str(result["tokens"])]
    floor = result["floor_s"]
    out: dict[str, Any] = {
        "step_json": step_json.name,
        "weight_dtype": payload.get("weight_dtype", "bf16"),
        "variants": {
            name: {"step_s": s, "x_floor": s / floor} for name, s in at["step_s_median"].items()
        },
    }
    if "peft" in at["step_s_median"]:
        peft = at["step_s_median"]["peft"]
        out["peft_over_floor"] = peft / floor  # the most any step can beat PEFT by here
        out["step_for_3x_peft_s"] = peft / 3
    return out


def main() -> None:
    """Parse arguments, measure, write JSON and markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for JSON + markdown")
    parser.add_argument("--quick", action="store_true", help="bench_step's quick shape, T=128")
    parser.add_argument("--tokens", type=int, help="tokens per step (default 2048; quick: 128)")
    parser.add_argument("--layers", type=int, default=FULL["num_hidden_layers"])
    parser.add_argument("--reps", type=int, default=3, help="timed products per shape")
    parser.add_argument(
        "--step-json",
        type=Path,
        action="append",
        default=[],
        help="a bench_step.py result to compare (repeatable)",
    )
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    tokens = args.tokens or (128 if args.quick else 2048)
    result = run(tokens, args.layers, args.reps, args.quick)
    result["measured"] = [against_steps(result, p) for p in args.step_json]
    meta = {
        "benchmark": "moe-experts/bench_step_floor",
        "threads": torch.get_num_threads(),
        "loadavg": f"{load0:.1f} -> {os.getloadavg()[0]:.1f}",
        "env": {
            k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "KT_KERNEL_AMX") if k in os.environ
        },
        **{k: v for k, v in result.items() if k != "rows"},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    title = (
        f"# Matmul floor of the T={tokens} step ({args.layers} layers, "
        f"{meta['threads']} threads, best rate {result['best_rate_gflops']:.0f} GFLOP/s): "
        f"{result['floor_gflop']:.0f} GFLOP, {result['floor_s']:.2f} s"
    )
    write_results(
        args.out,
        "bench_step_floor",
        meta,
        result["rows"],
        title,
        ["part", "per", "GFLOP", "seconds", "GFLOP/s"],
        lambda r: [
            r["part"],
            r["per"],
            f"{r['gflop']:.1f}",
            f"{r['seconds']:.3f}",
            f"{r['gflop'] / r['seconds']:.0f}",
        ],
    )
    if result["measured"]:
        lines = [
            "",
            "| bench_step result | ours' experts | variant | median step (s) | x floor |",
            "|---|---|---|---|---|",
        ]
        notes = []
        for m in result["measured"]:
            for name, r in m["variants"].items():
                lines.append(
                    f"| {m['step_json']} | {m['weight_dtype']} | {name} | {r['step_s']:.2f} | "
                    f"{r['x_floor']:.2f} |"
                )
            if "peft_over_floor" in m:
                notes.append(
                    f"- {m['step_json']}: PEFT's step is {m['peft_over_floor']:.2f}x the floor, "
                    f"the most any step can beat it by here; 3x PEFT needs a "
                    f"{m['step_for_3x_peft_s']:.2f} s step."
                )
        text = "\n".join([*lines, "", *notes]) + "\n"
        with open(args.out / "bench_step_floor.md", "a") as f:
            f.write(text)
        print(text)


if __name__ == "__main__":
    main()
