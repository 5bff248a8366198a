"""Shared fixtures: fixed seeds and small problem builders for kt-kernel tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import kt_kernel as kk


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    """Every test starts from the same RNG state."""
    random.seed(0)
    torch.manual_seed(0)


@dataclass
class Problem:
    """One expert-op problem: weights, LoRA, inputs and an upstream gradient."""

    spec: kk.ExpertSpec
    weights: kk.ExpertWeights
    lora: kk.LoraBuffers | None
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor


def random_ids(tokens: int, k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct expert ids per token, like a top-k router produces."""
    scores = torch.rand(tokens, num_experts, generator=gen)
    return scores.topk(k, dim=-1).indices


def make_problem(
    *,
    tokens: int = 37,
    hidden: int = 64,
    inter: int = 32,
    experts: int = 8,
    k: int = 3,
    rank: int | None = 4,
    layout: str = "split",
    dtype: torch.dtype = torch.float32,
    lora_dtype: torch.dtype | None = None,
    seed: int = 0,
    ids: torch.Tensor | None = None,
) -> Problem:
    """Build a random problem; base weights ~N(0, 1/fan_in) so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    spec = kk.ExpertSpec(experts, hidden, inter)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.float64)
    down = torch.randn(experts, hidden, inter, generator=gen, dtype=torch.float64)
    weights = kk.ExpertWeights.from_fused(
        spec, gate_up / hidden**0.5, down / inter**0.5, dtype=dtype
    )
    lora = None
    if rank is not None:
        lora = kk.LoraBuffers(spec, rank, 2.0 * rank, layout, dtype=lora_dtype or dtype)
        with torch.no_grad():
            for _, p in lora.named_parameters():
                p.copy_(
                    torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5
                )
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
    if ids is None:
        ids = random_ids(tokens, k, experts, gen)
    w = torch.rand(ids.shape, generator=gen, dtype=torch.float64).to(torch.float32)
    dy = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
    return Problem(spec, weights, lora, x, ids, w, dy)


def forward(
    p: Problem, backend: str, policy: str = "save", x: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's forward on fresh leaves (LoRA gradients cleared): y and the x and w leaves."""
    x = (p.x if x is None else x).detach().clone().requires_grad_(True)
    w = p.w.detach().clone().requires_grad_(True)
    if p.lora is not None:
        for _, t in p.lora.named_parameters():
            t.grad = None
    y = kk.moe_experts_forward(x, p.ids, w, p.weights, p.lora, policy=policy, backend=backend)
    return y, x, w


def backward(
    p: Problem, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Backward of a :func:`forward` against ``p.dy``; returns y and every gradient."""
    y.backward(p.dy)
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    if p.lora is not None:
        for name, t in p.lora.named_parameters():
            out[name] = t.grad.detach().clone()
    return out


def run(
    p: Problem, backend: str, policy: str = "save", x: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Forward + backward; returns y and every gradient (fresh leaves, no state kept)."""
    return backward(p, *forward(p, backend, policy, x))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (0 when both are zero)."""
    a64, b64 = a.double(), b.double()
    scale = b64.abs().max().item()
    diff = (a64 - b64).abs().max().item()
    return diff / scale if scale > 0 else diff


class Helpers:
    """The helpers above, handed to tests as the ``kt`` fixture (tests import nothing local)."""

    Problem = Problem
    make_problem = staticmethod(make_problem)
    forward = staticmethod(forward)
    backward = staticmethod(backward)
    run = staticmethod(run)
    rel_err = staticmethod(rel_err)
    random_ids = staticmethod(random_ids)


@pytest.fixture
def kt() -> type[Helpers]:
    """Problem builders and comparison helpers."""
    return Helpers
