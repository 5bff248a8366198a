"""Single-process tests of ``lora_core.fsdp``: no process group, input validation, API."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lora_core.fsdp as fsdp
from lora_core import (
    AdaptationResult,
    ComponentVersion,
    LoraConfig,
    ParameterOwnership,
    enable_lora_training,
)
from lora_core.fsdp import (
    DEFAULT_BUCKET_BYTES,
    FsdpLayoutError,
    LoraStateMismatchError,
    SyncStats,
    replicate_lora_parameters,
    sync_replicated_lora_gradients,
)
from lora_core.fsdp_consistency import digest, first_difference


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.o_proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.relu(self.q_proj(x)))


@pytest.fixture
def adapted() -> tuple[nn.Module, AdaptationResult]:
    model = _Two()
    cfg = LoraConfig(enable=True, rank=2, alpha=4, target_modules=["q_proj", "o_proj"])
    result = enable_lora_training(model, cfg)
    model(torch.randn(3, 8)).square().sum().backward()
    return model, result


def test_public_api_is_curated() -> None:
    assert sorted(fsdp.__all__) == sorted(
        [
            "DEFAULT_BUCKET_BYTES",
            "DEFAULT_CHECK_TIMEOUT",
            "FsdpLayoutError",
            "LoraStateMismatchError",
            "SyncStats",
            "replicate_lora_parameters",
            "sync_replicated_lora_gradients",
        ]
    )
    assert all(not name.startswith("_") for name in fsdp.__all__)
    assert DEFAULT_BUCKET_BYTES == 25 * 1024 * 1024
    assert isinstance(fsdp.DEFAULT_CHECK_TIMEOUT, timedelta)


def test_without_process_group_replicate_changes_nothing(adapted) -> None:
    """No process group: 0, and every parameter is the same object with the same value."""
    model, _ = adapted
    assert not dist.is_initialized()
    before = {n: (p, p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    assert replicate_lora_parameters(model) == 0
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    for name, (p, value, req) in before.items():
        assert after[name] is p
        assert torch.equal(p, value)
        assert p.requires_grad == req
        assert type(p) is nn.Parameter


@pytest.mark.parametrize("form", ["module", "result", "pairs"])
def test_without_process_group_sync_returns_zero_and_keeps_grads(adapted, form) -> None:
    model, result = adapted
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    arg = {"module": model, "result": result, "pairs": list(model.named_parameters())}[form]
    stats = SyncStats()
    assert sync_replicated_lora_gradients(arg, stats=stats) == 0
    assert stats == SyncStats()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, grads[n])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bucket_bytes_must_be_positive_int(adapted, bad) -> None:
    model, _ = adapted
    with pytest.raises(FsdpLayoutError, match="bucket_bytes must be a positive int"):
        sync_replicated_lora_gradients(model, bucket_bytes=bad)


def test_rejects_items_that_are_not_name_tensor_pairs() -> None:
    with pytest.raises(FsdpLayoutError, match=r"\(name, tensor\) pairs.*got an item of type"):
        sync_replicated_lora_gradients([torch.zeros(2)])
    with pytest.raises(FsdpLayoutError, match=r"must be an nn\.Module, an AdaptationResult"):
        sync_replicated_lora_gradients(42)  # type: ignore[arg-type]
    with pytest.raises(FsdpLayoutError, match=r"must be an nn\.Module"):
        sync_replicated_lora_gradients("model")  # type: ignore[arg-type]


def test_rejects_duplicate_names() -> None:
    t = torch.zeros(2, requires_grad=True)
    with pytest.raises(FsdpLayoutError, match=r"duplicate names \['a.lora_A'\]"):
        sync_replicated_lora_gradients([("a.lora_A", t), ("a.lora_A", t.clone())])


def test_adaptation_result_selects_only_replicated_ownership() -> None:
    """RANK_LOCAL/SHARDED/RANK0 tensors of a result are never part of the sync."""
    tensors = {k: torch.zeros(2, requires_grad=True) for k in ("r", "l", "s", "z")}
    result = AdaptationResult.create(
        adapted_layers=["x"],
        named_optimizer_parameters=list(tensors.items()),
        ownership={
            "r": ParameterOwnership.REPLICATED,
            "l": ParameterOwnership.RANK_LOCAL,
            "s": ParameterOwnership.SHARDED,
            "z": ParameterOwnership.RANK0,
        },
        producer=ComponentVersion("moe-experts", "0.1.0"),
    )
    assert [n for n, _ in fsdp._named_inputs(result)] == ["r"]


def test_walk_order_is_sorted_by_name_regardless_of_input_order() -> None:
    ts = [(n, torch.zeros(1)) for n in ("b.lora_B", "a.lora_A", "c.lora_A", "a.lora_B")]
    assert [n for n, _ in fsdp._named_inputs(ts)] == sorted(n for n, _ in ts)
    assert [n for n, _ in fsdp._named_inputs(reversed(ts))] == sorted(n for n, _ in ts)


def test_first_difference_names_the_odd_rank_and_parameter() -> None:
    a = ["x.lora_A|[2, 8]|float32|Tensor", "x.lora_B|[8, 2]|float32|Tensor"]
    extra = [*a, "y.lora_A|[2, 8]|float32|Tensor"]
    rank, name, why = first_difference([a, a, extra], [[], [], []])
    assert (rank, name) == (2, "y.lora_A")
    assert "rank 2 has parameter 'y.lora_A' that rank 0 does not have" in why
    rank, name, why = first_difference([a[:1], a, a], [[], [], []])
    assert (rank, name) == (0, "x.lora_B")
    assert "rank 0 lacks parameter 'x.lora_B'" in why
    shape = ["x.lora_A|[2, 8]|float32|Tensor", "x.lora_B|[8, 3]|float32|Tensor"]
    rank, name, why = first_difference([a, shape, a], [[], [], []])
    assert (rank, name) == (1, "x.lora_B")
    assert "[8, 3]" in why
    assert "[8, 2]" in why
    rank, name, why = first_difference([a, a], [[], [("x.lora_A", "on meta")]])
    assert (rank, name, why) == (1, "x.lora_A", "rank 1: on meta")


def test_digest_is_order_sensitive_and_stable() -> None:
    assert digest(["a", "b"]) == digest(["a", "b"])
    assert digest(["a", "b"]) != digest(["b", "a"])
    assert digest(["ab"]) != digest(["a", "b"])  # items are separated, not concatenated
    assert -(2**63) <= digest(["x"]) < 2**63


def test_mismatch_error_carries_rank_and_parameter() -> None:
    err = LoraStateMismatchError("boom", rank=3, parameter="p.lora_A")
    assert isinstance(err, RuntimeError)
    assert (err.rank, err.parameter, str(err)) == (3, "p.lora_A", "boom")
    assert issubclass(FsdpLayoutError, ValueError)
