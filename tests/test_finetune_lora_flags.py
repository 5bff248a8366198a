"""``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``: over the YAML, in --print-config,
checked by name, and in the adapter that PEFT loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file


@pytest.mark.timeout(300)
def test_rank_and_alpha_flags_reach_the_adapter_peft_loads(tmp_path: Path, cli, cli_env) -> None:
    out = tmp_path / "run"
    proc = cli.run(
        [
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--steps",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--no-progress",
            "--output",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    ckpt = out / "checkpoints" / "step-00000002"
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)  # the defaults are 8 and 16

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    source = Path(cli_env["MOE_EXPERTS_CACHE"]) / "tiny-qwen3-moe"
    n_experts = AutoModelForCausalLM.from_pretrained(source).config.num_experts
    saved = load_file(ckpt / "adapter_model.safetensors")
    assert len(saved) > 10
    for key, t in saved.items():
        # PEFT stores a fused 3-D expert parameter's LoRA as [E * r, in] / [out, E * r].
        r = 4 * n_experts if ".mlp.experts." in key else 4
        assert (t.shape[0] if ".lora_A." in key else t.shape[1]) == r, (key, t.shape)
    for key, t in load_file(ckpt / "fused_expert_lora.safetensors").items():
        # The kernel's layout: A [E, r, in], B [E, out, r].
        assert t.shape[1 if key.endswith("_a") else 2] == 4, (key, t.shape)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), ckpt)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert layers
    for layer in layers:
        assert layer.r["default"] == 4
        assert layer.scaling["default"] == pytest.approx(2.0)  # alpha / r
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    for key, t in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "") == key]
        assert len(match) == 1, key
        torch.testing.assert_close(match[0], t, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_flags_override_the_yaml_lora_block_in_print_config(tmp_path: Path, cli) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump({"lora": {"rank": 16, "alpha": 32, "dropout": 0.1, "target_parameters": []}})
    )
    # Dropout on router LoRA (target_parameters) is refused, so this config has none.
    from_yaml = yaml.safe_load(cli.run(["--config", str(cfg), "--print-config"]).stdout)
    assert (
        from_yaml["lora"]["rank"],
        from_yaml["lora"]["alpha"],
        from_yaml["lora"]["dropout"],
    ) == (16, 32.0, 0.1)
    shown = cli.run(
        ["--config", str(cfg), "--lora-rank", "4", "--lora-dropout", "0.05", "--print-config"]
    )
    assert shown.returncode == 0, shown.stderr
    lora = yaml.safe_load(shown.stdout)["lora"]
    assert (lora["rank"], lora["alpha"], lora["dropout"]) == (4, 32.0, 0.05)
    assert lora["target_parameters"] == []
    printed = tmp_path / "printed.yaml"
    printed.write_text(shown.stdout)
    again = cli.run(["--config", str(printed), "--print-config"])
    assert again.returncode == 0, again.stderr
    assert again.stdout == shown.stdout  # the output is itself a complete --config
    # Without any YAML the flags go over the defaults (rank 8, alpha 16).
    bare = yaml.safe_load(cli.run(["--lora-alpha", "2.5", "--print-config"]).stdout)["lora"]
    assert (bare["rank"], bare["alpha"], bare["dropout"]) == (8, 2.5, 0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--lora-rank", "0"], ["--lora-rank 0", ">= 1"]),
        (["--lora-rank", "-2"], ["--lora-rank -2", ">= 1"]),
        (["--lora-rank", "2.5"], ["--lora-rank '2.5'", "an integer"]),
        (["--lora-alpha", "0"], ["--lora-alpha 0", "> 0"]),
        (["--lora-alpha", "-1"], ["--lora-alpha -1", "> 0"]),
        (["--lora-alpha", "inf"], ["--lora-alpha inf", "finite"]),
        (["--lora-dropout", "1"], ["--lora-dropout 1", "[0, 1)"]),
        (["--lora-dropout", "-0.1"], ["--lora-dropout -0.1", "[0, 1)"]),
        # Valid alone, refused with the default router LoRA: the message names the flag.
        (["--lora-dropout", "0.1"], ["--lora-dropout 0.1", "target_parameters"]),
    ],
    ids=[
        "rank-0",
        "rank-negative",
        "rank-float",
        "alpha-0",
        "alpha-negative",
        "alpha-inf",
        "dropout-1",
        "dropout-negative",
        "dropout-with-router-lora",
    ],
)
def test_bad_lora_flags_are_one_clear_error(argv, needles, cli, assert_clean_error) -> None:
    assert_clean_error(cli.run([*argv, "--print-config"]), *needles)


@pytest.mark.timeout(120)
def test_a_bad_yaml_lora_value_names_its_key(tmp_path: Path, cli, assert_clean_error) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lora:\n  rank: 0\n")
    assert_clean_error(
        cli.run(["--config", str(cfg), "--print-config"]), f"--config {cfg}: lora.rank 0", ">= 1"
    )
