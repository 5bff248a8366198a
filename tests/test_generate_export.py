"""``generate`` and ``export`` on a real fine-tuned checkpoint, checked with transformers + PEFT."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROMPT = "What is the opposite of hot?"


def _moe_experts(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = str(Path(sys.executable).with_name("moe-experts"))
    return subprocess.run(
        [script, *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict:
    """One short chat fine-tune on the shipped dataset, shared by the tests of this module."""
    import os

    from moe_experts.finetune.data import chat_demo_path

    env = dict(
        os.environ, MOE_EXPERTS_CACHE=str(model_cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"
    )
    out = tmp_path_factory.mktemp("run")
    proc = _moe_experts(
        [
            "finetune",
            "--data",
            str(chat_demo_path()),
            "--steps",
            "20",
            "--output",
            str(out),
            "--no-progress",
        ],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    return {
        "env": env,
        "root": out / "checkpoints",
        "base": model_cache / "tiny-qwen3-moe",
        "tmp": tmp_path_factory.mktemp("exports"),
    }


def _peft(base: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


IDS = torch.tensor([[256, *PROMPT.encode()]])


@pytest.mark.timeout(300)
def test_generate_greedy_matches_peft_argmax(trained: dict) -> None:
    from transformers import AutoTokenizer

    proc = _moe_experts(
        [
            "generate",
            "--adapter",
            str(trained["root"]),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "12",
        ],
        trained["env"],
    )
    assert proc.returncode == 0, proc.stderr
    model = _peft(trained["base"], trained["root"] / "step-00000020")
    tok = AutoTokenizer.from_pretrained(trained["base"])
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
    expected = tok.decode(new, skip_special_tokens=True)
    assert proc.stdout.rstrip("\n") == expected


@pytest.mark.timeout(300)
def test_generate_bad_adapter_is_one_error_line(trained: dict, tmp_path: Path) -> None:
    proc = _moe_experts(["generate", "--adapter", str(tmp_path), "--prompt", "x"], trained["env"])
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_export_peft_loads_with_peft(trained: dict) -> None:
    out = trained["tmp"] / "peft"
    proc = _moe_experts(
        ["export", str(trained["root"]), "--format", "peft", "--output", str(out)], trained["env"]
    )
    assert proc.returncode == 0, proc.stderr
    with torch.no_grad():
        exported = _peft(trained["base"], out)(input_ids=IDS).logits
        original = _peft(trained["base"], trained["root"] / "step-00000020")(input_ids=IDS).logits
    assert torch.equal(exported, original)


@pytest.mark.timeout(300)
def test_export_merged_is_base_plus_adapter(trained: dict) -> None:
    from transformers import AutoModelForCausalLM

    out = trained["tmp"] / "merged"
    proc = _moe_experts(
        [
            "export",
            str(trained["root"]),
            "--format",
            "merged",
            "--output",
            str(out),
            "--max-shard-size",
            "200KB",
        ],
        trained["env"],
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    peft_model = _peft(trained["base"], trained["root"] / "step-00000020")
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=IDS).logits, peft_model(input_ids=IDS).logits, rtol=1e-4, atol=1e-5
        )
        base = AutoModelForCausalLM.from_pretrained(trained["base"])(input_ids=IDS).logits
    assert not torch.allclose(merged(input_ids=IDS).logits, base, atol=1e-3)


# What vLLM's LoRA loader (vllm/lora: utils.parse_fine_tuned_lora_name, lora_model
# LoRAModel.from_local_checkpoint, peft_helper.PEFTHelper, worker_manager; read in vLLM 0.34.0,
# which cannot be installed beside torch 2.13 / transformers 5.24) requires of an adapter
# directory, restated here because vLLM itself cannot run in this environment.
VLLM_REQUIRED_CONFIG = ("r", "lora_alpha", "target_modules")
VLLM_REFUSED_CONFIG = {"use_dora": True, "lora_bias": True}


def _vllm_module(key: str) -> tuple[str, bool]:
    """vLLM's reading of a tensor key: (module name without the PEFT prefix, is lora_A)."""
    assert key.startswith("base_model.model."), key
    parts = key.removeprefix("base_model.model.").split(".")
    assert parts[-1] == "weight", key
    assert parts[-2] in ("lora_A", "lora_B"), key
    return ".".join(parts[:-2]), parts[-2] == "lora_A"


def _check_vllm_load_rules(cfg: dict, tensors: dict, base) -> None:
    """The adapter passes vLLM's checks for a 2-D-expert MoE model (e.g. Qwen3-MoE)."""
    for field in VLLM_REQUIRED_CONFIG:
        assert field in cfg, f"vLLM requires {field} in adapter_config.json"
    assert isinstance(cfg["r"], int)
    assert cfg["r"] > 0
    for field, bad in VLLM_REFUSED_CONFIG.items():
        assert cfg.get(field) != bad, f"vLLM refuses {field}={bad}"
    assert cfg.get("bias", "none") == "none"
    assert not cfg.get("modules_to_save"), "vLLM takes modules_to_save only for classifiers"
    init = cfg.get("init_lora_weights", True)
    assert not isinstance(init, str) or init.lower() == "gaussian", init
    # Scale differences are folded into B, so no pattern may rescale a module a second time.
    assert not cfg.get("rank_pattern")
    assert not cfg.get("alpha_pattern")
    n_experts = base.config.num_experts
    # vLLM's expected expert modules for a 2-D (per-expert checkpoint) MoE: experts.{e}.{w}
    # from the model's expert mapping (gate_proj, up_proj, down_proj per expert).
    expected_experts = {
        f"experts.{e}.{w}" for e in range(n_experts) for w in ("gate_proj", "up_proj", "down_proj")
    }
    # Attention: the packed qkv_proj's parts and o_proj (Qwen3MoeForCausalLM's mapping).
    expected_plain = {"q_proj", "k_proj", "v_proj", "o_proj"}
    halves: dict[str, dict[bool, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        assert ".base_layer." not in key, f"{key}: vLLM reads base_layer keys as 3-D experts"
        module, is_a = _vllm_module(key)
        if ".experts" in module:
            suffix = module[module.index(".experts") + 1 :]
            assert suffix in expected_experts, f"vLLM: unexpected expert module {module}"
        else:
            assert module.rsplit(".", 1)[-1] in expected_plain, f"vLLM: unexpected {module}"
        assert tensor.ndim == 2, key
        assert tensor.dtype in (torch.float32, torch.bfloat16, torch.float16), key
        halves.setdefault(module, {})[is_a] = tensor
    for module, pair in halves.items():
        assert set(pair) == {True, False}, f"{module}: vLLM needs both lora_A and lora_B"
        a, b = pair[True], pair[False]
        assert a.shape[0] == cfg["r"], module
        assert b.shape[1] == cfg["r"], module
        if ".experts." not in module:
            w = base.get_submodule(module).weight
            assert (b.shape[0], a.shape[1]) == tuple(w.shape), module
    experts_seen = {m[m.index(".experts") + 1 :] for m in halves if ".experts." in m}
    assert experts_seen == expected_experts  # every expert of every projection, none extra


@pytest.mark.timeout(300)
def test_export_vllm_per_expert_equals_peft_merge_deltas(trained: dict) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = trained["tmp"] / "vllm"
    proc = _moe_experts(
        ["export", str(trained["root"]), "--format", "vllm", "--output", str(out)], trained["env"]
    )
    assert proc.returncode == 0, proc.stderr
    # The router and lm_head LoRA that vLLM refuses are named, not dropped silently.
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert any("model.layers.0.mlp.gate.weight" in line for line in warnings), proc.stderr
    assert any("lm_head" in line for line in warnings), proc.stderr
    cfg = json.loads((out / "adapter_config.json").read_text())
    tensors = load_file(out / "adapter_model.safetensors")
    pattern = re.compile(
        r"base_model\.model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
        r"mlp\.experts\.\d+\.(gate|up|down)_proj)\.lora_[AB]\.weight$"
    )
    assert all(pattern.match(k) for k in tensors), sorted(tensors)[:5]
    assert sorted(cfg["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    scaling = cfg["lora_alpha"] / cfg["r"]

    base = AutoModelForCausalLM.from_pretrained(trained["base"])
    _check_vllm_load_rules(cfg, tensors, base)
    merged = _peft(trained["base"], trained["root"] / "step-00000020").merge_and_unload()
    n_layers, n_experts = base.config.num_hidden_layers, base.config.num_experts
    inter = base.config.moe_intermediate_size
    checked = 0
    for layer in range(n_layers):
        b_exp = base.model.layers[layer].mlp.experts
        m_exp = merged.model.layers[layer].mlp.experts
        for e in range(n_experts):
            deltas = {
                "gate_proj": (m_exp.gate_up_proj[e] - b_exp.gate_up_proj[e])[:inter],
                "up_proj": (m_exp.gate_up_proj[e] - b_exp.gate_up_proj[e])[inter:],
                "down_proj": m_exp.down_proj[e] - b_exp.down_proj[e],
            }
            for proj, delta in deltas.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
                assert a.shape == (cfg["r"], delta.shape[1])  # A [r, in]
                assert b.shape == (delta.shape[0], cfg["r"])  # B [out, r]
                torch.testing.assert_close(scaling * b @ a, delta.detach(), rtol=1e-4, atol=1e-6)
                checked += 1
    assert checked == n_layers * n_experts * 3
    assert any(float(tensors[k].abs().max()) > 0 for k in tensors if ".lora_B." in k)


# -- damaged checkpoints and bad outputs: one error line, nothing used, nothing left behind --


def _damaged_copy(trained: dict, tmp_path: Path, damage: str) -> Path:
    """A copy of the trained checkpoint with ``damage`` done to its adapter."""
    from blake3 import blake3

    ckpt = tmp_path / "ckpts" / "step-00000020"
    shutil.copytree(trained["root"] / "step-00000020", ckpt)
    adapter, config = ckpt / "adapter_model.safetensors", ckpt / "adapter_config.json"

    def rewrite(path: Path, data: bytes) -> None:
        # The manifest records the new size and digest: only the content is bad.
        path.write_bytes(data)
        raw = json.loads((ckpt / "manifest.json").read_text())
        for f in raw["files"]:
            if f["file"] == path.name:
                f["size"], f["digest"] = len(data), blake3(data).hexdigest()
        (ckpt / "manifest.json").write_text(json.dumps(raw))

    if damage == "truncated":
        adapter.write_bytes(adapter.read_bytes()[:100])
    elif damage == "truncated-in-manifest":
        rewrite(adapter, adapter.read_bytes()[:100])
    elif damage == "config-not-json":
        rewrite(config, b"{not json")
    elif damage == "config-a-list":
        rewrite(config, b"[1, 2]")
    elif damage == "flipped-byte":
        data = bytearray(adapter.read_bytes())
        data[-3] ^= 0xFF
        adapter.write_bytes(bytes(data))
    elif damage == "missing-adapter":
        adapter.unlink()
    else:
        raise AssertionError(damage)
    return ckpt


def _command(command: str, ckpt: Path, out: Path, *extra: str) -> tuple[object, list[str]]:
    from moe_experts.finetune.export import export_main
    from moe_experts.finetune.generate import generate_main

    if command == "generate":
        return generate_main, ["--adapter", str(ckpt), "--prompt", "x", "--max-new-tokens", "2"]
    return export_main, [str(ckpt), "--format", command, "--output", str(out), *extra]


def _one_error(capsys: pytest.CaptureFixture[str], main, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def _nothing_written(out: Path) -> None:
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    if out.parent.exists():
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


DAMAGE = {
    "truncated": "adapter_model.safetensors",
    "truncated-in-manifest": "adapter_model.safetensors",
    "flipped-byte": "adapter_model.safetensors",
    "config-not-json": "adapter_config.json",
    "config-a-list": "adapter_config.json",
    "missing-adapter": "adapter_model.safetensors",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["generate", "peft", "vllm", "merged"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_refused_before_use(
    trained: dict, tmp_path: Path, capsys, monkeypatch, command: str, damage: str
) -> None:
    # Verified as `lora-checkpoint verify` does before anything is loaded or written.
    monkeypatch.setenv("MOE_EXPERTS_CACHE", trained["env"]["MOE_EXPERTS_CACHE"])
    ckpt = _damaged_copy(trained, tmp_path, damage)
    out = tmp_path / "exports" / "out"
    line = _one_error(capsys, *_command(command, ckpt, out))
    assert DAMAGE[damage] in line, line
    _nothing_written(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["peft", "vllm", "merged"])
@pytest.mark.parametrize("where", ["at-a-file", "under-a-file"])
def test_export_output_at_or_under_a_file(
    trained: dict, tmp_path: Path, capsys, command: str, where: str
) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("keep me")
    out = blocker if where == "at-a-file" else blocker / "sub" / "out"
    line = _one_error(capsys, *_command(command, trained["root"], out))
    for needle in ("--output", "file.txt", "is a file"):
        assert needle in line, line
    assert blocker.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", ["lots", "0", "-1GB", "1.5XB", "nan", ""])
def test_export_bad_max_shard_size_refused_before_writing(
    trained: dict, tmp_path: Path, capsys, size: str
) -> None:
    out = tmp_path / "exports" / "merged"
    line = _one_error(capsys, *_command("merged", trained["root"], out, f"--max-shard-size={size}"))
    assert "--max-shard-size" in line, line
    assert not (tmp_path / "exports").exists()


@pytest.mark.timeout(300)
def test_failed_export_leaves_nothing_and_the_next_one_succeeds(
    trained: dict, tmp_path: Path, capsys
) -> None:
    from moe_experts.finetune.export import export_main

    ckpt = _damaged_copy(trained, tmp_path, "missing-adapter")
    out = tmp_path / "exports" / "deep" / "peft"
    line = _one_error(capsys, *_command("peft", ckpt, out))
    assert "adapter_model.safetensors" in line, line
    assert not (tmp_path / "exports").exists()  # the parents it made are gone too
    good = trained["root"] / "step-00000020"
    shutil.copy2(good / "adapter_model.safetensors", ckpt / "adapter_model.safetensors")
    assert export_main([str(ckpt), "--format", "peft", "--output", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["peft"]  # no temp sibling left
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (good / name).read_bytes()
    # A used output is refused, and left as it was.
    line = _one_error(capsys, *_command("peft", ckpt, out))
    assert "not empty" in line, line
    assert (out / "adapter_model.safetensors").read_bytes() == (
        good / "adapter_model.safetensors"
    ).read_bytes()
