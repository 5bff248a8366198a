"""Gemma-4 (experts in the decoder layer, gated tanh-GELU) and DeepSeek-V4 (clamped SwiGLU,
hash-routed layers): where their experts are found and that their activation really matters."""

import copy

import pytest
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

import kt_kernel
from moe_experts import (
    UNSUPPORTED_FAMILIES,
    KernelExperts,
    SelfCheckError,
    UnsupportedModelError,
    WrapError,
    adapt,
    find_architecture,
    iter_moe_blocks,
    router_targets,
    wrap,
)
from moe_experts.self_check import self_check
from moe_experts.testing import tiny_config, tiny_model

from .conftest import token_batch
from .test_adapt import CFG


def _kernel_with(experts: torch.nn.Module, activation) -> KernelExperts:
    """A kernel over ``experts``' own weights computing ``activation`` instead."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    e, two_i, h = gate_up.shape
    spec = kt_kernel.ExpertSpec(
        num_experts=e, hidden_size=h, intermediate_size=two_i // 2, activation=activation
    )
    weights = kt_kernel.ExpertWeights.from_fused(spec, gate_up, down, dtype=torch.float32)
    return KernelExperts(
        weights,
        gate_up_like=gate_up,
        down_like=down,
        gate_up_name="gate_up_proj",
        down_name="down_proj",
        label="x",
    )


def test_gemma4_experts_and_router_sit_in_the_decoder_layer(fresh) -> None:
    model = fresh("gemma4")
    arch = find_architecture(model)
    sites = list(iter_moe_blocks(model, arch))
    assert [s.experts_name for s in sites] == ["model.layers.0.experts", "model.layers.1.experts"]
    # One suffix matches every layer, as PEFT and lora-core match target_parameters.
    assert router_targets(model) == ("router.proj.weight",)
    wrap(model, weight_dtype="fp32")
    result = adapt(model, CFG)
    assert result.peft_target_parameters == ("experts.down_proj", "experts.gate_up_proj")
    for layer in model.model.layers:
        assert layer.experts.spec.activation == kt_kernel.GeluTanhGated()
        # The dense mlp beside the experts stays an ordinary module for lora-core.
        assert isinstance(layer.mlp.gate_proj, torch.nn.Linear)
        assert not isinstance(layer.mlp, KernelExperts)


def test_dense_gemma4_has_no_moe_blocks() -> None:
    model = tiny_model("gemma4", enable_moe_block=False)
    assert list(iter_moe_blocks(model, find_architecture(model))) == []
    with pytest.raises(
        WrapError,
        match=r"no Gemma4TextDecoderLayer blocks with "
        r"enable_moe_block=True",
    ):
        wrap(model)


def test_gemma4_multimodal_model_wraps_its_language_model() -> None:
    torch.manual_seed(0)
    cfg = Gemma4Config(
        text_config=tiny_config("gemma4").to_dict(),
        vision_config=None,
        audio_config=None,
        tie_word_embeddings=False,
    )
    model = Gemma4ForConditionalGeneration(cfg).eval()
    ref = copy.deepcopy(model)
    report = wrap(model, weight_dtype="fp32")
    assert report.wrapped_blocks == (
        "model.language_model.layers.0.experts",
        "model.language_model.layers.1.experts",
    )
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_deepseek_v4_clamp_is_read_and_hash_layers_run(fresh) -> None:
    model = fresh("deepseek_v4")
    layers = model.model.layers
    assert layers[0].mlp.is_hash
    assert not layers[1].mlp.is_hash
    table = layers[0].mlp.gate.tid2eid
    assert (table[:, 0] != table[:, 1]).all()  # distinct experts per token, as shipped
    report = wrap(model, weight_dtype="fp32")
    assert len(report.wrapped_blocks) == 2  # the hash-routed layer too
    for layer in layers:
        assert layer.mlp.experts.spec.activation == kt_kernel.SwiGLULimit(limit=1.0)


@pytest.mark.parametrize(
    ("family", "wrong"),
    [
        ("gemma4", kt_kernel.SwiGLU()),
        ("deepseek_v4", kt_kernel.SwiGLU()),
        ("deepseek_v4", kt_kernel.SwiGLULimit(limit=4.0)),
    ],
    ids=["gemma4_silu", "deepseek_v4_unclamped", "deepseek_v4_other_limit"],
)
def test_wrong_activation_is_refused_on_these_families(fresh, family: str, wrong) -> None:
    # The tiny configs are sized so the activation decides the result: a kernel computing
    # anything else on the same weights fails the wrap self-check.
    model = fresh(family)
    site = next(iter(iter_moe_blocks(model, find_architecture(model))))
    experts = getattr(site.block, site.arch.experts_attr)
    with pytest.raises(SelfCheckError, match="relative"):
        self_check(site.experts_name, experts, _kernel_with(experts, wrong), "fp32")


@pytest.mark.parametrize("model_type", ["llama4", "diffusion_gemma"])
def test_related_families_are_refused_with_the_reason(model_type: str) -> None:
    model = torch.nn.Module()
    model.config = type("Cfg", (), {"model_type": model_type})()
    with pytest.raises(UnsupportedModelError, match=model_type) as info:
        find_architecture(model)
    assert UNSUPPORTED_FAMILIES[model_type] in str(info.value)
    if model_type == "llama4":
        # What rules it out: the routing weight scales the expert's input, after a sigmoid.
        assert "expert(w * x), not w * expert(x)" in str(info.value)
        assert "sigmoid" in str(info.value)
