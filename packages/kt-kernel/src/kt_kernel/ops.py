"""The public, differentiable expert op and its input validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from kt_kernel._native import native_module
from kt_kernel.errors import KernelDTypeError, KernelInputError
from kt_kernel.lora import LoraBuffers, lora_shapes
from kt_kernel.reference import moe_experts_forward_reference
from kt_kernel.weights import ExpertWeights

__all__ = ["Backend", "Policy", "activation_memory_bytes", "moe_experts_forward"]

Policy = Literal["save", "recompute"]
Backend = Literal["auto", "native", "reference"]


def _validate(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: object,
    lora: object,
    policy: object,
    backend: object,
) -> None:
    if not isinstance(weights, ExpertWeights):
        raise KernelInputError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    spec = weights.spec
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.shape[1] != spec.hidden_size:
        raise KernelInputError(
            f"x must have shape [T, {spec.hidden_size}] (T tokens, hidden_size), got "
            f"{list(x.shape)}; flatten batch and sequence dims first"
        )
    if x.dtype != weights.dtype:
        raise KernelDTypeError(
            f"x has dtype {x.dtype} but the expert weights are {weights.dtype}; cast x or "
            "build ExpertWeights with a matching dtype"
        )
    tokens = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.shape[1] < 1:
        raise KernelInputError(
            f"topk_ids must have shape [T={tokens}, k>=1], got {list(topk_ids.shape)}"
        )
    if (
        topk_ids.dtype.is_floating_point
        or topk_ids.dtype.is_complex
        or topk_ids.dtype == torch.bool
    ):
        raise KernelDTypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise KernelInputError(
            f"topk_weights must have the shape of topk_ids {list(topk_ids.shape)}, got "
            f"{list(topk_weights.shape)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise KernelDTypeError(
            f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}"
        )
    if topk_ids.numel() > 0:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= spec.num_experts:
            bad = lo if lo < 0 else hi
            raise KernelInputError(
                f"topk_ids must lie in [0, num_experts={spec.num_experts}), got id {bad}"
            )
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != weights.device:
            raise KernelDTypeError(
                f"{name} is on {t.device} but the expert weights are on {weights.device}"
            )
    if lora is not None:
        if not isinstance(lora, LoraBuffers):
            raise KernelInputError(f"lora must be a LoraBuffers or None, got {type(lora).__name__}")
        if lora.spec != spec:
            raise KernelInputError(f"lora.spec {lora.spec} does not match weights.spec {spec}")
        _check_lora_tensors(lora)
    if policy not in ("save", "recompute"):
        raise KernelInputError(f"policy must be 'save' or 'recompute', got {policy!r}")
    if backend not in ("auto", "native", "reference"):
        raise KernelInputError(f"backend must be 'auto', 'native' or 'reference', got {backend!r}")


def _check_lora_tensors(lora: LoraBuffers) -> None:
    # The buffers are plain attributes a caller can swap (``.data = ...``): check every call.
    for name, shape in lora_shapes(lora.spec, lora.rank, lora.layout).items():
        t = getattr(lora, name, None)
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"LoRA buffer {name} is {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shape:
            raise KernelInputError(
                f"LoRA buffer {name} has shape {list(t.shape)} but rank {lora.rank} with "
                f"{lora.spec} needs {list(shape)}; it was replaced after construction (e.g. "
                "through .data): build a new LoraBuffers for another shape"
            )
        if not t.dtype.is_floating_point:
            raise KernelDTypeError(f"LoRA buffer {name} must be floating point, got {t.dtype}")


def _native_ops() -> Any:
    return torch.ops.kt_kernel


class _NativeExperts(torch.autograd.Function):
    """Autograd wrapper over ``torch.ops.kt_kernel.forward``/``backward``, for every format."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor,
        weights: ExpertWeights,
        scaling: float,
        fused: bool,
        save: bool,
        *lora: torch.Tensor,
    ) -> torch.Tensor:
        """Run the native forward; keeps routing (and with ``save`` the pre-activations)."""
        tile_rows = weights.format.tile_rows
        args = weights.native_args()
        y: torch.Tensor
        y, saved = _native_ops().forward(
            x, ids, w, *args, list(lora), scaling, fused, save, tile_rows
        )
        ctx.save_for_backward(x, w, ids, *lora, *saved)
        ctx.n_lora = len(lora)
        ctx.weights = weights
        ctx.scaling = scaling
        ctx.fused = fused
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """dx through the base (any format), d topk_weights and the LoRA gradients."""
        x, w, ids, *rest = ctx.saved_tensors
        lora, saved = rest[: ctx.n_lora], rest[ctx.n_lora :]
        need_dx = bool(ctx.needs_input_grad[0])
        weights: ExpertWeights = ctx.weights
        dx, dw, grads = _native_ops().backward(
            dy.contiguous(),
            x,
            ids,
            w,
            *weights.native_args(),
            list(lora),
            ctx.scaling,
            ctx.fused,
            list(saved),
            need_dx,
            weights.format.tile_rows,
        )
        return (dx if need_dx else None, dw, None, None, None, None, None, *grads)


# torch's Function.apply is unannotated (returns Any); this is its typed view for our Function.
_native_experts: Callable[..., torch.Tensor] = _NativeExperts.apply


def moe_experts_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    lora: LoraBuffers | None = None,
    *,
    policy: Policy = "save",
    backend: Backend = "auto",
) -> torch.Tensor:
    """Routed gated experts with optional LoRA, differentiable in x, topk_weights and LoRA.

    ``y[t] = sum_j topk_weights[t, j] * Expert_{topk_ids[t, j]}(x[t])`` where
    ``Expert_e(x) = down_e(act(gate_e(x), up_e(x)))`` (``act`` = ``weights.spec.activation``)
    and each projection is ``W_p x (+ b_p) + (alpha / r) * B_p (A_p x)``. The base weights
    (in any :class:`~kt_kernel.WeightFormat`) and biases are frozen (no gradient).

    Args:
        x: ``[T, H]`` in ``weights.dtype``; may be non-contiguous.
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        topk_weights: ``[T, k]`` floating routing weights (gradient is returned in its dtype).
        weights: frozen base :class:`ExpertWeights`.
        lora: optional :class:`LoraBuffers`; gradients go to its parameters' ``.grad``.
        policy: ``"save"`` keeps the gate/up pre-activations for backward;
            ``"recompute"`` keeps only inputs and routing and recomputes them
            (see :func:`activation_memory_bytes`).
        backend: ``"auto"`` (native when loaded and on CPU, else reference), ``"native"``
            (error if unavailable) or ``"reference"``.

    Returns:
        ``y [T, H]`` in ``x.dtype``.

    Raises:
        KernelInputError: a bad shape, id or option (the message names the argument).
        KernelDTypeError: a bad dtype or device.
    """
    _validate(x, topk_ids, topk_weights, weights, lora, policy, backend)
    on_cpu = x.device.type == "cpu"
    use_native = backend == "native" or (
        backend == "auto" and native_module() is not None and on_cpu
    )
    if backend == "native" and (native_module() is None or not on_cpu):
        raise KernelInputError(
            "backend='native' needs the compiled extension and CPU tensors; "
            f"extension loaded: {native_module() is not None}, x.device: {x.device}"
        )
    if not use_native:
        return moe_experts_forward_reference(x, topk_ids, topk_weights, weights, lora)
    acc = torch.float64 if weights.dtype == torch.float64 else torch.float32
    w = topk_weights.to(acc).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    xc = x.contiguous()
    if lora is None:
        factors: tuple[torch.Tensor, ...] = ()
        scaling, fused = 0.0, False
    else:
        factors = tuple(t.to(weights.dtype).contiguous() for t in lora.tensors())
        scaling, fused = lora.scaling, lora.layout == "fused"
    needs_graph = torch.is_grad_enabled() and (
        xc.requires_grad or w.requires_grad or any(f.requires_grad for f in factors)
    )
    if not needs_graph:  # inference: nothing is kept for a backward
        y: torch.Tensor
        y, _ = _native_ops().forward(
            xc,
            ids,
            w,
            *weights.native_args(),
            list(factors),
            scaling,
            fused,
            False,
            weights.format.tile_rows,
        )
        return y
    return _native_experts(xc, w, ids, weights, scaling, fused, policy == "save", *factors)


def activation_memory_bytes(
    tokens: int,
    top_k: int,
    weights: ExpertWeights,
    lora: LoraBuffers | None = None,
    *,
    policy: Policy = "save",
) -> int:
    """Bytes the native op keeps alive between forward and backward (beyond its inputs).

    ``save`` keeps the gate/up pre-activations ``[T*k, 2I]`` and the LoRA intermediates
    ``[T*k, r_a + r]``; ``recompute`` keeps only the routing permutation. Inputs (x, ids,
    weights) are referenced, not copied, under both policies.
    """
    spec = weights.spec
    n = tokens * top_k
    elt = weights.dtype.itemsize
    routing = (n + spec.num_experts + 1) * 8
    if policy == "recompute":
        return routing
    r_a = 0 if lora is None else (lora.rank if lora.layout == "fused" else 2 * lora.rank)
    r_d = 0 if lora is None else lora.rank
    return routing + n * (2 * spec.intermediate_size + r_a + r_d) * elt
