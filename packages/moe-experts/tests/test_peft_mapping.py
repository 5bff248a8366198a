"""The PEFT mapping, checked against real transformers 5.x Qwen3-MoE experts under PEFT.

PEFT ``target_parameters=["gate_up_proj", "down_proj"]`` (``ParamWrapper``) on the fused
``Qwen3MoeExperts`` gives, per parameter, ``lora_A [E*r, in]`` and ``lora_B [out, E*r]``. The
kernel must produce the same outputs and gradients from the converted tensors, and the
conversion must round-trip bitwise in both directions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kt_kernel as kk
from moe_experts import AdaptError
from moe_experts import peft_mapping as pm

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft.tuners.lora.layer import ParamWrapper  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    Qwen3MoeMLP,
    Qwen3MoeSparseMoeBlock,
)

E, H, I, K, R, ALPHA = 6, 16, 12, 2, 3, 6.0  # noqa: E741 - E, H, I as in the shapes [E, 2I, H]


def _config(impl: str) -> Qwen3MoeConfig:
    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_act="silu",
        norm_topk_prob=True,
    )
    cfg._experts_implementation = impl
    return cfg


class _Holder(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.mlp = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _peft_fused(impl: str = "eager"):
    block = Qwen3MoeSparseMoeBlock(_config(impl))
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 0.3)
        block.experts.down_proj.normal_(0, 0.3)
        block.gate.weight.normal_(0, 1.0)
    cfg = peft.LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    experts = block.experts  # PEFT replaces block.experts with its wrappers
    model = peft.get_peft_model(_Holder(block), cfg)
    block.base_experts = experts
    wrappers = {m.parameter_name: m for m in model.modules() if isinstance(m, ParamWrapper)}
    assert set(wrappers) == {"gate_up_proj", "down_proj"}
    return model, block, wrappers


def _peft_tensors(wrappers) -> dict[str, torch.Tensor]:
    return {
        f"{name}.lora_{m}.weight": getattr(w, f"lora_{m}")["default"].weight
        for name, w in wrappers.items()
        for m in ("A", "B")
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_fused_peft_adapter_matches_kernel(impl: str) -> None:
    model, block, wrappers = _peft_fused(impl)
    x = torch.randn(2, 7, H, requires_grad=True)
    y_peft = model(x)
    dy = torch.randn_like(y_peft)
    y_peft.backward(dy)

    spec = kk.ExpertSpec(E, H, I)
    weights = kk.ExpertWeights.from_fused(
        spec, block.base_experts.gate_up_proj, block.base_experts.down_proj
    )
    lora = pm.lora_from_peft(
        spec,
        {k: v.detach() for k, v in _peft_tensors(wrappers).items()},
        rank=R,
        alpha=ALPHA,
        layout="fused",
    )
    xk = x.detach().reshape(-1, H).requires_grad_(True)
    with torch.no_grad():
        _, w, ids = block.gate(xk)
    y = kk.moe_experts_forward(xk, ids, w, weights, lora, backend="native")
    y.backward(dy.reshape(-1, H))
    torch.testing.assert_close(y.reshape_as(y_peft), y_peft.detach(), rtol=1e-5, atol=1e-5)
    # dx through the experts only (the router's own path is excluded by no_grad above), so
    # compare LoRA gradients: ours, stacked the PEFT way, must equal PEFT's.
    grads = pm.lora_to_peft(
        kk.LoraBuffers.from_tensors(
            spec, R, ALPHA, "fused", {n: nn.Parameter(t.grad) for n, t in lora.named_parameters()}
        )
    )
    for key, p in _peft_tensors(wrappers).items():
        torch.testing.assert_close(grads[key], p.grad, rtol=1e-5, atol=1e-6, msg=key)


def test_kernel_adapter_exports_into_peft() -> None:
    model, block, wrappers = _peft_fused()
    spec = kk.ExpertSpec(E, H, I)
    ours = kk.LoraBuffers(spec, R, ALPHA, "fused", init=lambda n, t: t.normal_(0, 0.5))
    exported = pm.lora_to_peft(ours)
    with torch.no_grad():
        for key, p in _peft_tensors(wrappers).items():
            assert exported[key].shape == p.shape, key
            p.copy_(exported[key])
    x = torch.randn(9, H)
    with torch.no_grad():
        y_peft = model(x[None])[0]
        _, w, ids = block.gate(x)
        weights = kk.ExpertWeights.from_fused(
            spec, block.base_experts.gate_up_proj, block.base_experts.down_proj
        )
        y = kk.moe_experts_forward(x, ids, w, weights, ours, backend="native")
    torch.testing.assert_close(y, y_peft, rtol=1e-5, atol=1e-5)


def test_lora_b_is_rank_major_in_peft() -> None:
    # Pins the exact stacking: PEFT column j*E + e of lora_B is B[e, :, j].
    b = torch.arange(E * 4 * R, dtype=torch.float32).reshape(E, 4, R)
    stacked = pm.stack_lora_b(b)
    for e in range(E):
        for j in range(R):
            assert torch.equal(stacked[:, j * E + e], b[e, :, j])
    a = torch.arange(E * R * 5, dtype=torch.float32).reshape(E, R, 5)
    assert torch.equal(pm.stack_lora_a(a)[2 * R + 1], a[2, 1])


@pytest.mark.parametrize("layout", ["fused", "split"])
def test_round_trip_bitwise(layout: str) -> None:
    spec = kk.ExpertSpec(E, H, I)
    ours = kk.LoraBuffers(spec, R, ALPHA, layout, init=lambda n, t: t.normal_())
    tensors = pm.lora_to_peft(ours)
    assert tuple(tensors) == pm.peft_keys(spec, layout)
    back = pm.lora_from_peft(spec, tensors, rank=R, alpha=ALPHA, layout=layout)
    for (n, a), (_, b) in zip(ours.named_parameters(), back.named_parameters(), strict=False):
        assert torch.equal(a, b), n
    again = pm.lora_to_peft(back)
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)
    if layout == "fused":
        _, _, wrappers = _peft_fused()
        real = {k: v.detach().clone() for k, v in _peft_tensors(wrappers).items()}
        rt = pm.lora_to_peft(pm.lora_from_peft(spec, real, rank=R, alpha=ALPHA, layout="fused"))
        assert all(torch.equal(real[k], rt[k]) for k in real)


def test_bad_peft_keys_are_named() -> None:
    spec = kk.ExpertSpec(E, H, I)
    tensors = pm.lora_to_peft(kk.LoraBuffers(spec, R, ALPHA, "fused"))
    tensors.pop("down_proj.lora_B.weight")
    tensors["down_proj.lora_C.weight"] = torch.zeros(1)
    with pytest.raises(
        AdaptError,
        match=r"missing \['down_proj.lora_B.weight'\], "
        r"unexpected \['down_proj.lora_C.weight'\]",
    ):
        pm.lora_from_peft(spec, tensors, rank=R, alpha=ALPHA, layout="fused")


class _SplitExperts(nn.Module):
    """Per-expert nn.Linear experts (the layout PEFT target_modules adapts)."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Qwen3MoeMLP(cfg, intermediate_size=I) for _ in range(E))

    def forward(self, x, ids, w):
        y = torch.zeros_like(x)
        for e, mlp in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                y = y.index_add(0, tok, mlp(x[tok]) * w[tok, slot, None])
        return y


@pytest.mark.timeout(60)
def test_split_peft_adapter_matches_kernel() -> None:
    module = _SplitExperts(_config("eager"))
    cfg = peft.LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        init_lora_weights=False,
        target_modules=["gate_proj", "up_proj", "down_proj"],
    )
    model = peft.get_peft_model(module, cfg)
    x = torch.randn(11, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(11)])
    w = torch.rand(11, K)
    y_peft = model(x, ids, w)
    y_peft.sum().backward()
    spec = kk.ExpertSpec(E, H, I)
    mlps = module.experts
    weights = kk.ExpertWeights.from_split(
        spec,
        torch.stack([m.gate_proj.base_layer.weight for m in mlps]),
        torch.stack([m.up_proj.base_layer.weight for m in mlps]),
        torch.stack([m.down_proj.base_layer.weight for m in mlps]),
    )
    tensors = {
        f"{e}.{p}.lora_{ab}.weight": getattr(getattr(mlps[e], p), f"lora_{ab}")[
            "default"
        ].weight.detach()
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
        for ab in "AB"
    }
    lora = pm.lora_from_peft(spec, tensors, rank=R, alpha=ALPHA, layout="split")
    y = kk.moe_experts_forward(x, ids, w, weights, lora, backend="native")
    y.sum().backward()
    torch.testing.assert_close(y, y_peft.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        lora.gate_lora_b.grad[4],
        mlps[4].gate_proj.lora_B["default"].weight.grad,
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(
        lora.down_lora_a.grad[1],
        mlps[1].down_proj.lora_A["default"].weight.grad,
        rtol=1e-5,
        atol=1e-6,
    )
