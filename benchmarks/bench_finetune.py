"""End-to-end fine-tune throughput: our stack against plain transformers + PEFT, one process.

Both train the same randomly initialised Qwen3-MoE decoder, from the same weights, on the same
batches, with LoRA of the same rank on attention, lm_head and every expert projection (PEFT:
``target_modules`` + ``target_parameters`` on the fused experts; ours: ``moe_experts.wrap`` +
``adapt_model``, experts on kt-kernel). Runs alternate so machine noise hits both alike.
Writes ``finetune.json`` and ``finetune.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from lora_core import LoraConfig
from moe_experts import adapt_model
from moe_experts.finetune import ByteTokenizer, PackedBatches
from moe_experts.finetune.data import default_corpus_path, load_texts

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]


def _model_dir(root: Path, quick: bool) -> Path:
    cfg = Qwen3MoeConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=256 if quick else 512,
        intermediate_size=512,
        moe_intermediate_size=128 if quick else 256,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8 if quick else 16,
        num_experts_per_tok=2 if quick else 4,
        norm_topk_prob=True,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    path = root / "bench-model"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _ours(path: Path, rank: int):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result = adapt_model(
        model,
        LoraConfig(enable=True, rank=rank, alpha=2 * rank, target_modules=TARGETS),
        weight_dtype="bf16",
    )
    return model, result.parameters()


def _peft(path: Path, rank: int):
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        PeftConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=TARGETS,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    return peft_model, [p for p in peft_model.parameters() if p.requires_grad]


def _train(model, params, batches: PackedBatches, steps: int, warmup: int) -> tuple[float, float]:
    """Return (seconds per step after warm-up, final loss)."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    times, loss = [], torch.tensor(0.0)
    for step in range(warmup + steps):
        rows = batches.batch(step)
        t0 = time.perf_counter()
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), rows[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), float(loss)


def main() -> int:
    """Run both stacks, alternating, and write the JSON and markdown results."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seq, batch = (64, 4) if args.quick else (128, 8)
    steps, warmup, rounds, rank = (4, 1, 1, 8) if args.quick else (8, 2, 2, 16)
    path = _model_dir(args.out, args.quick)
    batches = PackedBatches.build(
        load_texts(default_corpus_path()),
        ByteTokenizer().encode,
        seq_len=seq,
        batch_size=batch,
        seed=0,
    )
    runs: dict[str, list[float]] = {
        "moe-experts (kt-kernel, bf16 experts)": [],
        "transformers + PEFT (fp32)": [],
    }
    for _ in range(rounds):
        for name, build in zip(runs, (_ours, _peft), strict=True):
            model, params = build(path, rank)
            sec, _ = _train(model, params, batches, steps, warmup)
            runs[name].append(sec)
            del model, params
    tokens = seq * batch
    rows = []
    baseline = min(runs["transformers + PEFT (fp32)"])
    for name, secs in runs.items():
        best = min(secs)
        rows.append(
            {
                "stack": name,
                "step_s": best,
                "tokens_per_s": tokens / best,
                "speedup_vs_peft": baseline / best,
            }
        )
    result = {
        "benchmark": "finetune",
        "quick": args.quick,
        "seq_len": seq,
        "batch": batch,
        "rank": rank,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    (args.out / "finetune.json").write_text(json.dumps(result, indent=2))
    lines = ["| stack | step (s) | tokens/s | speed-up vs PEFT |", "|---|---|---|---|"]
    lines += [
        f"| {r['stack']} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | "
        f"{r['speedup_vs_peft']:.2f}x |"
        for r in rows
    ]
    (args.out / "finetune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
