"""Peak activation memory of a training step with and without ``--gradient-checkpointing``.

A Qwen3-MoE model with Qwen3-30B-A3B's layer dimensions (H=2048, I=768, k=8, 32 heads of
128, 4 KV heads; ``--quick``: toy sizes), E=16 experts (the expert count does not change the
activations, only the load time), a 1024-token vocabulary (the loss's logits are the same
either way and would hide the layers' activations), 4 layers, random weights, experts on the kernel in bf16,
dense layers in fp32 on the CPU with kt-kernel's causal attention, LoRA rank 16 on q/k/v/o,
the routers and the experts. A short warm-up step, then one measured forward and backward of one row
of ``T`` tokens, in a child process per variant: checkpointing off/on, kernel policy
``save``/``recompute``.

Peak activation memory: on the CPU the resident set sampled every 2 ms during the step minus
the resident set just before it (the model, its LoRA and the input are resident by then); on
CUDA (``--device cuda``) ``torch.cuda.max_memory_allocated`` minus the allocation before it.

``--narrow N`` divides H, I and the head counts by N (head_dim stays 128): every activation
keeps its share of the total, and a 2-core machine can run T=8192.

Usage: ``python bench_checkpointing.py --out DIR [--quick] [--lengths 8192] [--device cpu]
[--narrow N] [--policies save,recompute]``.
Writes ``bench_checkpointing.json`` and ``bench_checkpointing.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _common module
from _common import DENSE, RANK, shape, write_results

VARIANTS = (
    ("off", "save"),
    ("on", "save"),
    ("off", "recompute"),
    ("on", "recompute"),
)
TOY = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 128,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}  # fmt: skip


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One step of one variant; returns the peak activation bytes and the step's time."""
    from transformers import AutoModelForCausalLM

    import moe_experts
    from lora_core import LoraConfig
    from moe_experts.memory import trim_host_heap
    from moe_experts.testing import tiny_config

    # vocab 1024: the loss's [T, V] logits are the same with and without checkpointing and
    # would hide the layers' activations at 32000.
    fields = {
        **shape(True),
        "num_experts": 16,
        "vocab_size": 1024,
        **(TOY if spec["quick"] else {}),
    }
    fields["max_position_embeddings"] = max(4096, spec["seq"])
    cfg = tiny_config("qwen3_moe", **fields, num_hidden_layers=spec["layers"])
    device = spec["device"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    moe_experts.wrap(model, weight_dtype="bf16", policy=spec["policy"], self_check=False)
    model.to(device)
    lora = LoraConfig(
        enable=True,
        rank=RANK,
        alpha=2 * RANK,
        target_modules=DENSE,
        target_parameters=list(moe_experts.router_targets(model)),
    )
    moe_experts.adapt_model(model, lora, weight_dtype="bf16")
    if spec["checkpointing"] == "on":
        moe_experts.enable_gradient_checkpointing(model)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (1, spec["seq"]), generator=torch.Generator())
    ids = ids.to(device)
    cuda = device.startswith("cuda")
    # A short warm-up step first: one-time allocations (thread pools, lazily loaded
    # libraries) would otherwise count as activations. The kernel's scratch for T tokens is
    # still counted, alike in every variant (which only brings the ratios closer to 1).
    model(ids[:, :256], labels=ids[:, :256]).loss.backward()
    for p in model.parameters():
        p.grad = None
    trim_host_heap()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    before_rss = _rss()
    peak = [before_rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], _rss())
    row = {k: spec[k] for k in ("seq", "checkpointing", "policy", "device")}
    row["step_s"] = elapsed
    row["loss"] = float(loss)
    row["peak_activation_gib"] = (
        (torch.cuda.max_memory_allocated() - before) if cuda else (peak[0] - before_rss)
    ) / 2**30
    return row


def main() -> int:
    """Run every variant in its own process and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="toy sizes, T=512")
    ap.add_argument("--lengths", default="8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policies", default="save,recompute", help="kernel policies to run")
    ap.add_argument(
        "--narrow",
        type=int,
        default=1,
        help="divide H, I and the head counts by N (a 2-core machine: --narrow 8)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print("ROW " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [512] if args.quick else [int(x) for x in args.lengths.split(",")]
    rows = []
    for seq in lengths:
        for ckpt, policy in VARIANTS:
            if policy not in args.policies.split(","):
                continue
            spec = {"seq": seq, "checkpointing": ckpt, "policy": policy, "device": args.device,
                    "layers": args.layers, "quick": args.quick, "narrow": args.narrow}  # fmt: skip
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
                check=False,
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")]
            if not lines:
                raise RuntimeError(f"variant {spec} failed:\n{proc.stderr[-2000:]}")
            row = json.loads(lines[-1][4:])
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:  # each against checkpointing off with the same policy and length
        base = next(
            r
            for r in rows
            if r["seq"] == row["seq"]
            and r["policy"] == row["policy"]
            and r["checkpointing"] == "off"
        )
        row["vs_off"] = row["peak_activation_gib"] / base["peak_activation_gib"]
    meta = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "torch": torch.__version__,
    }
    write_results(
        args.out,
        "bench_checkpointing",
        meta,
        rows,
        f"Peak activation memory of one step, {args.layers} layers, widths / {args.narrow}, "
        f"dense on {args.device} "
        f"({meta['date']}, {meta['machine']}; `{meta['command']}`)",
        ["T", "checkpointing", "kernel policy", "peak activations GiB", "vs off", "step s", "loss"],
        lambda r: [
            str(r["seq"]),
            r["checkpointing"],
            r["policy"],
            f"{r['peak_activation_gib']:.2f}",
            f"{r['vs_off']:.2f}",
            f"{r['step_s']:.1f}",
            f"{r['loss']:.4f}",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
