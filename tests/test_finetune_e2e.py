"""The main job end to end: the loss falls, and the checkpoint loads with PEFT and verifies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Measured on the built-in model and corpus (seed 0, 40 steps, lr 3e-3): the loss falls from
# ~5.6 (uniform over 259 byte tokens) to ~2.8. A 25% drop is a margin that a broken
# gradient path (adapters frozen, router cut off) cannot reach, and a working one clears.
MIN_RELATIVE_DROP = 0.25


def _script(name: str) -> str:
    """A console script installed beside this interpreter (the venv's bin may not be on PATH)."""
    return str(Path(sys.executable).with_name(name))


@pytest.mark.timeout(300)
def test_loss_falls_and_checkpoint_loads_with_peft(tmp_path: Path, cli, cli_env) -> None:
    out = tmp_path / "run"
    proc = cli.run(["--steps", "40", "--output", str(out), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    log = cli.log(out)
    assert [r["step"] for r in log] == list(range(1, 41))
    first, last = log[0]["loss"], log[-1]["loss"]
    assert last < first * (1 - MIN_RELATIVE_DROP), (first, last)
    assert "checkpoint:" in proc.stdout
    assert "PeftModel.from_pretrained" in proc.stdout

    ckpt = Path(proc.stdout.split("checkpoint:")[1].split()[0])
    verify = subprocess.run(
        [_script("lora-checkpoint"), "verify", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # The printed PEFT lines work: the adapter loads onto the base and changes its outputs.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = Path(cli_env["MOE_EXPERTS_CACHE"]) / "tiny-qwen3-moe"
    ids = torch.arange(1, 33).view(1, 32)
    base = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), ckpt)
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert not torch.allclose(base_logits, peft_logits)


@pytest.mark.timeout(120)
def test_console_script_help() -> None:
    proc = subprocess.run(
        [_script("moe-experts"), "finetune", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--model",
        "--data",
        "--config",
        "--steps",
        "--lr",
        "--batch-size",
        "--seq-len",
        "--save-every",
        "--output",
        "--resume",
    ):
        assert flag in proc.stdout


@pytest.mark.timeout(300)
def test_local_model_directory_with_its_tokenizer(tmp_path: Path, cli) -> None:
    """``--model PATH``: another family (Qwen2-MoE, shared expert) with a real HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2MoeConfig, Qwen2MoeForCausalLM

    corpus = tmp_path / "data.jsonl"
    lines = [f"expert {i % 7} reads token {i} and the router sends it on" for i in range(200)]
    corpus.write_text("".join(f'{{"text": "{t}"}}\n' for t in lines))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    model_dir = tmp_path / "qwen2-moe"
    cfg = Qwen2MoeConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    out = tmp_path / "run"
    proc = cli.run(
        [
            "--model",
            str(model_dir),
            "--data",
            str(corpus),
            "--steps",
            "12",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    log = cli.log(out)
    assert len(log) == 12
    assert log[-1]["loss"] < log[0]["loss"]
