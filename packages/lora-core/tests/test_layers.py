"""LoRALinear: forward against a reference, merge/unmerge, frozen base, PEFT parity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lora_core import LoRALinear, init_lora_tensor

DTYPES = [torch.float32, torch.bfloat16]
# bf16 has an 8-bit mantissa: one rounding of O(1) values is ~4e-3 relative.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


def _layer(
    dtype: torch.dtype, bias: bool, *, rank: int = 4, alpha: float = 8.0, dropout: float = 0.0
) -> LoRALinear:
    base = nn.Linear(12, 10, bias=bias, dtype=dtype)
    layer = LoRALinear(base, rank, alpha, dropout, fqn="blk.q_proj", init_seed=3)
    with torch.no_grad():  # a non-zero B so the update is visible
        layer.lora_B.weight.copy_(torch.randn(10, rank, dtype=dtype) * 0.5)
    return layer


def _reference(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    w = layer.base_layer.weight.double()
    a = layer.lora_A.weight.double()
    b = layer.lora_B.weight.double()
    y = x.double() @ w.T + (layer.alpha / layer.rank) * (x.double() @ a.T @ b.T)
    if layer.base_layer.bias is not None:
        y = y + layer.base_layer.bias.double()
    return y


def test_layout_and_state_dict_keys() -> None:
    layer = _layer(torch.float32, True)
    assert isinstance(layer.base_layer, nn.Linear)
    assert isinstance(layer.lora_A, nn.Linear)
    assert isinstance(layer.lora_B, nn.Linear)
    assert layer.lora_A.bias is None
    assert layer.lora_B.bias is None
    assert layer.rank == 4
    assert layer.alpha == 8.0
    assert layer.scaling == 2.0
    assert layer.merged is False
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "base_layer.weight": (10, 12),
        "base_layer.bias": (10,),
        "lora_A.weight": (4, 12),
        "lora_B.weight": (10, 4),
    }


def test_init_values_come_from_init_lora_tensor() -> None:
    layer = LoRALinear(nn.Linear(12, 10), 4, 4, fqn="m.layers.0.q_proj", init_seed=9)
    assert torch.equal(
        layer.lora_A.weight,
        init_lora_tensor("m.layers.0.q_proj.lora_A", (4, 12), torch.float32, seed=9),
    )
    assert torch.equal(layer.lora_B.weight, torch.zeros(10, 4))
    x = torch.randn(3, 12)
    assert torch.equal(layer(x), layer.base_layer(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(5,), (2, 3), (2, 1, 3)])
def test_forward_matches_reference(dtype: torch.dtype, bias: bool, lead: tuple[int, ...]) -> None:
    layer = _layer(dtype, bias)
    x = torch.randn(*lead, 12, dtype=dtype)
    y = layer(x)
    assert y.shape == (*lead, 10)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), _reference(layer, x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_merge_unmerge(dtype: torch.dtype, bias: bool) -> None:
    layer = _layer(dtype, bias)
    x = torch.randn(2, 3, 12, dtype=dtype)
    w0 = layer.base_layer.weight.detach().clone()
    before = layer(x)
    expected_w = (w0.float() + layer.delta_weight()).to(dtype)
    layer.merge()
    assert layer.merged
    assert torch.equal(layer.base_layer.weight, expected_w)
    merged_out = layer(x)
    # The delta must be applied once: the merged output equals the unmerged output.
    torch.testing.assert_close(merged_out, before, **TOL[dtype])
    layer.merge()  # idempotent
    assert torch.equal(layer.base_layer.weight, expected_w)
    layer.unmerge()
    assert not layer.merged
    if dtype == torch.float32:
        torch.testing.assert_close(layer.base_layer.weight, w0, atol=1e-6, rtol=0)
    else:
        # One bf16 rounding each way (half an ulp, <= |v| * 2**-8 each), with a 2x margin.
        bound = (expected_w.float().abs() + w0.float().abs()) * 2.0**-7
        err = (layer.base_layer.weight.float() - w0.float()).abs()
        assert (err <= bound).all()
        assert err.max().item() > 0  # bf16 really rounds: the tolerance is not vacuous
    layer.unmerge()  # idempotent
    torch.testing.assert_close(layer(x), before, **TOL[dtype])


def test_base_frozen_grads_only_on_a_b_and_base_bitwise_unchanged() -> None:
    layer = _layer(torch.float32, True)
    w0 = layer.base_layer.weight.detach().clone()
    b0 = layer.base_layer.bias.detach().clone()
    a0 = layer.lora_A.weight.detach().clone()
    assert not layer.base_layer.weight.requires_grad
    assert not layer.base_layer.bias.requires_grad
    opt = torch.optim.AdamW(
        [p for p in layer.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    for _ in range(3):
        opt.zero_grad()
        loss = layer(torch.randn(8, 12)).pow(2).mean()
        loss.backward()
        assert layer.base_layer.weight.grad is None
        assert layer.base_layer.bias.grad is None
        assert layer.lora_A.weight.grad is not None
        assert layer.lora_B.weight.grad is not None
        opt.step()
    assert torch.equal(layer.base_layer.weight, w0)
    assert torch.equal(layer.base_layer.bias, b0)
    assert not torch.equal(layer.lora_A.weight, a0)


def test_dropout_only_on_lora_branch() -> None:
    layer = _layer(torch.float32, True, dropout=0.5)
    x = torch.randn(64, 12)
    layer.eval()
    torch.testing.assert_close(layer(x).double(), _reference(layer, x), atol=1e-5, rtol=1e-5)
    layer.train()
    torch.manual_seed(0)
    got = layer(x)
    torch.manual_seed(0)
    mask = nn.functional.dropout(torch.ones_like(x), 0.5, training=True)
    want = layer.base_layer(x) + layer.scaling * layer.lora_B(layer.lora_A(x * mask))
    torch.testing.assert_close(got, want)


def test_meta_construction_then_reset() -> None:
    layer = LoRALinear(nn.Linear(6, 5), 2, 2, fqn="q", init_seed=1, device="meta")
    assert layer.lora_A.weight.is_meta
    with pytest.raises(RuntimeError, match=r"meta device.*to_empty"):
        layer.reset_lora_parameters()
    layer.lora_A.to_empty(device="cpu")
    layer.lora_B.to_empty(device="cpu")
    assert layer.reset_lora_parameters() == 2
    eager = LoRALinear(nn.Linear(6, 5), 2, 2, fqn="q", init_seed=1)
    assert torch.equal(layer.lora_A.weight, eager.lora_A.weight)
    assert torch.equal(layer.lora_B.weight, eager.lora_B.weight)


def test_does_not_consume_global_rng() -> None:
    torch.manual_seed(0)
    LoRALinear(nn.Linear(6, 5), 2, 2)
    after = torch.rand(3)
    torch.manual_seed(0)
    nn.Linear(6, 5)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0}, r"rank must be a positive int, got 0"),
        ({"rank": True}, r"rank must be a positive int"),
        ({"alpha": 0.0}, r"alpha must be a positive number, got 0\.0"),
        ({"alpha": float("nan")}, r"alpha must be a positive number"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1\.0"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"rank": 2, "alpha": 2.0, "dropout": 0.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        LoRALinear(nn.Linear(3, 3), args["rank"], args["alpha"], args["dropout"])


def test_base_must_be_linear() -> None:
    with pytest.raises(TypeError, match=r"must be an nn\.Linear, got Conv1d"):
        LoRALinear(nn.Conv1d(3, 3, 1), 2, 2)  # type: ignore[arg-type]


class _Tiny(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(12, 10, bias=bias)
        self.other = nn.Linear(10, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.q_proj(x))


@pytest.mark.parametrize("bias", [True, False])
def test_matches_peft_on_same_weights(bias: bool) -> None:
    peft = pytest.importorskip("peft")
    rank, alpha = 4, 12
    ours_model = _Tiny(bias)
    ref = _Tiny(bias)
    ref.load_state_dict(ours_model.state_dict())
    ours_model.q_proj = LoRALinear(ours_model.q_proj, rank, alpha, fqn="q_proj", init_seed=2)
    with torch.no_grad():
        ours_model.q_proj.lora_B.weight.copy_(torch.randn(10, rank))
    peft_model = peft.get_peft_model(
        ref, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj"])
    )
    lora_layer = peft_model.base_model.model.q_proj
    with torch.no_grad():
        lora_layer.lora_A["default"].weight.copy_(ours_model.q_proj.lora_A.weight)
        lora_layer.lora_B["default"].weight.copy_(ours_model.q_proj.lora_B.weight)
    assert lora_layer.scaling["default"] == ours_model.q_proj.scaling
    x = torch.randn(2, 5, 12)
    torch.testing.assert_close(ours_model(x), peft_model(x), atol=1e-6, rtol=1e-6)
    # Same state-dict suffixes as PEFT's adapter file.
    peft_keys = set(peft.get_peft_model_state_dict(peft_model))
    assert peft_keys == {
        "base_model.model.q_proj.lora_A.weight",
        "base_model.model.q_proj.lora_B.weight",
    }
    ours_keys = {f"base_model.model.{k}" for k in ours_model.state_dict() if "lora_" in k}
    assert ours_keys == peft_keys
