"""Architecture registry: every family resolves, unknown and refused models fail by name."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moe_experts import (
    ARCHITECTURES,
    UNSUPPORTED_FAMILIES,
    UnsupportedModelError,
    find_architecture,
    iter_moe_blocks,
)
from moe_experts.testing import TINY_CONFIGS

from .conftest import FAMILIES


def test_registry_rows_have_tiny_configs_and_are_frozen() -> None:
    # The list of families users fine-tune; every row has a tiny config, so the
    # parametrised suites (test_wrap, test_adapt) run it.
    required = {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "olmoe", "qwen3_5_moe",
                "qwen3_next", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "deepseek_v2",
                "ernie4_5_moe", "minimax", "hunyuan_v1_moe", "dots1", "phimoe", "granitemoe"}
    assert required <= set(ARCHITECTURES)
    assert set(TINY_CONFIGS) == set(ARCHITECTURES) == set(FAMILIES)
    assert not set(ARCHITECTURES) & set(UNSUPPORTED_FAMILIES)
    spec = ARCHITECTURES["mixtral"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.family = "x"  # type: ignore[misc]


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_found_with_router_and_shared_experts(fresh, family: str) -> None:
    model = fresh(family)
    arch = find_architecture(model)
    assert arch.family == family
    sites = list(iter_moe_blocks(model, arch))
    assert sites
    named = dict(model.named_parameters())
    for site in sites:
        experts = getattr(site.block, arch.experts_attr)
        gate_up = getattr(experts, arch.gate_up_param)
        e, i, h = arch.expert_dims(gate_up)
        assert h == model.config.get_text_config().hidden_size
        # Every stored expert tensor (weights and any biases) has the spec's layout, and
        # transformers' own layout flags agree with the spec's fields.
        for name, shape in arch.stored_shapes(e, i, h).items():
            assert tuple(getattr(experts, name).shape) == shape, name
        assert getattr(experts, "is_transposed", False) == arch.transposed
        assert getattr(experts, "is_concatenated", True) == (not arch.interleaved)
        assert getattr(experts, "has_bias", False) == bool(arch.bias_params)
        router = site.block.get_submodule(arch.router_attr).get_parameter(arch.router_param)
        # The router's [E, H] weight is where router LoRA goes (router_targets).
        assert tuple(router.shape) == (e, h)
        assert named[f"{site.name}.{arch.router_attr}.{arch.router_param}"] is router
        for attr in arch.shared_expert_attrs:
            assert isinstance(getattr(site.block, attr), torch.nn.Module)
        if arch.shared_expert_gate_attr:
            assert isinstance(getattr(site.block, arch.shared_expert_gate_attr), torch.nn.Linear)


def test_unsupported_model_lists_families() -> None:
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError) as info:
        find_architecture(LlamaForCausalLM(cfg))
    msg = str(info.value)
    assert "llama" in msg
    for family in ARCHITECTURES:
        assert family in msg


@pytest.mark.parametrize("model_type", ["llama4", "aria", "longcat_flash"])
def test_refused_families_say_why(model_type: str) -> None:
    model = torch.nn.Module()
    model.config = type("Cfg", (), {"model_type": model_type})()
    with pytest.raises(UnsupportedModelError, match=model_type) as info:
        find_architecture(model)
    assert UNSUPPORTED_FAMILIES[model_type] in str(info.value)
