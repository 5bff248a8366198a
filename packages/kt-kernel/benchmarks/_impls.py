"""The implementations the benchmark compares, all built on the same weights and adapter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import kt_kernel as kk
from lora_core.contracts import PeftTensorLayout, peft_lora_key  # the PEFT layout contract

_A, _B = PeftTensorLayout.EXPERT_STACKED_A, PeftTensorLayout.EXPERT_STACKED_B
# transformers' fused expert parameters -> the kernel's LoRA buffer prefixes.
_PROJ = (("gate_up_proj", "gate_up"), ("down_proj", "down"))


def _to_peft(lora: kk.LoraBuffers) -> dict[str, torch.Tensor]:
    """The fused buffers as PEFT ``target_parameters`` tensors, keyed like PEFT's."""
    out = {}
    for proj, ours in _PROJ:
        a, b = getattr(lora, f"{ours}_lora_a").detach(), getattr(lora, f"{ours}_lora_b").detach()
        out[peft_lora_key(proj, "A")] = _A.to_peft(a).contiguous()
        out[peft_lora_key(proj, "B")] = _B.to_peft(b).contiguous()
    return out


def _unstack(tensors: dict[str, torch.Tensor], proj: str, e: int) -> tuple[torch.Tensor, ...]:
    """``(A [E, r, in], B [E, out, r])`` of ``proj`` from PEFT's tensors."""
    return (
        _A.from_peft(tensors[peft_lora_key(proj, "A")], e),
        _B.from_peft(tensors[peft_lora_key(proj, "B")], e),
    )


@dataclass(frozen=True)
class Shape:
    """One benchmark problem size."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    rank: int


SHAPES = {
    "small": Shape("small", 1024, 512, 32, 4, 16),
    "medium": Shape("medium", 2048, 768, 64, 8, 16),
}

# Materialising per-token expert weights (batched_mm) beyond this is not attempted.
BATCHED_MM_LIMIT_BYTES = 2 << 30


def flops(shape: Shape, tokens: int, backward: bool) -> float:
    """Useful FLOPs of the op (the same count for every implementation).

    Forward: ``2*N*3*H*I`` for gate, up and down (N = T*k routed rows) plus LoRA
    ``2*N*r*3*(H+I)``. Backward through frozen base weights is the input gradient only
    (``2*N*3*H*I`` again) plus twice the LoRA forward (input and factor gradients).
    """
    n = tokens * shape.top_k
    base = 2.0 * n * 3 * shape.hidden * shape.inter
    lora = 2.0 * n * shape.rank * 3 * (shape.hidden + shape.inter)
    return (2 * base + 3 * lora) if backward else (base + lora)


@dataclass
class Problem:
    """Weights, routing and the shared PEFT adapter tensors for one configuration."""

    shape: Shape
    tokens: int
    dtype: torch.dtype
    gate_up: torch.Tensor
    down: torch.Tensor
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    fused_lora: dict[str, torch.Tensor]


def make_problem(shape: Shape, tokens: int, dtype: torch.dtype, seed: int = 0) -> Problem:
    """Random weights ~N(0, 1/fan_in), a softmax top-k routing, a random fused adapter."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i, k, r = shape.experts, shape.hidden, shape.inter, shape.top_k, shape.rank
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    probs = torch.randn(tokens, e, generator=gen).softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    dy = torch.randn(tokens, h, generator=gen).to(dtype)
    lora = kk.LoraBuffers(kk.ExpertSpec(e, h, i), r, 2.0 * r, "fused", dtype=dtype)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return Problem(shape, tokens, dtype, gate_up, down, x, ids, w, dy, _to_peft(lora))


@dataclass
class Runner:
    """An implementation bound to a problem: ``forward(x, w) -> y`` and a timed ``step``."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    problem: Problem

    def step(self, backward: bool) -> None:
        """One forward (no grad) or forward+backward with x and routing weights trainable."""
        p = self.problem
        if backward:
            x = p.x.detach().requires_grad_(True)
            w = p.w.detach().requires_grad_(True)
            self.forward(x, w).backward(p.dy)
        else:
            with torch.no_grad():
                self.forward(p.x, p.w)


def _step(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], p: Problem) -> Runner:
    return Runner(forward, p)


def kt_native(p: Problem, policy: str = "save", backend: str = "native") -> Runner:
    """kt_kernel.moe_experts_forward with the fused adapter of the PEFT baselines."""
    s = p.shape
    spec = kk.ExpertSpec(s.experts, s.hidden, s.inter)
    weights = kk.ExpertWeights.from_fused(spec, p.gate_up, p.down)
    tensors = {}
    for proj, ours in _PROJ:
        a, b = _unstack(p.fused_lora, proj, s.experts)
        # Own trainable copies, as PEFT's adapter would be: the op computes their gradients.
        tensors[f"{ours}_lora_a"] = nn.Parameter(a.contiguous().clone())
        tensors[f"{ours}_lora_b"] = nn.Parameter(b.contiguous().clone())
    lora = kk.LoraBuffers.from_tensors(spec, s.rank, 2.0 * s.rank, "fused", tensors)
    return _step(
        lambda x, w: kk.moe_experts_forward(
            x, p.ids, w, weights, lora, policy=policy, backend=backend
        ),
        p,
    )


def _qwen3_config(p: Problem, impl: str):
    from transformers import Qwen3MoeConfig

    s = p.shape
    cfg = Qwen3MoeConfig(
        hidden_size=s.hidden,
        moe_intermediate_size=s.inter,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        hidden_act="silu",
    )
    cfg._experts_implementation = impl
    return cfg


class _Holder(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, ids, w)


def hf_fused_peft(p: Problem, impl: str) -> Runner:
    """transformers Qwen3MoeExperts (``experts_implementation=impl``) + PEFT target_parameters."""
    import peft
    from peft.tuners.lora.layer import ParamWrapper
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    s = p.shape
    if impl == "batched_mm":
        need = p.tokens * s.top_k * 2 * s.inter * s.hidden * p.gate_up.element_size()
        if need > BATCHED_MM_LIMIT_BYTES:
            raise MemoryError(
                f"batched_mm materialises per-token expert weights: {need / 2**30:.1f} GiB"
            )
    experts = Qwen3MoeExperts(_qwen3_config(p, impl)).to(p.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(p.gate_up)
        experts.down_proj.copy_(p.down)
    cfg = peft.LoraConfig(
        r=s.rank,
        lora_alpha=2 * s.rank,
        target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(_Holder(experts), cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ParamWrapper):
                for ab in "AB":
                    getattr(m, f"lora_{ab}")["default"].weight.copy_(
                        p.fused_lora[f"{m.parameter_name}.lora_{ab}.weight"]
                    )
    return _step(lambda x, w: model(x, p.ids, w), p)


class _LinearExperts(nn.Module):
    def __init__(self, mlps: nn.ModuleList) -> None:
        super().__init__()
        self.experts = mlps

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x)
        hit = torch.bincount(ids.reshape(-1), minlength=len(self.experts)).tolist()
        for e, mlp in enumerate(self.experts):
            if hit[e] == 0:
                continue
            tok, slot = torch.where(ids == e)
            y = y.index_add(0, tok, mlp(x[tok]) * w[tok, slot, None])
        return y


def linear_peft(p: Problem) -> Runner:
    """Per-expert nn.Linear experts (Qwen3MoeMLP) with PEFT LoRA on gate/up/down_proj.

    Its adapter is the split form of the same fused adapter: gate and up share A and take
    their halves of B, so every implementation computes the same function.
    """
    import peft
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    s = p.shape
    cfg = _qwen3_config(p, "eager")
    mlps = nn.ModuleList(Qwen3MoeMLP(cfg, intermediate_size=s.inter) for _ in range(s.experts))
    mlps = mlps.to(p.dtype)
    e_, r = s.experts, s.rank
    a_gu, b_gu = _unstack(p.fused_lora, "gate_up_proj", e_)
    a_d, b_d = _unstack(p.fused_lora, "down_proj", e_)
    with torch.no_grad():
        for e, m in enumerate(mlps):
            m.gate_proj.weight.copy_(p.gate_up[e, : s.inter])
            m.up_proj.weight.copy_(p.gate_up[e, s.inter :])
            m.down_proj.weight.copy_(p.down[e])
    model = peft.get_peft_model(
        _LinearExperts(mlps),
        peft.LoraConfig(
            r=r,
            lora_alpha=2 * r,
            target_modules=["gate_proj", "up_proj", "down_proj"],
            init_lora_weights=False,
        ),
    )
    with torch.no_grad():
        for e, m in enumerate(mlps):
            m.gate_proj.lora_A["default"].weight.copy_(a_gu[e])
            m.up_proj.lora_A["default"].weight.copy_(a_gu[e])
            m.gate_proj.lora_B["default"].weight.copy_(b_gu[e, : s.inter])
            m.up_proj.lora_B["default"].weight.copy_(b_gu[e, s.inter :])
            m.down_proj.lora_A["default"].weight.copy_(a_d[e])
            m.down_proj.lora_B["default"].weight.copy_(b_d[e])
    return _step(lambda x, w: model(x, p.ids, w), p)


# The reference runs first: the others' outputs are compared against it.
IMPLS: dict[str, Callable[[Problem], Runner]] = {
    "kt_reference": lambda p: kt_native(p, "save", backend="reference"),
    "kt_native": lambda p: kt_native(p, "save"),
    "kt_native_recompute": lambda p: kt_native(p, "recompute"),
    "hf_eager_peft": lambda p: hf_fused_peft(p, "eager"),
    "hf_batched_mm_peft": lambda p: hf_fused_peft(p, "batched_mm"),
    "hf_grouped_mm_peft": lambda p: hf_fused_peft(p, "grouped_mm"),
    "linear_peft": linear_peft,
}
BASELINES = (
    "hf_eager_peft",
    "hf_batched_mm_peft",
    "hf_grouped_mm_peft",
    "linear_peft",
    "kt_reference",
)
