"""The shared parts of a T=2048 training step, alone: where the floor of ``bench_step`` is.

Ours and transformers + PEFT run the same attention, LM head and loss ops; only the experts
differ. This times, interleaved and in one process (wall and process CPU time, median of
per-repetition ratios), at Qwen3-30B-A3B attention shapes (32 query / 4 KV heads of 128):

- ``matmul``: a square bf16 matmul, the machine's GEMM rate (GFLOP/s) to compare against;
- ``sdpa_gqa`` vs ``sdpa_repeat``: causal SDPA forward + backward with ``enable_gqa`` (what
  transformers 5 passes without a mask) and with the KV heads repeated (``repeat_kv``);
- ``blocked``: a causal attention written with torch matmuls, query blocks over all earlier
  keys, fp32 softmax and a recomputing backward, the first "custom attention" candidate;
- ``kernel``: :func:`kt_kernel.causal_attention`, the C++ flash-style op (fused softmax row
  passes, AVX512_BF16 GEMMs with fp32 accumulation, query heads of a KV head stacked), with
  its forward and backward also timed alone against SDPA's (``*_fwd`` / ``*_bwd``);
- ``head_full`` vs ``head_chunked``: LM head + cross-entropy forward and backward from the
  full fp32 logits (transformers' path) and with :func:`moe_experts.chunked_lm_cross_entropy`.

Usage: ``python bench_step_parts.py --out DIR [--quick] [--length T] [--reps N] [--stem S]``;
writes ``S.json`` and ``S.md`` (default stem ``bench_step_parts``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


class _BlockedCausal(torch.autograd.Function):
    """Causal GQA attention by query blocks; saves the log-sum-exp, recomputes P in backward."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, blk: int
    ) -> torch.Tensor:
        b, hq, t, d = q.shape
        hk = k.shape[1]
        g = hq // hk
        qg, kk, vv = q.reshape(b * hk, g, t, d), k.reshape(b * hk, t, d), v.reshape(b * hk, t, d)
        out = torch.empty(b * hk, g, t, d, dtype=q.dtype)
        lse = torch.empty(b * hk, g, t, dtype=torch.float32)
        for t0 in range(0, t, blk):
            t1 = min(t, t0 + blk)
            n = t1 - t0
            s = _scores(qg, kk, t0, t1, scale)
            m = torch.logsumexp(s, -1)
            p = torch.exp(s - m[..., None]).to(q.dtype)
            lse[:, :, t0:t1] = m
            out[:, :, t0:t1] = torch.bmm(p.view(b * hk, g * n, t1), vv[:, :t1]).view(
                b * hk, g, n, d
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.blk = scale, blk
        return out.view(b, hq, t, d)

    @staticmethod
    def backward(ctx: Any, go: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        b, hq, t, d = q.shape
        hk = k.shape[1]
        g = hq // hk
        qg, kk, vv = q.reshape(b * hk, g, t, d), k.reshape(b * hk, t, d), v.reshape(b * hk, t, d)
        gog = go.reshape(b * hk, g, t, d)
        delta = (gog.float() * out.float()).sum(-1)
        dq = torch.empty_like(qg)
        dk = torch.zeros(b * hk, t, d, dtype=torch.float32)
        dv = torch.zeros(b * hk, t, d, dtype=torch.float32)
        for t0 in range(0, t, ctx.blk):
            t1 = min(t, t0 + ctx.blk)
            n = t1 - t0
            qb = qg[:, :, t0:t1].reshape(b * hk, g * n, d)
            gob = gog[:, :, t0:t1].reshape(b * hk, g * n, d)
            p = torch.exp(_scores(qg, kk, t0, t1, ctx.scale) - lse[:, :, t0:t1, None])
            dv[:, :t1] += torch.bmm(p.to(q.dtype).view(b * hk, g * n, t1).transpose(1, 2), gob)
            dp = torch.bmm(gob, vv[:, :t1].transpose(1, 2)).float().view(b * hk, g, n, t1)
            ds = (p * (dp - delta[:, :, t0:t1, None])).to(q.dtype).view(b * hk, g * n, t1)
            dq[:, :, t0:t1] = (torch.bmm(ds, kk[:, :t1]) * ctx.scale).view(b * hk, g, n, d)
            dk[:, :t1] += torch.bmm(ds.transpose(1, 2), qb) * ctx.scale
        return dq.view_as(q), dk.to(k.dtype).view_as(k), dv.to(v.dtype).view_as(v), None, None


def _scores(qg: torch.Tensor, kk: torch.Tensor, t0: int, t1: int, scale: float) -> torch.Tensor:
    """fp32 masked scores ``[BH, G, n, t1]`` of query rows ``t0:t1`` against keys ``:t1``."""
    bh, g, _, d = qg.shape
    n = t1 - t0
    qb = qg[:, :, t0:t1].reshape(bh, g * n, d)
    s = torch.bmm(qb, kk[:, :t1].transpose(1, 2)).float().mul_(scale).view(bh, g, n, t1)
    s[..., t0:t1].masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return s


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def run(
    t: int, heads: int, kv_heads: int, dim: int, hidden: int, vocab: int, reps: int
) -> dict[str, Any]:
    """Time every part ``reps`` times, interleaved; return times, ratios and errors."""
    from kt_kernel import causal_attention
    from moe_experts import chunked_lm_cross_entropy

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, t, dim, generator=g).bfloat16().requires_grad_()
    k = torch.randn(1, kv_heads, t, dim, generator=g).bfloat16().requires_grad_()
    v = torch.randn(1, kv_heads, t, dim, generator=g).bfloat16().requires_grad_()
    go = torch.randn(1, heads, t, dim, generator=g).bfloat16()
    rep = heads // kv_heads
    h = torch.randn(t - 1, hidden, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()
    y = torch.randint(0, vocab, (t - 1,), generator=g)
    a = torch.randn(2048, 2048, generator=g).bfloat16()

    def attn(kind: str) -> torch.Tensor:
        if kind == "sdpa_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if kind == "sdpa_repeat":
            kr, vr = (
                x[:, :, None].expand(1, kv_heads, rep, t, dim).reshape(1, heads, t, dim)
                for x in (k, v)
            )
            return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        if kind == "kernel":
            return causal_attention(q, k, v, backend="native")
        return _BlockedCausal.apply(q, k, v, dim**-0.5, 256)

    def attn_step(kind: str) -> None:
        q.grad = k.grad = v.grad = None
        attn(kind).backward(go)

    def head(kind: str) -> None:
        h.grad = None
        if kind == "head_full":
            F.cross_entropy((h @ w.t()).float(), y).backward()
        else:
            chunked_lm_cross_entropy(h, w, y).backward()

    saved: dict[str, torch.Tensor] = {}

    def forward_only(kind: str) -> None:
        with torch.no_grad():
            attn(kind)

    def backward_only(kind: str) -> None:
        q.grad = k.grad = v.grad = None
        saved[kind].backward(go, retain_graph=True)

    parts: dict[str, Callable[[], None]] = {"matmul": lambda: a @ a}
    for kind in ("sdpa_gqa", "sdpa_repeat", "blocked", "kernel"):
        parts[kind] = lambda kind=kind: attn_step(kind)
    for kind in ("sdpa_gqa", "kernel"):
        saved[kind] = attn(kind)
        parts[f"{kind}_fwd"] = lambda kind=kind: forward_only(kind)
        parts[f"{kind}_bwd"] = lambda kind=kind: backward_only(kind)
    for kind in ("head_full", "head_chunked"):
        parts[kind] = lambda kind=kind: head(kind)
    errors = {}  # relative error of output and gradients against fp64 attention
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        ref_in[0], *(x.repeat_interleave(rep, 1) for x in ref_in[1:]), is_causal=True
    )
    ref.backward(go.double())
    want = [ref.detach()] + [x.grad for x in ref_in]
    for kind in ("sdpa_gqa", "blocked", "kernel"):
        q.grad = k.grad = v.grad = None
        out = attn(kind)
        out.backward(go)
        got = [out.detach(), q.grad, k.grad, v.grad]
        errors[kind] = [
            float((x.double() - r).norm() / r.norm()) for x, r in zip(got, want, strict=True)
        ]
    for fn in parts.values():  # warm-up
        fn()
    wall: dict[str, list[float]] = {n: [] for n in parts}
    cpu: dict[str, list[float]] = {n: [] for n in parts}
    for _ in range(reps):
        for name, fn in parts.items():
            dt, dc = _timed(fn)
            wall[name].append(dt)
            cpu[name].append(dc)

    def ratio(num: str, den: str, src: dict[str, list[float]]) -> float:
        return statistics.median(x / z for x, z in zip(src[num], src[den], strict=True))

    flops_attn = 2 * 2 * t * t * dim * heads / 2 * (1 + 2.5)  # causal fwd + ~2.5x bwd
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "matmul_gflops": 2 * 2048**3 / statistics.median(wall["matmul"]) / 1e9,
        "sdpa_gqa_gflops": flops_attn / statistics.median(wall["sdpa_gqa"]) / 1e9,
        "kernel_gflops": flops_attn / statistics.median(wall["kernel"]) / 1e9,
        # CPU-time rates: on a shared machine the work, not the waiting for a core.
        "gflops_per_cpu_s": {
            n: f / statistics.median(cpu[n]) / 1e9
            for n, f in (("matmul", 2 * 2048**3), ("sdpa_gqa", flops_attn), ("kernel", flops_attn))
        },
        "sdpa_vs_kernel": {
            "wall": ratio("sdpa_gqa", "kernel", wall),
            "cpu": ratio("sdpa_gqa", "kernel", cpu),
        },
        "sdpa_vs_kernel_fwd": {
            "wall": ratio("sdpa_gqa_fwd", "kernel_fwd", wall),
            "cpu": ratio("sdpa_gqa_fwd", "kernel_fwd", cpu),
        },
        "sdpa_vs_kernel_bwd": {
            "wall": ratio("sdpa_gqa_bwd", "kernel_bwd", wall),
            "cpu": ratio("sdpa_gqa_bwd", "kernel_bwd", cpu),
        },
        "repeat_vs_gqa": {
            "wall": ratio("sdpa_repeat", "sdpa_gqa", wall),
            "cpu": ratio("sdpa_repeat", "sdpa_gqa", cpu),
        },
        "blocked_vs_gqa": {
            "wall": ratio("blocked", "sdpa_gqa", wall),
            "cpu": ratio("blocked", "sdpa_gqa", cpu),
        },
        "full_vs_chunked_head": {
            "wall": ratio("head_full", "head_chunked", wall),
            "cpu": ratio("head_full", "head_chunked", cpu),
        },
        "attention_rel_error_vs_fp64": errors,
    }


def main() -> None:
    """Parse arguments, run the parts, write JSON and markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for JSON + markdown")
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    parser.add_argument("--length", type=int, default=2048, help="sequence length T")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--stem", default="bench_step_parts", help="output file name stem")
    args = parser.parse_args()
    shape = (256, 8, 2, 64, 256, 4096) if args.quick else (args.length, 32, 4, 128, 2048, 32000)
    load0 = os.getloadavg()[0]
    res = run(*shape, reps=args.reps)
    res.update(
        benchmark="moe-experts/bench_step_parts",
        threads=torch.get_num_threads(),
        shape=dict(
            zip(("T", "heads", "kv_heads", "head_dim", "hidden", "vocab"), shape, strict=True)
        ),
        loadavg=f"{load0:.1f} -> {os.getloadavg()[0]:.1f}",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(res, indent=2))
    lines = [
        f"# Shared step parts, T={shape[0]} ({res['threads']} threads, load "
        f"{res['loadavg']}, median of {args.reps} interleaved repetitions)",
        "",
        "| part | wall (s) | CPU (s) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {n} | {statistics.median(res['wall_s'][n]):.3f} | "
        f"{statistics.median(res['cpu_s'][n]):.3f} |"
        for n in res["wall_s"]
    ]
    rate = res["gflops_per_cpu_s"]
    lines += [
        "",
        f"bf16 matmul {res['matmul_gflops']:.0f} GFLOP/s; SDPA (GQA) forward + "
        f"backward {res['sdpa_gqa_gflops']:.0f} GFLOP/s; kernel "
        f"{res['kernel_gflops']:.0f} GFLOP/s (wall). Per CPU-second: matmul "
        f"{rate['matmul']:.0f}, SDPA {rate['sdpa_gqa']:.0f} "
        f"({rate['sdpa_gqa'] / rate['matmul']:.0%} of matmul), kernel "
        f"{rate['kernel']:.0f} ({rate['kernel'] / rate['matmul']:.0%}).",
        "",
    ]
    for key in (
        "repeat_vs_gqa",
        "blocked_vs_gqa",
        "sdpa_vs_kernel",
        "sdpa_vs_kernel_fwd",
        "sdpa_vs_kernel_bwd",
        "full_vs_chunked_head",
    ):
        lines.append(f"- {key}: wall {res[key]['wall']:.2f}x, CPU {res[key]['cpu']:.2f}x")
    for kind, errs in res["attention_rel_error_vs_fp64"].items():
        lines.append(
            f"- {kind} relative error vs fp64 (out, dq, dk, dv): "
            + ", ".join(f"{e:.1e}" for e in errs)
        )
    text = "\n".join(lines) + "\n"
    (args.out / f"{args.stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
