"""Training step with the dense layers on a GPU and the routed experts on the host kernel.

Models: a Qwen3-30B-A3B-shaped one (H=2048, I=768, E=128, k=8) and a DeepSeek-V3-shaped one
(H=7168, I=2048, k=8, one shared expert, MLA attention; E cut to 32 so that 4 layers fit the
device machine's disk and the 8-minute budget), 4 layers each, random bf16 weights saved as
per-expert safetensors (``save_original_format``), loaded with ``moe_experts.load_pretrained``.
LoRA rank 16 on q/k/v/o (DeepSeek: its MLA projections), the routers and the experts, fp32
LoRA and AdamW. Each (shape, length, variant) runs in a fresh child process and reports
tokens/s over ``--steps`` timed steps after one warm-up step, peak GPU memory, and the GPU-idle
fraction of the last step (CUDA events around every wait for the host, see
``moe_experts.GpuIdleMeter``). Variants:

- ``all-host``: dense layers on the CPU too (the CPU-only path);
- ``hybrid-sequential``: dense on the GPU, the synchronous hand-over;
- ``hybrid-overlapped``: ``moe_experts.enable_overlap``;
- ``gpu-experts-8`` / ``gpu-experts-16``: overlapped, plus that many hot experts per layer;
- ``accelerate-offload``: transformers + PEFT with accelerate's CPU offload (``device_map=
  "auto"``, ``max_memory`` capping the GPU at half the model), where accelerate is installed;
- ``experts4bit``: experts4bit-qlora's streaming offload, where it is installed (not wired:
  its training API was not available to verify when this was written; the row says so).

Without CUDA only ``--device cpu`` runs (every variant of ours with the dense device on the
CPU: the code paths, not GPU figures) and the GPU rows are skipped. ``--budget-s`` stops
starting new rows once spent, so ``tests/gpu/device_bench.sh`` fits its 8 minutes.

Usage: ``python bench_hybrid.py --out DIR [--quick] [--device cuda|cpu] [--shapes a,b]
[--lengths 2048,8192] [--variants v1,v2] [--steps 2] [--layers 4] [--budget-s 420]``.
Writes ``bench_hybrid.json`` and ``bench_hybrid.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _common module
from _common import RANK, SHAPE, write_results

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b": (
        "qwen3_moe",
        {
            k: v
            for k, v in SHAPE.items()
            if k not in ("max_position_embeddings", "initializer_range")
        },
    ),
    "deepseek-v3": (
        "deepseek_v3",
        {
            "hidden_size": 7168,
            "moe_intermediate_size": 2048,
            "intermediate_size": 18432,
            "n_routed_experts": 32,
            "num_local_experts": 32,  # the tiny config sets both names
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 0,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "vocab_size": 32000,
        },
    ),
}
# --quick (and CPU smoke runs): the same families at toy sizes.
QUICK: dict[str, dict[str, Any]] = {
    "qwen3-30b": {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 32,
                  "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "vocab_size": 256},
    "deepseek-v3": {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 128,
                    "n_routed_experts": 32, "num_local_experts": 32, "num_attention_heads": 4,
                    "num_key_value_heads": 4,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 256},
}  # fmt: skip
OURS = (
    "all-host",
    "hybrid-sequential",
    "hybrid-overlapped",
    "gpu-experts-8",
    "gpu-experts-16",
)
OTHERS = ("accelerate-offload", "experts4bit")
VARIANTS = OURS + OTHERS
DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                 "kv_a_proj_with_mqa", "kv_b_proj"]  # fmt: skip


def make_checkpoint(name: str, layers: int, quick: bool, root: Path, seq: int) -> Path:
    """Random bf16 weights of a shape, saved with per-expert keys; reused when present."""
    from transformers import AutoModelForCausalLM

    from moe_experts.testing import tiny_config

    family, shape = SHAPES[name]
    fields = {**shape, **(QUICK[name] if quick else {})}
    path = root / f"{name}-{layers}l{'-quick' if quick else ''}"
    if (path / "config.json").is_file():
        return path
    cfg = tiny_config(
        family,
        **fields,
        num_hidden_layers=layers,
        max_position_embeddings=max(seq, 4096),
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(prefix=path.name, dir=root))
    model.save_pretrained(tmp, save_original_format=True)
    del model
    tmp.rename(path)
    return path


def _ours(path: Path, variant: str, device: str) -> tuple[Any, Any, list[torch.nn.Parameter]]:
    import moe_experts
    from lora_core import LoraConfig
    from moe_experts.finetune.devices import set_lora_dtype

    dense = "cpu" if variant == "all-host" else device
    dtype = torch.bfloat16 if dense.startswith("cuda") else torch.float32
    model = moe_experts.load_pretrained(path, weight_dtype="bf16", dtype=dtype, dense_device=dense)
    linears = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"
    }
    cfg = LoraConfig(
        enable=True,
        rank=RANK,
        alpha=2 * RANK,
        target_modules=[t for t in DENSE_TARGETS if t in linears],
        target_parameters=list(moe_experts.router_targets(model)),
    )
    result = moe_experts.adapt_model(model, cfg, weight_dtype="bf16")
    set_lora_dtype(result, torch.float32)
    if variant != "hybrid-sequential" and variant != "all-host":
        moe_experts.enable_overlap(model)
    hot = None
    if variant.startswith("gpu-experts-"):
        hot = moe_experts.enable_gpu_experts(model, int(variant.rsplit("-", 1)[1]), count_calls=1)
    return model.train(), hot, result.parameters()


def _accelerate(path: Path) -> tuple[Any, Any, list[torch.nn.Parameter]]:
    import peft
    from transformers import AutoModelForCausalLM

    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    cap = max(1, int(total / 2 / 2**30))  # the GPU gets half the model: the rest offloaded
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        device_map="auto",
        max_memory={0: f"{cap}GiB", "cpu": "200GiB"},
    )
    linears = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"
    }
    cfg = peft.LoraConfig(
        r=RANK,
        lora_alpha=2 * RANK,
        target_modules=[t for t in DENSE_TARGETS if t in linears],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = peft.get_peft_model(model, cfg)
    return model.train(), None, [p for p in model.parameters() if p.requires_grad]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: build the variant, one warm-up step, ``steps`` timed steps."""
    import moe_experts

    path, variant, seq, steps = Path(spec["path"]), spec["variant"], spec["seq"], spec["steps"]
    device = spec["device"]
    cuda = device.startswith("cuda") and variant != "all-host"
    row: dict[str, Any] = {k: spec[k] for k in ("shape", "seq", "variant", "device")}
    if variant == "experts4bit":
        import importlib.util

        found = importlib.util.find_spec("experts4bit_qlora") or importlib.util.find_spec(
            "experts4bit"
        )
        row["status"] = (
            "skipped: experts4bit-qlora is installed, but its training API is not wired here"
            if found
            else "skipped: experts4bit-qlora is not installed (put its wheel in .whl/)"
        )
        return row
    if variant == "accelerate-offload":
        import importlib.util

        if importlib.util.find_spec("accelerate") is None or not cuda:
            row["status"] = "skipped: needs CUDA and accelerate"
            return row
        model, hot, params = _accelerate(path)
        ids_device = "cuda:0"
    else:
        model, hot, params = _ours(path, variant, device)
        ids_device = device if cuda else "cpu"
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(ids_device)
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocator, pinned blocks; the hot experts' routing counts
    if hot is not None:
        hot.fix()
        row["resident_gib"] = hot.resident_bytes() / 2**30
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    meter = moe_experts.GpuIdleMeter() if cuda else None
    for i in range(steps):
        last = i == steps - 1 and meter is not None
        with moe_experts.idle_meter(meter if last else None):
            if last:
                meter.begin_step()
            step()
            if last:
                meter.end_step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    row["tokens_per_s"] = steps * seq / elapsed
    if cuda:
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if meter is not None and variant != "accelerate-offload":
            row["gpu_idle_fraction"] = meter.idle_fraction()
    row["status"] = "ok"
    return row


def _run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**spec, "status": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-1:])[:200]
    return {**spec, "status": f"failed (exit {proc.returncode}): {tail}"}


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    return format(value, fmt) if isinstance(value, int | float) else "-"


def main() -> int:
    """Run the matrix (or one ``--child`` row) and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="toy sizes, T=128, 1 step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--models", type=Path, default=None, help="checkpoint cache directory")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print("ROW " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.device.startswith("cuda"):
        args.quick = True  # real sizes on the CPU would take hours and show no GPU figure
    lengths = [128] if args.quick else [int(x) for x in args.lengths.split(",")]
    steps = 1 if args.quick else args.steps
    variants = args.variants.split(",")
    if not args.device.startswith("cuda"):
        print("no CUDA device: the GPU rows are skipped; our variants run with the dense "
              "device on the CPU (code paths, not GPU figures)")  # fmt: skip
        variants = [v for v in variants if v in OURS]
    root = args.models or Path(tempfile.mkdtemp(prefix="bench-hybrid-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    try:
        for name in args.shapes.split(","):
            path = make_checkpoint(name, args.layers, args.quick, root, max(lengths))
            for seq in lengths:
                for variant in variants:
                    spec = {"shape": name, "seq": seq, "variant": variant, "path": str(path),
                            "steps": steps, "device": args.device}  # fmt: skip
                    left = args.budget_s - (time.monotonic() - started)
                    if left <= 10:
                        row = {**spec, "status": "skipped: over --budget-s"}
                    else:
                        row = _run_child(spec, left)
                    row.pop("path", None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if args.models is None:
            shutil.rmtree(root, ignore_errors=True)
    meta = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs"
        + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "torch": torch.__version__,
    }
    write_results(
        args.out,
        "bench_hybrid",
        meta,
        rows,
        f"Training step, dense on {args.device}, experts on the host kernel "
        f"({meta['date']}, {meta['machine']}; `{meta['command']}`)",
        ["shape", "T", "variant", "tokens/s", "peak GPU GiB", "GPU idle", "status"],
        lambda r: [
            r["shape"],
            str(r["seq"]),
            r["variant"],
            _cell(r, "tokens_per_s", ",.0f"),
            _cell(r, "peak_gpu_gib", ".2f"),
            _cell(r, "gpu_idle_fraction", ".1%"),
            r.get("status", "?"),
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
