"""Each user error gives one clear line and a non-zero exit, and no traceback without --debug."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_bad_config_names_the_key(tmp_path: Path, cli, assert_clean_error) -> None:
    cfg = tmp_path / "lora.yaml"
    cfg.write_text("models:\n  moe:\n    lora:\n      enable: true\n      rnak: 8\n")
    assert_clean_error(cli.run(["--config", str(cfg), "--steps", "1"]), "rnak", "rank")


@pytest.mark.timeout(120)
def test_missing_data_file(tmp_path: Path, cli, assert_clean_error) -> None:
    assert_clean_error(
        cli.run(["--data", str(tmp_path / "nope.jsonl"), "--steps", "1"]), "nope.jsonl"
    )


@pytest.mark.timeout(120)
def test_unsupported_model(tmp_path: Path, cli, assert_clean_error) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    assert_clean_error(cli.run(["--model", str(tmp_path / "llama"), "--steps", "1"]), "qwen3_moe")


@pytest.mark.timeout(200)
def test_corrupt_checkpoint_on_resume(tmp_path: Path, cli, assert_clean_error) -> None:
    out = tmp_path / "run"
    first = cli.run(
        [
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--no-progress",
            "--output",
            str(out),
        ]
    )
    assert first.returncode == 0, first.stderr
    ckpt = Path(first.stdout.split("checkpoint:")[1].split()[0])
    victim = ckpt / "adapter_model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = cli.run(
        [
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--no-progress",
            "--output",
            str(out),
            "--resume",
            str(ckpt),
        ]
    )
    assert_clean_error(proc, "adapter_model.safetensors")
    with_debug = cli.run(
        [
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--no-progress",
            "--output",
            str(out),
            "--resume",
            str(ckpt),
            "--debug",
        ]
    )
    assert with_debug.returncode == 1
    assert "Traceback" in with_debug.stderr


@pytest.mark.timeout(120)
def test_share_experts_misuse_is_named(tmp_path: Path, cli, assert_clean_error) -> None:
    """--share-experts needs torchrun with several local ranks; the two flags exclude each
    other; the YAML key takes true or false only."""
    out = ["--output", str(tmp_path / "out"), "--steps", "1"]
    assert_clean_error(
        cli.run(["--share-experts", *out]),
        "--share-experts",
        "LOCAL_WORLD_SIZE=1",
        "torchrun --nproc-per-node",
    )
    both = cli.run(["--share-experts", "--no-share-experts", *out])
    assert both.returncode == 2, both.stderr
    assert "--no-share-experts: not allowed with argument --share-experts" in both.stderr
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  share_experts: sometimes\n")
    assert_clean_error(
        cli.run(["--config", str(cfg), *out]), "model.share_experts", "'sometimes'", "true or false"
    )
    cfg.write_text("model:\n  share_experts: true\n")
    assert_clean_error(
        cli.run(["--config", str(cfg), *out]), "model.share_experts", "LOCAL_WORLD_SIZE=1"
    )


@pytest.mark.timeout(120)
def test_share_experts_round_trips_through_print_config(tmp_path: Path, cli) -> None:
    import yaml

    shown = {}
    for flags in ([], ["--no-share-experts"], ["--share-experts"]):
        proc = cli.run([*flags, "--print-config"])
        assert proc.returncode == 0, proc.stderr
        shown[tuple(flags)] = yaml.safe_load(proc.stdout)["model"]["share_experts"]
    assert shown == {(): None, ("--no-share-experts",): False, ("--share-experts",): True}
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  share_experts: false\n")
    again = cli.run(["--config", str(cfg), "--print-config"])
    assert yaml.safe_load(again.stdout)["model"]["share_experts"] is False
    flag_wins = cli.run(["--config", str(cfg), "--share-experts", "--print-config"])
    assert yaml.safe_load(flag_wins.stdout)["model"]["share_experts"] is True


@pytest.mark.parametrize("key", ["kernel_attention", "kernel_norms"])
def test_kernel_ops_are_on_by_default_and_can_be_turned_off(tmp_path: Path, cli, key: str) -> None:
    import yaml

    off = "--no-" + key.replace("_", "-")
    shown = {}
    for flags in ([], [off]):
        proc = cli.run([*flags, "--print-config"])
        assert proc.returncode == 0, proc.stderr
        shown[tuple(flags)] = yaml.safe_load(proc.stdout)["model"][key]
    assert shown == {(): True, (off,): False}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  {key}: false\n")
    again = cli.run(["--config", str(cfg), "--print-config"])
    assert yaml.safe_load(again.stdout)["model"][key] is False


def _builtin_copy(model_cache: Path, dest: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the built-in tiny model directory (single-file safetensors, tokenizer)."""
    import shutil

    from moe_experts.finetune.models import builtin_model_dir

    monkeypatch.setenv("MOE_EXPERTS_CACHE", str(model_cache))
    return Path(shutil.copytree(builtin_model_dir("tiny-qwen3-moe"), dest))


def _damage(path: Path, case: str) -> tuple[str, ...]:
    """Damage the model directory ``path`` as ``case`` says; return what the error must name."""
    import json

    import torch

    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    if case in ("experts-beyond-config", "top-k-above-experts", "huge-expert-count"):
        config.update(
            {
                "experts-beyond-config": {"num_local_experts": 6},
                "top-k-above-experts": {"num_experts_per_tok": 9},
                "huge-expert-count": {"num_local_experts": 10**12},
            }[case]
        )
        config_file.write_text(json.dumps(config))
        return {
            "experts-beyond-config": ("experts.6.", "num_local_experts = 6"),
            "top-k-above-experts": ("num_experts_per_tok = 9", "num_local_experts = 8"),
            "huge-expert-count": ("num_local_experts = 1000000000000", "of host memory"),
        }[case]
    file = path / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    key = (
        "model.layers.0.self_attn.q_proj.weight"
        if case == "nan-weight"
        else next(k for k in header if ".experts." in k)
    )
    start = header[key]["data_offsets"][0]
    if case == "garbled-offsets":
        header[key]["data_offsets"] = [start]
    else:  # a NaN where the dense weight starts
        nan = torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes()
        data = data[:start] + nan + data[start + 4 :]
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return (str(file), repr(key))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "case",
    [
        "garbled-offsets",
        "nan-weight",
        "experts-beyond-config",
        "top-k-above-experts",
        "huge-expert-count",
    ],
)
def test_hostile_model_directory_is_one_error_line(
    tmp_path: Path,
    cli,
    assert_clean_error,
    model_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """A corrupt checkpoint or a config that contradicts it fails at load, named, before any
    step: not a traceback, not "non-finite gradients", not blamed on transformers."""
    model = _builtin_copy(model_cache, tmp_path / "model", monkeypatch)
    needles = _damage(model, case)
    proc = cli.run(["--model", str(model), "--steps", "1", "--output", str(tmp_path / "out")])
    line = assert_clean_error(proc, "--model", *needles)
    assert "transformers could not" not in line
    assert "gradient" not in line
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.timeout(200)
def test_run_finetune_from_python_makes_its_output_or_says_why(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI makes --output before the run; a Python caller gets the same, not a raw OSError.
    monkeypatch.setenv("MOE_EXPERTS_CACHE", str(model_cache))
    from moe_experts.finetune import FinetuneError
    from moe_experts.finetune.config import FinetuneArgs
    from moe_experts.finetune.run import run_finetune

    args = FinetuneArgs(steps=1, batch_size=2, seq_len=16, output=tmp_path / "new" / "run")
    summary = run_finetune(args)
    assert summary.checkpoint is not None
    assert summary.checkpoint.is_dir()
    assert summary.checkpoint.is_relative_to(tmp_path / "new" / "run")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FinetuneError, match=r"output .*file.* is under the file"):
        run_finetune(FinetuneArgs(steps=1, output=tmp_path / "file" / "run"))


@pytest.mark.timeout(200)
def test_a_failed_run_leaves_no_empty_output_behind(
    tmp_path: Path, cli, assert_clean_error
) -> None:
    # Bad records are found after --output is made; the run removes the directory it made,
    # and keeps one that was there before.
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"nope": 1}\n')
    new, old = tmp_path / "new" / "run", tmp_path / "old"
    old.mkdir()
    for out in (new, old):
        args = ["--data", str(data), "--steps", "1", "--output", str(out)]
        assert_clean_error(cli.run(args), "bad.jsonl")
    assert not new.exists()
    assert old.is_dir()
