"""Whole-model training step: moe-experts on kt-kernel vs transformers + PEFT, one run.

For a Qwen3-MoE decoder (full: 4 layers, H=1024, E=32, k=4; ``--quick``: 2 layers, H=256,
E=8) it measures the median training step (forward, backward, AdamW) and the peak RSS of
each variant with expert LoRA (rank 8) on gate_up/down:

* ``peft``: transformers 5.x fused experts + PEFT ``target_parameters`` (the baseline);
* ``kt-fp32`` / ``kt-bf16``: ``moe_experts.wrap`` (fp32 / bf16 kernel storage) + ``adapt``.

Each variant runs in its own child process (peak RSS is a per-process high-water mark, so
sharing a process would hide the later variant's peak); the parent writes ``bench_model.json``
and ``bench_model.md`` with ratios against ``peft``.

Usage: ``python bench_model.py --out DIR [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("peft", "kt-fp32", "kt-bf16")
FULL = {
    "num_hidden_layers": 4,
    "hidden_size": 1024,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 2048,
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
}
QUICK = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "initializer_range": 0.02,
}
RANK = 8


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def run_variant(variant: str, quick: bool) -> dict:
    """Build the model, adapt it the ``variant`` way, time training steps (in this process)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    from moe_experts.testing import tiny_config

    cfg = tiny_config("qwen3_moe", **(QUICK if quick else FULL))
    rss_start = _peak_rss_mib()
    model = AutoModelForCausalLM.from_config(cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    info: dict = {"variant": variant}
    if variant == "peft":
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=RANK,
                lora_alpha=2 * RANK,
                target_modules=[],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
        )
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        import kt_kernel
        import moe_experts
        from lora_core import LoraConfig

        report = moe_experts.wrap(model, weight_dtype="fp32" if variant == "kt-fp32" else "bf16")
        result = moe_experts.adapt(model, LoraConfig(enable=True, rank=RANK, alpha=2 * RANK))
        params = result.parameters()
        info["bytes_moved_out_of_module_tree"] = report.bytes_moved
        info["kernel_bytes"] = report.kernel_bytes
        info["kt_backend"] = kt_kernel.backend_info().active
    with torch.no_grad():
        for p in params:  # non-zero B so every LoRA matmul does real work
            p.normal_(0, 0.02)
    info["trainable_params"] = sum(p.numel() for p in params)
    info["module_tree_param_bytes"] = sum(
        p.nbytes for p in model.parameters() if type(p).__name__ != "ExpertPlaceholder"
    )
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch, seq = (2, 64) if quick else (2, 256)
    steps, warmup = (3, 1) if quick else (5, 1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
    info.update(
        {
            "step_s_median": statistics.median(times),
            "step_s_all": times,
            "tokens_per_step": batch * seq,
            "peak_rss_mib": _peak_rss_mib(),
            "rss_before_model_mib": rss_start,
            "first_loss": losses[0],
            "torch_threads": torch.get_num_threads(),
        }
    )
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for JSON + markdown")
    parser.add_argument("--quick", action="store_true", help="small model, few steps (<2 min)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.quick)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--out", str(args.out), "--variant", variant]
        if args.quick:
            cmd.append("--quick")
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=1800, check=False
        )
        if proc.returncode != 0:
            raise SystemExit(f"variant {variant} failed:\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["peft"]
    for r in results.values():
        r["step_time_ratio_vs_peft"] = r["step_s_median"] / base["step_s_median"]
        r["peak_rss_ratio_vs_peft"] = r["peak_rss_mib"] / base["peak_rss_mib"]
    payload = {
        "benchmark": "moe-experts/bench_model",
        "mode": "quick" if args.quick else "full",
        "model": {"family": "qwen3_moe", **(QUICK if args.quick else FULL)},
        "lora_rank": RANK,
        "results": results,
    }
    (args.out / "bench_model.json").write_text(json.dumps(payload, indent=2))
    lines = [
        f"# moe-experts whole-model training step ({payload['mode']})",
        "",
        f"Qwen3-MoE, {payload['model']['num_hidden_layers']} layers, "
        f"H={payload['model']['hidden_size']}, E={payload['model']['num_experts']}, "
        f"k={payload['model']['num_experts_per_tok']}, expert LoRA rank {RANK}.",
        "",
        "| variant | step (s) | x peft | peak RSS (MiB) | x peft | module-tree param MiB | kt backend |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['step_s_median']:.3f} | {r['step_time_ratio_vs_peft']:.2f} | "
            f"{r['peak_rss_mib']:.0f} | {r['peak_rss_ratio_vs_peft']:.2f} | "
            f"{r['module_tree_param_bytes'] / 2**20:.1f} | {r.get('kt_backend', '-')} |"
        )
    (args.out / "bench_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
