"""Checkpoint loading: ``load_pretrained`` (streaming) vs ``from_pretrained`` + ``wrap``.

A Qwen3-30B-A3B-shaped model (H=2048, I=768, E=128, k=8, vocab 32000; ``--layers`` decoder
layers, 4 by default; ``--quick``: 1 layer, E=16) with random bf16 weights is saved once as
sharded safetensors with per-expert keys (as hub checkpoints ship them). Each variant then
loads it in its own child process (peak RSS is a per-process high-water mark):

* ``from_pretrained+wrap``: ``AutoModelForCausalLM.from_pretrained(dtype=bf16)`` + ``wrap``;
* ``load_pretrained``: ``moe_experts.load_pretrained(weight_dtype="bf16")``;
* ``load_pretrained fp8``: the same weights saved as a DeepSeek-V3-style FP8-block checkpoint
  (``moe_experts.testing.save_fp8_checkpoint``: E4M3 + 128x128 ``weight_scale_inv``), loaded
  with the default ``weight_dtype`` (experts kept as shipped, dense layers dequantised to bf16).

Reported: load seconds, peak and final RSS above the process's post-import baseline, the peak
over the final footprint, and resident bytes per component against the arithmetic: kernel
experts and dense weights after loading; then LoRA (rank 16 on q/k/v/o, the routers and the
experts, in the model dtype) from ``adapt_model``, and after one AdamW step at T=64 its
gradients and optimizer state (two moments per parameter), each with the RSS it added
(``malloc_trim`` first, so freed activations do not count), and what a second step adds.
Writes ``bench_load.json`` and ``bench_load.md`` under ``--out``.

Usage: ``python bench_load.py --out DIR [--quick] [--layers N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _common module
from _common import DENSE, RANK, config, rollup_bytes, shape, write_results

VARIANTS = ("from_pretrained+wrap", "load_pretrained", "load_pretrained fp8")
# Kernel bytes per expert weight: bf16, or E4M3 plus one fp32 scale per 128x128 block.
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0 + 4.0 / 128**2}


def _rss_mib() -> float:
    return rollup_bytes("Rss") / 2**20


def _peak_mib() -> float:
    # VmHWM, not getrusage: ru_maxrss carries the parent's high-water mark across fork+exec
    # (the parent held the whole model while saving the checkpoint).
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _trimmed_rss_mib() -> float:
    from moe_experts.memory import trim_host_heap

    trim_host_heap()  # hand freed heap pages back before reading RSS
    return _rss_mib()


def lora_arithmetic(cfg: object, rank: int) -> int:
    """LoRA parameter count: ``rank * (in + out)`` per adapted matrix, experts once per expert."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size  # type: ignore[attr-defined]
    q = cfg.num_attention_heads * cfg.head_dim  # type: ignore[attr-defined]
    kv = cfg.num_key_value_heads * cfg.head_dim  # type: ignore[attr-defined]
    attention = (h + q) + 2 * (h + kv) + (q + h)
    router = h + e
    experts = e * ((h + 2 * i) + (i + h))
    return cfg.num_hidden_layers * rank * (attention + router + experts)  # type: ignore[attr-defined]


def train_memory(model: object, storage: str) -> dict:
    """LoRA, gradient and AdamW-state bytes (counted and RSS growth) around one step at T=64."""
    import torch

    import moe_experts
    from lora_core import LoraConfig

    before = _trimmed_rss_mib()
    lora = LoraConfig(
        enable=True,
        rank=RANK,
        alpha=2 * RANK,
        target_modules=DENSE,
        target_parameters=list(moe_experts.router_targets(model)),
    )
    result = moe_experts.adapt_model(model, lora, weight_dtype=storage)
    params = list(result.parameters())
    after_lora = _trimmed_rss_mib()
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))  # type: ignore[attr-defined]
    model.train()  # type: ignore[attr-defined]
    after = []
    for _ in range(2):  # the second step shows whether the first one's residue is workspace
        model(ids, labels=ids).loss.backward()  # type: ignore[operator]
        opt.step()
        after.append(_trimmed_rss_mib())
    after_step = after[0]
    elem = params[0].element_size()
    count = sum(p.numel() for p in params)
    arithmetic = lora_arithmetic(model.config, RANK)  # type: ignore[attr-defined]
    state = sum(
        t.nbytes
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    grads = sum(p.grad.nbytes for p in params if p.grad is not None)
    return {
        "lora_params": count,
        "lora_params_arithmetic": arithmetic,
        "lora_mib": count * elem / 2**20,
        "lora_arithmetic_mib": arithmetic * elem / 2**20,
        "lora_rss_mib": after_lora - before,
        "grad_mib": grads / 2**20,
        "adam_state_mib": state / 2**20,
        "grad_adam_arithmetic_mib": 3 * arithmetic * elem / 2**20,
        "step_rss_mib": after_step - after_lora,
        "second_step_rss_mib": after[1] - after[0],
    }


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # then the peak includes the warm-up, which is small


def save(root: Path, quick: bool, layers: int) -> None:
    """Write the random checkpoint twice (per-expert keys, 1 GB shards): bf16 and FP8 blocks."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_experts.testing import save_fp8_checkpoint

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(quick, layers), dtype=torch.bfloat16)
    model.save_pretrained(root / "bf16", max_shard_size="1GB")
    save_fp8_checkpoint(model, root / "fp8", max_shard_size="1GB")


def run_variant(variant: str, root: Path) -> dict:
    """Load the checkpoint under ``root`` the ``variant`` way and account for its memory."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    import moe_experts
    from moe_experts import is_placeholder
    from moe_experts.testing import tiny_config

    warnings.filterwarnings("ignore")
    # Warm-up: every lazy import and one-off allocation lands before the baseline.
    moe_experts.wrap(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")))
    _reset_peak()
    base = _rss_mib()
    start = time.perf_counter()
    storage = "fp8" if variant.endswith("fp8") else "bf16"
    path = root / storage
    if variant.startswith("load_pretrained"):
        model = moe_experts.load_pretrained(path, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        moe_experts.wrap(model, weight_dtype="bf16")
    seconds = time.perf_counter() - start
    final = _rss_mib()
    cfg = model.config
    kernel = sum(k.expert_weights.nbytes for _, k in moe_experts.experts_sites(model))
    dense = sum(p.nbytes for p in [*model.parameters(), *model.buffers()] if not is_placeholder(p))
    arithmetic = (
        cfg.num_hidden_layers
        * cfg.num_experts
        * 3
        * cfg.hidden_size
        * cfg.moe_intermediate_size
        * BYTES_PER_WEIGHT[storage]
    )
    peak = _peak_mib() - base
    return {
        "variant": variant,
        "seconds": seconds,
        "base_mib": base,
        "peak_mib": peak,
        "final_mib": final - base,
        "kernel_mib": kernel / 2**20,
        "kernel_arithmetic_mib": arithmetic / 2**20,
        "dense_mib": dense / 2**20,
        **train_memory(model, storage),
    }


def main() -> None:
    """Save once, run each variant in a child process, write JSON and a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; 1 quick)")
    ap.add_argument("--keep", type=Path, default=None, help="reuse/keep the checkpoint here")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child[0], Path(args.child[1]))))
        return
    layers = args.layers or (1 if args.quick else 4)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="bench-load-")
    path = args.keep or Path(tmp.name)  # type: ignore[union-attr]
    if not (path / "fp8" / "config.json").is_file():
        save(path, args.quick, layers)
    rows = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--out", str(args.out), "--child", variant, str(path)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if out.returncode:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if tmp is not None:
        tmp.cleanup()
    ref = rows[0]
    for r in rows:
        r["peak_over_final"] = r["peak_mib"] / r["final_mib"]
        r["peak_vs_from_pretrained"] = ref["peak_mib"] / r["peak_mib"]
    meta = {
        "layers": layers,
        "quick": args.quick,
        "shape": shape(args.quick),
        "targets": {"peak_over_final": 1.15, "peak_vs_from_pretrained": 2.0},
    }
    write_results(
        args.out,
        "bench_load",
        meta,
        rows,
        f"Qwen3-30B-A3B-shaped, {layers} layer(s), bf16 and FP8-block checkpoints (RSS above "
        "the post-import baseline)",
        [
            "variant",
            "load s",
            "peak MiB",
            "final MiB",
            "peak/final",
            "x less peak than from_pretrained+wrap",
            "kernel MiB (arith.)",
            "dense MiB",
            "LoRA MiB (arith.), RSS added",
            "grads + AdamW MiB (arith.), RSS added",
            "RSS added by step 2",
        ],
        lambda r: [
            r["variant"],
            f"{r['seconds']:.1f}",
            f"{r['peak_mib']:.0f}",
            f"{r['final_mib']:.0f}",
            f"{r['peak_over_final']:.2f}",
            f"{r['peak_vs_from_pretrained']:.2f}",
            f"{r['kernel_mib']:.0f} ({r['kernel_arithmetic_mib']:.0f})",
            f"{r['dense_mib']:.0f}",
            f"{r['lora_mib']:.1f} ({r['lora_arithmetic_mib']:.1f}), {r['lora_rss_mib']:.1f}",
            f"{r['grad_mib'] + r['adam_state_mib']:.1f} "
            f"({r['grad_adam_arithmetic_mib']:.1f}), {r['step_rss_mib']:.1f}",
            f"{r['second_step_rss_mib']:.1f}",
        ],
    )


if __name__ == "__main__":
    main()
