"""Placeholders keep names and shapes and hold no storage."""

import copy
import gc

import psutil
import pytest
import torch
from torch import nn

from moe_experts import ExpertPlaceholder, PlaceholderAccessError, is_placeholder, make_placeholder


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_placeholder_allocates_nothing() -> None:
    before = _rss()
    # Eight 64 x 4096 x 4096 fp32 tensors would be 32 GiB if they held storage.
    holders = [
        nn.Parameter(
            ExpertPlaceholder((64, 4096, 4096), torch.float32, "cpu", f"p{i}"), requires_grad=False
        )
        for i in range(8)
    ]
    assert _rss() - before < 16 * 2**20
    assert all(tuple(p.shape) == (64, 4096, 4096) and p.device.type == "cpu" for p in holders)
    with pytest.raises(RuntimeError):
        holders[0].untyped_storage().data_ptr()


def test_placeholder_survives_module_api() -> None:
    m = nn.Module()
    m.w = make_placeholder(torch.empty(4, 6, 2), "m.w")
    assert [n for n, _ in m.named_parameters()] == ["w"]
    sd = m.state_dict()
    assert list(sd) == ["w"]
    assert is_placeholder(sd["w"])
    assert tuple(sd["w"].shape) == (4, 6, 2)
    m.to(torch.bfloat16)
    assert is_placeholder(m.w)
    assert m.w.dtype == torch.bfloat16
    assert isinstance(m.w, nn.Parameter)
    assert not m.w.requires_grad
    assert m.w.numel() == 48
    twin = copy.deepcopy(m)
    assert is_placeholder(twin.w)
    assert twin.w is not m.w
    assert tuple(twin.w.shape) == (4, 6, 2)


def test_reading_values_raises_clear_error() -> None:
    ph = make_placeholder(torch.empty(2, 3), "model.layers.0.mlp.experts.down_proj")
    with pytest.raises(PlaceholderAccessError, match=r"model\.layers\.0\.mlp\.experts\.down_proj"):
        ph + 1
    with pytest.raises(PlaceholderAccessError, match="kt-kernel"):
        ph.sum()
