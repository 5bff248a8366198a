"""Each user error gives one clear line and a non-zero exit, and no traceback without --debug."""

from __future__ import annotations

from pathlib import Path

import pytest


def _assert_clean_error(proc, *needles: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.timeout(120)
def test_bad_config_names_the_key(tmp_path: Path, cli) -> None:
    cfg = tmp_path / "lora.yaml"
    cfg.write_text("models:\n  moe:\n    lora:\n      enable: true\n      rnak: 8\n")
    _assert_clean_error(cli.run(["--config", str(cfg), "--steps", "1"]), "rnak", "rank")


@pytest.mark.timeout(120)
def test_missing_data_file(tmp_path: Path, cli) -> None:
    _assert_clean_error(cli.run(["--data", str(tmp_path / "nope.jsonl"), "--steps", "1"]),
                        "nope.jsonl")


@pytest.mark.timeout(120)
def test_unsupported_model(tmp_path: Path, cli) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    _assert_clean_error(cli.run(["--model", str(tmp_path / "llama"), "--steps", "1"]),
                        "qwen3_moe")


@pytest.mark.timeout(200)
def test_corrupt_checkpoint_on_resume(tmp_path: Path, cli) -> None:
    out = tmp_path / "run"
    first = cli.run(["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-progress",
                     "--output", str(out)])
    assert first.returncode == 0, first.stderr
    ckpt = Path(first.stdout.split("checkpoint:")[1].split()[0])
    victim = ckpt / "adapter_model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = cli.run(["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--no-progress",
                    "--output", str(out), "--resume", str(ckpt)])
    _assert_clean_error(proc, "adapter_model.safetensors")
    with_debug = cli.run(["--steps", "4", "--batch-size", "2", "--seq-len", "16",
                          "--no-progress", "--output", str(out), "--resume", str(ckpt),
                          "--debug"])
    assert with_debug.returncode == 1
    assert "Traceback" in with_debug.stderr
