"""Architecture registry: every family resolves, unknown models fail with the list."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moe_experts import ARCHITECTURES, UnsupportedModelError, find_architecture, iter_moe_blocks

from .conftest import FAMILIES


def test_registry_covers_the_five_families() -> None:
    assert set(ARCHITECTURES) == {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "olmoe"}
    spec = ARCHITECTURES["mixtral"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.family = "x"  # type: ignore[misc]


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_found_with_router_and_shared_experts(fresh, family: str) -> None:
    model = fresh(family)
    arch = find_architecture(model)
    assert arch.family == family
    sites = list(iter_moe_blocks(model, arch))
    n_layers = model.config.num_hidden_layers
    dense = getattr(model.config, "first_k_dense_replace", 0)
    assert [s.name for s in sites] == [f"model.layers.{i}.mlp" for i in range(dense, n_layers)]
    for site in sites:
        experts = getattr(site.block, arch.experts_attr)
        e = getattr(model.config, arch.num_experts_config)
        i = getattr(model.config, arch.intermediate_config)
        h = model.config.hidden_size
        assert tuple(getattr(experts, arch.gate_up_param).shape) == (e, 2 * i, h)
        assert tuple(getattr(experts, arch.down_param).shape) == (e, h, i)
        assert isinstance(getattr(site.block, arch.router_attr), torch.nn.Module)
        for attr in arch.shared_expert_attrs:
            assert isinstance(getattr(site.block, attr), torch.nn.Module)


def test_unsupported_model_lists_families() -> None:
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError) as info:
        find_architecture(LlamaForCausalLM(cfg))
    msg = str(info.value)
    assert "llama" in msg
    for family in ARCHITECTURES:
        assert family in msg
