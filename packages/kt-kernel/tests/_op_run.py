"""A small op problem and one forward + backward of it: shared by the per-format op tests."""

from __future__ import annotations

import torch

import kt_kernel as kk


def op_problem(fmt: str, dtype: torch.dtype, seed: int = 3):
    """Weights, LoRA and inputs of a small op: 80 (token, slot) rows on 4 experts (~20 each).

    H=96 and I=80, so gate_up has N=160 and down N=96 output rows.
    """
    gen = torch.Generator().manual_seed(seed)
    spec = kk.ExpertSpec(4, 96, 80)
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.randn(4, 160, 96, generator=gen) / 96**0.5,
        torch.randn(4, 96, 80, generator=gen) / 80**0.5,
        dtype=dtype,
        weight_dtype=fmt,
    )
    lora = kk.LoraBuffers(spec, 4, 8.0, "fused")
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.normal_(0, 0.2, generator=gen)
    tokens = 40
    x = torch.randn(tokens, 96, generator=gen).to(dtype)
    ids = torch.rand(tokens, 4, generator=gen).topk(2, -1).indices
    tw = torch.rand(tokens, 2, generator=gen)
    dy = torch.randn(tokens, 96, generator=gen).to(dtype)
    return weights, lora, x, ids, tw, dy


def run_op(weights, lora, x, ids, tw, dy, backend: str = "native") -> list[torch.Tensor]:
    """y, dx, d topk_weights and the LoRA gradients of one forward + backward."""
    xg, wg = x.clone().requires_grad_(), tw.clone().requires_grad_()
    for p in lora.parameters():
        p.grad = None
    y = kk.moe_experts_forward(xg, ids, wg, weights, lora, backend=backend)
    y.backward(dy)
    return [t.detach() for t in [y, xg.grad, wg.grad, *[p.grad for p in lora.parameters()]]]
