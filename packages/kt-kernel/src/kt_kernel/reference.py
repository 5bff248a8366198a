"""The expert op in plain PyTorch: per-expert loops, autograd does the backward. The oracle."""

from __future__ import annotations

import torch

from kt_kernel.lora import LoraBuffers
from kt_kernel.weights import ExpertWeights

__all__ = ["moe_experts_forward_reference"]


def _lora_term(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return scaling * ((x @ a.t()) @ b.t())


def moe_experts_forward_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    lora: LoraBuffers | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` with gated experts and optional LoRA.

    ``Expert_e(x) = down_e(act(gate_e(x), up_e(x)))`` with ``act = weights.spec.activation``,
    each projection ``W x (+ bias) + s * B (A x)``; weights in any format are dequantised one
    expert at a time (:meth:`ExpertWeights.expert_gate_up`).
    Computes in ``weights.dtype``; LoRA factors and routing weights are cast to it
    (differentiably). Inputs are not validated here; :func:`kt_kernel.moe_experts_forward` does.

    Args:
        x: ``[T, H]``.
        topk_ids: ``[T, k]`` integer expert ids.
        topk_weights: ``[T, k]`` routing weights.
        weights: frozen base weights.
        lora: optional LoRA factors.

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    spec = weights.spec
    dtype = weights.dtype
    inter = spec.intermediate_size
    xc = x.to(dtype)
    wc = topk_weights.to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    act = spec.activation
    gu_bias, dn_bias = weights.gate_up_bias, weights.down_bias
    y = torch.zeros(x.shape[0], spec.hidden_size, dtype=acc, device=x.device)
    if lora is not None:
        s = lora.scaling
        f = {n: t.to(dtype) for n, t in lora.named_lora_parameters()}
    for e in range(spec.num_experts):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        xe = xc[tok]
        # Per expert: for int8 weights this dequantises one expert, never the whole bank.
        gu = xe @ weights.expert_gate_up(e).t()
        if gu_bias is not None:
            gu = gu + gu_bias[e]
        if lora is not None:
            if lora.layout == "fused":
                gu = gu + _lora_term(xe, f["gate_up_lora_a"][e], f["gate_up_lora_b"][e], s)
            else:
                gu = gu + torch.cat(
                    [
                        _lora_term(xe, f["gate_lora_a"][e], f["gate_lora_b"][e], s),
                        _lora_term(xe, f["up_lora_a"][e], f["up_lora_b"][e], s),
                    ],
                    dim=-1,
                )
        h = act(gu[:, :inter], gu[:, inter:])
        o = h @ weights.expert_down(e).t()
        if dn_bias is not None:
            o = o + dn_bias[e]
        if lora is not None:
            o = o + _lora_term(h, f["down_lora_a"][e], f["down_lora_b"][e], s)
        y = y.index_add(0, tok, (o * wc[tok, slot].unsqueeze(-1)).to(acc))
    return y.to(x.dtype)
