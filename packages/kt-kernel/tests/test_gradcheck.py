"""torch.autograd.gradcheck in float64 through both implementations."""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("layout", ["split", "fused"])
@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_gradcheck(backend: str, layout: str, policy: str) -> None:
    if backend == "reference" and policy == "recompute":
        pytest.skip("the reference has no activation policy")
    e, h, i, r, t, k = 3, 5, 4, 2, 6, 2
    spec = kk.ExpertSpec(e, h, i)
    gen = torch.Generator().manual_seed(1)
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.randn(e, 2 * i, h, generator=gen, dtype=torch.float64),
        torch.randn(e, h, i, generator=gen, dtype=torch.float64),
    )
    lora = kk.LoraBuffers(spec, r, 3.0, layout, dtype=torch.float64)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [1, 2]])
    w = torch.rand(t, k, generator=gen, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in lora.named_parameters()]

    def fn(x_: torch.Tensor, w_: torch.Tensor, *factors: torch.Tensor) -> torch.Tensor:
        buf = kk.LoraBuffers.from_tensors(
            spec, r, 3.0, layout, dict(zip(names, factors, strict=False))
        )
        return kk.moe_experts_forward(x_, ids, w_, weights, buf, policy=policy, backend=backend)

    factors = [p.detach().clone().requires_grad_(True) for _, p in lora.named_parameters()]
    assert torch.autograd.gradcheck(fn, (x, w, *factors), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "act",
    [kk.ClampedSwiGLU(alpha=1.702, limit=0.9), kk.SwiGLULimit(limit=0.9), kk.GeluTanhGated()],
    ids=["clamped_swiglu", "swiglu_limit", "gelu_tanh_gated"],
)
def test_gradcheck_activations_with_biases(act: kk.Activation) -> None:
    # Native float64 against finite differences: x, topk_weights and every LoRA factor, with
    # both biases; the seed puts no pre-activation within eps of a clamp edge.
    e, h, i, r, t = 3, 5, 4, 2, 6
    spec = kk.ExpertSpec(e, h, i, activation=act)
    gen = torch.Generator().manual_seed(2)
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.randn(e, 2 * i, h, generator=gen, dtype=torch.float64),
        torch.randn(e, h, i, generator=gen, dtype=torch.float64),
        gate_up_bias=torch.randn(e, 2 * i, generator=gen, dtype=torch.float64),
        down_bias=torch.randn(e, h, generator=gen, dtype=torch.float64),
    )
    lora = kk.LoraBuffers(spec, r, 3.0, "fused", dtype=torch.float64)
    names = [n for n, _ in lora.named_parameters()]
    factors = [
        torch.randn(p.shape, generator=gen, dtype=torch.float64).requires_grad_(True)
        for _, p in lora.named_parameters()
    ]
    x = torch.randn(t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [1, 2]])
    w = torch.rand(t, 2, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(x_: torch.Tensor, w_: torch.Tensor, *fs: torch.Tensor) -> torch.Tensor:
        buf = kk.LoraBuffers.from_tensors(spec, r, 3.0, "fused", dict(zip(names, fs, strict=True)))
        return kk.moe_experts_forward(x_, ids, w_, weights, buf, backend="native")

    assert torch.autograd.gradcheck(fn, (x, w, *factors), eps=1e-6, atol=1e-6, rtol=1e-5)
