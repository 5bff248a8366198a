"""GPT-OSS: transposed, interleaved experts with biases and a clamped SwiGLU.

The shared suites (test_wrap, test_adapt, test_loading, test_architectures) run the gpt_oss
row like every family; this file proves what only this layout has: the exported adapter is
exactly PEFT's (keys, shapes, values) and PEFT loads it with equal logits, the vLLM export
keeps those 3-D tensors (the layout vLLM's GPT-OSS reads), and the self-check catches a spec
that gets the layout or the biases wrong.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

import lora_checkpoint
from lora_core import LoraConfig
from moe_experts import (
    ARCHITECTURES,
    SelfCheckError,
    WrapError,
    adapt_model,
    check_gradients,
    coverage_report,
    router_targets,
    wrap,
)
from moe_experts.finetune.export import export, vllm_tensors

from .conftest import token_batch

FAMILY = "gpt_oss"


def _base(saved_models) -> tuple[type, Path]:
    return saved_models[FAMILY]


def _load(cls: type, path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(path, dtype=torch.float32).eval()


def _configs(model) -> tuple[LoraConfig, LoraConfig]:
    experts = LoraConfig(enable=True, rank=2, alpha=4, init_seed=3)
    dense = LoraConfig(
        enable=True,
        rank=2,
        alpha=4,
        init_seed=3,
        target_modules=["q_proj", "o_proj"],
        target_parameters=list(router_targets(model)),
    )
    return experts, dense


def _perturb(result) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in result.named_optimizer_parameters:
            if name.endswith(("_b", "lora_B.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.mark.timeout(120)
def test_peft_export_is_peft_layout_and_loads_with_equal_logits(saved_models, tmp_path) -> None:
    cls, path = _base(saved_models)
    model = _load(cls, path)
    assert router_targets(model) == ("mlp.router.weight",)
    experts_cfg, dense_cfg = _configs(model)
    result = adapt_model(model, experts_cfg, dense_config=dense_cfg, weight_dtype="fp32")
    _perturb(result)
    ids = token_batch()
    with torch.no_grad():
        ours = model(ids).logits
    lora_checkpoint.save(tmp_path / "run", result, step=1, base_model_name_or_path=str(path))
    out = tmp_path / "peft"
    export(tmp_path / "run", "peft", out)

    # The keys and shapes PEFT itself creates for the same targets on the same model.
    twin = peft.get_peft_model(
        _load(cls, path),
        peft.LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj", "o_proj"],
            target_parameters=[*result.peft_target_parameters],
        ),
    )
    want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(twin).items()}
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == want
    # gate_up's B rows follow GPT-OSS's interleaved columns, exactly as PEFT's do: [2I, r*E].
    e, i = 4, 24
    b_key = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"
    assert saved[b_key].shape == (2 * i, 2 * e)

    base = _load(cls, path)
    with torch.no_grad():
        plain = base(ids).logits
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    assert sorted(loaded.peft_config["default"].target_parameters) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "mlp.router.weight",
    ]
    with torch.no_grad():
        theirs = loaded(ids).logits
    assert (plain - ours).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # vLLM's GPT-OSS reads expert LoRA in this same 3-D layout (is_3d_moe_weight): the vLLM
    # export keeps PEFT's tensors, gate_up under `.base_layer`, down on the wrapper itself.
    tensors, _, _ = vllm_tensors(loaded, fused_experts=True)
    experts = "base_model.model.model.layers.0.mlp.experts"
    for key in ("base_layer.lora_A", "base_layer.lora_B", "lora_A", "lora_B"):
        torch.testing.assert_close(
            tensors[f"{experts}.{key}.weight"], saved[f"{experts}.{key}.weight"], rtol=0, atol=0
        )


@pytest.mark.timeout(60)
def test_coverage_and_gradient_check(fresh) -> None:
    model = fresh(FAMILY)
    experts_cfg, dense_cfg = _configs(model)
    result = adapt_model(model, experts_cfg, dense_config=dense_cfg, weight_dtype="fp32")
    report = coverage_report(model, result)
    assert len(report.blocks) == 2
    for block in report.blocks:
        assert block.routed_experts == ("down_proj", "gate_up_proj")
        assert block.on_kernel
        assert block.router
    ids = token_batch()
    model(ids, labels=ids).loss.backward()
    assert check_gradients(result) == ()
    # The frozen expert biases are placeholders, never optimizer parameters.
    assert not any("proj_bias" in n for n in result.parameter_names)
    assert any(n.endswith("experts.gate_up_proj_bias") for n in result.placeholders)


def _mis_specified(monkeypatch, **fields) -> None:
    monkeypatch.setitem(ARCHITECTURES, FAMILY, dataclasses.replace(ARCHITECTURES[FAMILY], **fields))


def test_spec_disagreeing_with_the_module_flags_is_refused(fresh, monkeypatch) -> None:
    _mis_specified(monkeypatch, interleaved=False)
    with pytest.raises(WrapError, match="is_concatenated"):
        wrap(fresh(FAMILY), weight_dtype="fp32")


@pytest.mark.parametrize(
    ("fields", "flags"),
    [
        ({"interleaved": False}, {"is_concatenated": True}),  # gate/up de-interleaved wrongly
        ({"gate_up_bias_param": None, "down_bias_param": None}, {"has_bias": False}),
    ],
    ids=["concatenated", "no-biases"],
)
def test_self_check_catches_a_wrong_layout_or_dropped_biases(
    fresh, monkeypatch, fields: dict, flags: dict
) -> None:
    # Spec and module flags agree, but the module still computes GPT-OSS (its eager forward
    # reads no flag; transformers' grouped_mm one would follow has_bias): only the numbers
    # can tell, and they must.
    _mis_specified(monkeypatch, **fields)
    model = fresh(FAMILY)
    model.set_experts_implementation("eager")
    for layer in model.model.layers:
        for name, value in flags.items():
            setattr(layer.mlp.experts, name, value)
    with pytest.raises(SelfCheckError, match=r"model\.layers\.0\.mlp\.experts"):
        wrap(model, weight_dtype="fp32")
