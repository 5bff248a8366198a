"""Gated expert activations: ``h = act(gate, up)``, a typed option of :class:`ExpertSpec`.

Each activation is a small frozen dataclass with its native name and parameters (the C++
loops in ``csrc/elementwise_body.h`` implement forward and exact backward) and its plain
PyTorch formula, which the reference implementation uses and autograd differentiates.
The kernel always receives the gate and up halves separately (gate rows ``[0, I)`` of
``gate_up``, up rows ``[I, 2I)``); an interleaved checkpoint layout (GPT-OSS) is
de-interleaved by whoever loads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kt_kernel.errors import KernelInputError

__all__ = ["Activation", "ClampedSwiGLU", "GeluTanhGated", "SwiGLU", "SwiGLULimit"]


def _check_limit(cls: str, limit: float) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
        raise KernelInputError(f"{cls}.limit must be a positive number, got {limit!r}")
    if math.isinf(limit):
        raise KernelInputError(f"{cls}.limit must be finite, got {limit!r}; use SwiGLU()")


@dataclass(frozen=True)
class SwiGLU:
    """``h = silu(gate) * up`` (Llama, Qwen, Mixtral, DeepSeek-V3 experts)."""

    native_name: ClassVar[str] = "swiglu"

    def params(self) -> tuple[float, ...]:
        """Native parameters: none."""
        return ()

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The formula in PyTorch (the oracle)."""
        return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``h = g * sigmoid(alpha * g) * (u + 1)`` (transformers' ``GptOssExperts._apply_gate``).

    Attributes:
        alpha: slope inside the sigmoid (GPT-OSS: 1.702).
        limit: clamp bound (GPT-OSS: 7.0).
    """

    alpha: float = 1.702
    limit: float = 7.0
    native_name: ClassVar[str] = "clamped_swiglu"

    def __post_init__(self) -> None:
        """Reject a non-positive or non-finite limit and a non-finite alpha."""
        _check_limit("ClampedSwiGLU", self.limit)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise KernelInputError(f"ClampedSwiGLU.alpha must be a number, got {self.alpha!r}")
        if not math.isfinite(self.alpha):
            raise KernelInputError(f"ClampedSwiGLU.alpha must be finite, got {self.alpha!r}")

    def params(self) -> tuple[float, ...]:
        """Native parameters ``(alpha, limit)``."""
        return (float(self.alpha), float(self.limit))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The formula in PyTorch (the oracle)."""
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return g * torch.sigmoid(g * self.alpha) * (u + 1)


@dataclass(frozen=True)
class SwiGLULimit:
    """DeepSeek-V4: ``h = silu(min(gate, limit)) * clamp(up, -limit, limit)``
    (transformers' ``DeepseekV4Experts._apply_gate``).

    Attributes:
        limit: clamp bound (DeepSeek-V4's ``swiglu_limit``, 10.0 by default there).
    """

    limit: float = 10.0
    native_name: ClassVar[str] = "swiglu_limit"

    def __post_init__(self) -> None:
        """Reject a non-positive or non-finite limit."""
        _check_limit("SwiGLULimit", self.limit)

    def params(self) -> tuple[float, ...]:
        """Native parameters ``(limit,)``."""
        return (float(self.limit),)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The formula in PyTorch (the oracle)."""
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


@dataclass(frozen=True)
class GeluTanhGated:
    """``h = gelu_tanh(gate) * up`` (Gemma's gated GELU, ``gelu_pytorch_tanh``)."""

    native_name: ClassVar[str] = "gelu_tanh_gated"

    def params(self) -> tuple[float, ...]:
        """Native parameters: none."""
        return ()

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The formula in PyTorch (the oracle)."""
        return F.gelu(gate, approximate="tanh") * up


Activation = SwiGLU | ClampedSwiGLU | SwiGLULimit | GeluTanhGated
ACTIVATION_TYPES: tuple[type, ...] = (SwiGLU, ClampedSwiGLU, SwiGLULimit, GeluTanhGated)
