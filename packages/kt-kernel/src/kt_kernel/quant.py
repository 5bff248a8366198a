"""Quantisation error reports of a quantised expert base (any :class:`~kt_kernel.WeightFormat`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kt_kernel._native import native_module
from kt_kernel.formats import dequantize_per_channel, quantize_per_channel

__all__ = [
    "ProjectionQuantError",
    "QuantizationReport",
    "dequantize_per_channel",
    "int8_isa",
    "quantize_per_channel",
]


@dataclass(frozen=True)
class ProjectionQuantError:
    """How far one projection's quantised weights are from the weights they were quantised from.

    Attributes:
        max_abs_error: ``max |W - deq(W)|`` over all experts and elements (``deq`` in fp32).
        rel_fro_error: ``||W - deq(W)||_F / ||W||_F`` over all experts (0 for W = 0).
        max_step: the largest quantisation step (INT8: ``max scale``); every element's error
            is at most half of its channel's step.
    """

    max_abs_error: float
    rel_fro_error: float
    max_step: float


@dataclass(frozen=True)
class QuantizationReport:
    """Per-projection quantisation error of a quantised :class:`~kt_kernel.ExpertWeights`.

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


class ErrorSum:
    """Running max/Frobenius sums of the quantisation error, accumulated expert by expert."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.err_sq = 0.0
        self.ref_sq = 0.0
        self.max_step = 0.0

    def add(self, w: torch.Tensor, deq: torch.Tensor, steps: torch.Tensor) -> None:
        # fp32 differences (W is at most fp32 here) summed in fp64: cheap enough to report on
        # every expert of a large model at wrap time.
        w32 = w.detach().to(torch.float32)
        diff = w32 - deq.to(torch.float32)
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.abs().max()))
            self.max_step = max(self.max_step, float(steps.max()))
        self.err_sq += float(torch.sum(diff * diff, dtype=torch.float64))
        self.ref_sq += float(torch.sum(w32 * w32, dtype=torch.float64))

    def result(self) -> ProjectionQuantError:
        rel = (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else 0.0
        return ProjectionQuantError(self.max_abs, rel, self.max_step)


def int8_isa() -> str | None:
    """ISA the INT8 tile loader dispatches to, ``None`` without the extension.

    ``"avx512_bf16"`` (AVX-512 with native bf16 conversion), ``"avx512"``, ``"avx2"`` or
    ``"scalar"``; ``KT_KERNEL_ISA`` caps it (see :func:`kt_kernel.backend_info`).
    """
    if native_module() is None:
        return None
    return str(torch.ops.kt_kernel.int8_isa())
