"""PEFT reads what we write: ``PeftModel.from_pretrained`` gives the same outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lora_checkpoint as lc
from lora_core import LoraConfig, enable_lora_training
from lora_core.contracts import (
    AdaptationResult,
    ComponentVersion,
    PeftExport,
    PeftTensorLayout,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    return path


def _fresh(base_dir):
    return transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()


@pytest.mark.timeout(120)
def test_peft_model_from_pretrained_gives_same_outputs(tmp_path, base_dir):
    model = _fresh(base_dir)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        base_out = model(ids).logits
    result = enable_lora_training(
        model,
        LoraConfig(enable=True, rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")),
    )
    with torch.no_grad():
        for p in result.parameters():
            p.normal_(0, 0.2)  # B starts at zero; make the adapter change the output
        ours = model.eval()(ids).logits
    assert not torch.allclose(ours, base_out, atol=1e-3)
    m = lc.save(tmp_path, result, step=1, base_model_name_or_path=str(base_dir))
    ckpt = tmp_path / m.name
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base_dir)

    peft_model = peft.PeftModel.from_pretrained(_fresh(base_dir), str(ckpt)).eval()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    # every adapter weight PEFT holds came from our file, under the key we exported
    peft_sd = peft.get_peft_model_state_dict(peft_model)
    ours_by_key = {result.peft_exports[n].key: p for n, p in result.named_optimizer_parameters}
    assert set(peft_sd) == set(ours_by_key)
    for k, v in peft_sd.items():
        assert torch.equal(v, ours_by_key[k]), k


def test_peft_written_adapter_has_same_keys_as_ours(tmp_path, base_dir):
    """Our adapter_model.safetensors matches PEFT's own save_pretrained key for key."""
    model = _fresh(base_dir)
    result = enable_lora_training(
        model, LoraConfig(enable=True, rank=4, target_modules=("q_proj",))
    )
    m = lc.save(tmp_path / "ours", result, step=1)
    pm = peft.get_peft_model(
        _fresh(base_dir), peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"])
    )
    pm.save_pretrained(tmp_path / "peft")
    ours = load_file(tmp_path / "ours" / m.name / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert set(ours) == set(theirs)
    for k in ours:
        assert ours[k].shape == theirs[k].shape, k
        assert ours[k].dtype == theirs[k].dtype, k
    ref_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    our_cfg = json.loads((tmp_path / "ours" / m.name / "adapter_config.json").read_text())
    assert set(our_cfg) <= set(ref_cfg)  # we only write fields PEFT 0.21 knows
    for key in (
        "peft_type",
        "r",
        "lora_alpha",
        "bias",
        "task_type",
        "use_dora",
        "use_rslora",
        "fan_in_fan_out",
        "init_lora_weights",
    ):
        assert our_cfg[key] == ref_cfg[key], key


def test_expert_stacked_tensors_roundtrip_in_peft_file(tmp_path):
    """Stacked exports land in adapter_model.safetensors in PEFT's layout and invert back."""
    e, r, h, i = 4, 2, 8, 6
    a = torch.nn.Parameter(torch.randn(e, r, h))
    b = torch.nn.Parameter(torch.randn(e, i, r))
    result = AdaptationResult.create(
        adapted_layers=["mlp.experts"],
        named_optimizer_parameters=[
            ("mlp.experts.gate_up.lora_A", a),
            ("mlp.experts.gate_up.lora_B", b),
        ],
        ownership={
            "mlp.experts.gate_up.lora_A": "replicated",
            "mlp.experts.gate_up.lora_B": "replicated",
        },
        producer=ComponentVersion("moe-experts", "0.1.0"),
        lora_config=LoraConfig(enable=True, rank=r, target_modules=("experts",)),
        peft_exports={
            "mlp.experts.gate_up.lora_A": PeftExport(
                "base_model.model.mlp.experts.lora_A.weight", PeftTensorLayout.EXPERT_STACKED_A
            ),
            "mlp.experts.gate_up.lora_B": PeftExport(
                "base_model.model.mlp.experts.lora_B.weight", PeftTensorLayout.EXPERT_STACKED_B
            ),
        },
        peft_target_parameters=["mlp.experts.gate_up_proj"],
    )
    m = lc.save(tmp_path, result, step=1)
    peft_file = load_file(tmp_path / m.name / "adapter_model.safetensors")
    sa = peft_file["base_model.model.mlp.experts.lora_A.weight"]
    sb = peft_file["base_model.model.mlp.experts.lora_B.weight"]
    assert sa.shape == (e * r, h)
    assert sb.shape == (i, e * r)
    # invert the documented layouts and get the native tensors back
    assert torch.equal(sa.reshape(e, r, h), a.detach())
    assert torch.equal(sb.reshape(i, r, e).permute(2, 0, 1), b.detach())
    # PEFT's stacked delta per expert equals ours: B_stack[:, e::E] @ A_stack[e-block]
    for ei in range(e):
        blk = slice(ei * r, (ei + 1) * r)
        torch.testing.assert_close(sb[:, ei::e] @ sa[blk], b[ei].detach() @ a[ei].detach())
    cfg = json.loads((tmp_path / m.name / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj"]
    assert cfg["target_modules"] is None
    loaded = lc.load(tmp_path)
    assert torch.equal(loaded.tensors["mlp.experts.gate_up.lora_A"], a.detach())
    assert torch.equal(loaded.tensors["mlp.experts.gate_up.lora_B"], b.detach())
