"""Weight-only INT8 for the frozen expert base: per-channel quantisation, its error report, and
the autograd wrapper over the native INT8 expert op (``torch.ops.kt_kernel_int8``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kt_kernel._native import native_module
from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = [
    "INT8_COMPUTE_DTYPES",
    "ProjectionQuantError",
    "QuantizationReport",
    "dequantize_per_channel",
    "int8_isa",
    "quantize_per_channel",
]

# The dtypes the INT8 base is dequantised to for compute (the LoRA and activation dtype).
INT8_COMPUTE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
_QMAX = 127
# Rows per (expert, row tile) task in the INT8 op: each task dequantises every weight tile of
# its expert once, so tiles twice the dense op's halve that work at large T.
INT8_TILE_ROWS = 512


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8 quantisation of ``w [..., N, K]``.

    ``scale[..., n] = max_k |w[..., n, k]| / 127`` (fp32) and
    ``q = clamp(round(w / scale), -127, 127)`` (round half to even). An all-zero channel gets
    scale 0 and q 0, so it dequantises exactly.

    Args:
        w: floating-point ``[..., N, K]`` (the last dim is the input, reduced per channel).

    Returns:
        ``(q, scale)``: ``q`` int8 ``[..., N, K]``, ``scale`` float32 ``[..., N]``.

    Raises:
        KernelDTypeError: ``w`` is not floating point.
        KernelInputError: ``w`` has fewer than 2 dims or holds a non-finite value.
    """
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise KernelDTypeError(f"w must be a floating-point tensor to quantise, got {got}")
    if w.dim() < 2:
        raise KernelInputError(f"w must be [..., N, K] with at least 2 dims, got {list(w.shape)}")
    w32 = w.detach().to(torch.float32)
    scale = w32.abs().amax(dim=-1) / _QMAX
    if not bool(torch.isfinite(scale).all()):  # amax propagates NaN and inf: one small check
        raise KernelInputError("w holds NaN or inf; INT8 quantisation needs finite weights")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / safe.unsqueeze(-1)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_per_channel(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q [..., N, K] * scale [..., N, None]`` formed in fp32, then rounded once to ``dtype``.

    The native tile loop computes exactly this, so the result is the oracle's weights.
    """
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


@dataclass(frozen=True)
class ProjectionQuantError:
    """How far one projection's INT8 weights are from the weights they were quantised from.

    Attributes:
        max_abs_error: ``max |W - q * scale|`` over all experts and elements.
        rel_fro_error: ``||W - q * scale||_F / ||W||_F`` over all experts (0 for W = 0).
        max_step: the largest quantisation step (``max scale``); every element's error is at
            most half of its channel's step.
    """

    max_abs_error: float
    rel_fro_error: float
    max_step: float


@dataclass(frozen=True)
class QuantizationReport:
    """Per-projection quantisation error of an INT8 :class:`~kt_kernel.ExpertWeights`.

    Attributes:
        gate: error of the gate projection ``[E, I, H]``.
        up: error of the up projection ``[E, I, H]``.
        down: error of the down projection ``[E, H, I]``.
    """

    gate: ProjectionQuantError
    up: ProjectionQuantError
    down: ProjectionQuantError

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"gate": {...}, "up": {...}, "down": {...}}`` of plain floats (JSON-ready)."""
        return {
            name: {
                "max_abs_error": p.max_abs_error,
                "rel_fro_error": p.rel_fro_error,
                "max_step": p.max_step,
            }
            for name, p in (("gate", self.gate), ("up", self.up), ("down", self.down))
        }


class _ErrorSum:
    """Running max/Frobenius sums of the quantisation error, accumulated expert by expert."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.err_sq = 0.0
        self.ref_sq = 0.0
        self.max_step = 0.0

    def add(self, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        # fp32 differences (W is at most fp32 here) summed in fp64: cheap enough to report on
        # every expert of a large model at wrap time.
        w32 = w.detach().to(torch.float32)
        diff = w32 - q.to(torch.float32) * scale.unsqueeze(-1)
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.abs().max()))
            self.max_step = max(self.max_step, float(scale.max()))
        self.err_sq += float(torch.sum(diff * diff, dtype=torch.float64))
        self.ref_sq += float(torch.sum(w32 * w32, dtype=torch.float64))

    def result(self) -> ProjectionQuantError:
        rel = (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else 0.0
        return ProjectionQuantError(self.max_abs, rel, self.max_step)


def quantize_experts(
    gate_up: torch.Tensor, down: torch.Tensor, inter: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, QuantizationReport]:
    """Quantise ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` one expert at a time.

    Expert by expert so the only full-precision temporaries are one expert's (a whole-model
    fp32 copy of a large model would not fit beside it).

    Returns:
        ``(gate_up_q, gate_up_scale, down_q, down_scale, report)``.
    """
    e_count = gate_up.shape[0]
    gu_q = torch.empty(gate_up.shape, dtype=torch.int8)
    gu_s = torch.empty(gate_up.shape[:2], dtype=torch.float32)
    dn_q = torch.empty(down.shape, dtype=torch.int8)
    dn_s = torch.empty(down.shape[:2], dtype=torch.float32)
    errs = {"gate": _ErrorSum(), "up": _ErrorSum(), "down": _ErrorSum()}
    with torch.no_grad():
        for e in range(e_count):
            g = gate_up[e]
            q, s = quantize_per_channel(g)
            gu_q[e].copy_(q)
            gu_s[e].copy_(s)
            errs["gate"].add(g[:inter], q[:inter], s[:inter])
            errs["up"].add(g[inter:], q[inter:], s[inter:])
            q, s = quantize_per_channel(down[e])
            dn_q[e].copy_(q)
            dn_s[e].copy_(s)
            errs["down"].add(down[e], q, s)
    report = QuantizationReport(errs["gate"].result(), errs["up"].result(), errs["down"].result())
    return gu_q, gu_s, dn_q, dn_s, report


def int8_isa() -> str | None:
    """ISA the INT8 tile dequantisation dispatches to, ``None`` without the extension.

    ``"avx512_bf16"`` (AVX-512 with native bf16 conversion), ``"avx512"`` (fp32 tiles only;
    bf16 tiles use the scalar loop) or ``"scalar"``; ``KT_KERNEL_ISA=scalar`` caps it.
    """
    if native_module() is None:
        return None
    return str(torch.ops.kt_kernel_int8.isa())


def _ops() -> Any:
    if native_module() is None:
        raise KernelInputError("the INT8 native op needs the compiled extension kt_kernel._C")
    return torch.ops.kt_kernel_int8


def int8_experts_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    base: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scaling: float,
    fused: bool,
    save: bool,
    factors: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The native INT8 op on validated, contiguous inputs; no saved state without autograd.

    Args:
        x: ``[T, H]`` in the compute dtype.
        w: ``[T, k]`` float32 routing weights.
        ids: ``[T, k]`` int64 expert ids.
        base: :meth:`~kt_kernel.ExpertWeights.int8_storage`.
        scaling: LoRA ``alpha / rank`` (0 without LoRA).
        fused: whether ``factors`` are the fused-layout LoRA tensors.
        save: policy ``"save"`` (keep pre-activations) rather than ``"recompute"``.
        factors: LoRA tensors in the compute dtype (empty without LoRA).

    Returns:
        ``y [T, H]`` in the compute dtype.
    """
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or any(f.requires_grad for f in factors)
    )
    if not needs_graph:  # inference: nothing is kept for a backward
        y, _ = _ops().forward(
            x, ids, w, *base, list(factors), scaling, fused, False, INT8_TILE_ROWS
        )
        return y
    return NativeInt8Experts.apply(x, w, ids, base, scaling, fused, save, *factors)


class NativeInt8Experts(torch.autograd.Function):
    """Autograd wrapper over ``torch.ops.kt_kernel_int8.forward`` / ``backward``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor,
        base: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        scaling: float,
        fused: bool,
        save: bool,
        *lora: torch.Tensor,
    ) -> torch.Tensor:
        """Run the INT8 forward; keeps routing (and with ``save`` the pre-activations)."""
        y, saved = _ops().forward(
            x, ids, w, *base, list(lora), scaling, fused, save, INT8_TILE_ROWS
        )
        ctx.save_for_backward(x, w, ids, *lora, *saved)
        ctx.n_lora = len(lora)
        ctx.base = base
        ctx.scaling = scaling
        ctx.fused = fused
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        """dx through the transposed INT8 base, d topk_weights and the LoRA gradients."""
        x, w, ids, *rest = ctx.saved_tensors
        lora, saved = rest[: ctx.n_lora], rest[ctx.n_lora :]
        need_dx = bool(ctx.needs_input_grad[0])
        dx, dw, grads = _ops().backward(
            dy.contiguous(),
            x,
            ids,
            w,
            *ctx.base,
            list(lora),
            ctx.scaling,
            ctx.fused,
            list(saved),
            need_dx,
            INT8_TILE_ROWS,
        )
        return (dx if need_dx else None, dw, None, None, None, None, None, *grads)
