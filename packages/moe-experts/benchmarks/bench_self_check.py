"""Cost of wrap's self-check on one Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, k=8).

Times, in one process on the same weights: building the kernel weights (what wrap does
anyway) and the self-check (original experts module + kernel on 8 random tokens). Prints a
table and writes JSON. ``--quick`` uses a quarter-size layer for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kt_kernel
from moe_experts.kernel_experts import KernelExperts
from moe_experts.self_check import expert_activation, self_check


def _layer(h: int, i: int, e: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(
        hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=8
    )
    experts = Qwen3MoeExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.data = (torch.randn(e, 2 * i, h, generator=gen) * 0.02).to(dtype)
        experts.down_proj.data = (torch.randn(e, h, i, generator=gen) * 0.02).to(dtype)
    return experts


def main() -> None:
    """Run the measurement and print/write the result."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weight-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--json", type=Path, default=Path("bench_self_check.json"))
    args = ap.parse_args()
    h, i, e = (512, 192, 32) if args.quick else (2048, 768, 128)
    dtype = torch.bfloat16 if args.weight_dtype == "bf16" else torch.float32
    experts = _layer(h, i, e, dtype)
    spec = kt_kernel.ExpertSpec(e, h, i, activation=expert_activation(experts, "layer"))
    build, check, errs = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        weights = kt_kernel.ExpertWeights.from_fused(
            spec, experts.gate_up_proj.data, experts.down_proj.data, dtype=dtype
        )
        kernel = KernelExperts(
            weights,
            gate_up_like=experts.gate_up_proj,
            down_like=experts.down_proj,
            gate_up_name="gate_up_proj",
            down_name="down_proj",
            label="layer",
        )
        t1 = time.perf_counter()
        result = self_check("layer", experts, kernel, args.weight_dtype)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        check.append(t2 - t1)
        errs.append(result.relative_error)
        del weights, kernel
    out = {
        "shape": {"hidden": h, "intermediate": i, "experts": e, "top_k": min(e, 2), "tokens": 8},
        "weight_dtype": args.weight_dtype,
        "threads": torch.get_num_threads(),
        "build_kernel_weights_s": {"median": statistics.median(build), "min": min(build)},
        "self_check_s": {"median": statistics.median(check), "min": min(check)},
        "self_check_over_build": statistics.median(check) / statistics.median(build),
        "relative_error": max(errs),
    }
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"| step | median s | min s |\n|---|---|---|\n"
        f"| build kernel weights (wrap anyway) | {out['build_kernel_weights_s']['median']:.3f} "
        f"| {out['build_kernel_weights_s']['min']:.3f} |\n"
        f"| self-check | {out['self_check_s']['median']:.3f} | {out['self_check_s']['min']:.3f} |"
    )
    print(
        f"self-check / build = {out['self_check_over_build']:.2f}, relative error "
        f"{out['relative_error']:.2e}, {out['threads']} threads"
    )


if __name__ == "__main__":
    main()
