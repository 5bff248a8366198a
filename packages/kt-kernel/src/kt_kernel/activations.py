"""Gated expert activations: ``h = act(gate, up)``, a typed option of :class:`ExpertSpec`.

Each activation is a small frozen dataclass with its registry name, native id and parameters
(the C++ loops in ``csrc/elementwise_body.h`` implement forward and exact backward; the op
dispatches on the id) and its plain PyTorch formula, which the reference implementation uses
and autograd differentiates. :data:`ACTIVATIONS` maps every name to its class, as
transformers' ``ACT2FN`` maps names to modules: the one list of activations in the project.
The kernel always receives the gate and up halves separately (gate rows ``[0, I)`` of
``gate_up``, up rows ``[I, 2I)``); an interleaved checkpoint layout (GPT-OSS) is
de-interleaved by whoever loads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from kt_kernel.errors import KernelInputError

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "ActivationClass",
    "ClampedSwiGLU",
    "GeluTanhGated",
    "SwiGLU",
    "SwiGLULimit",
    "register_activation",
]


def _check_limit(cls: str, limit: float) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
        raise KernelInputError(f"{cls}.limit must be a positive number, got {limit!r}")
    if math.isinf(limit):
        raise KernelInputError(f"{cls}.limit must be finite, got {limit!r}; use SwiGLU()")


@runtime_checkable
class ActivationClass(Protocol):
    """What :data:`ACTIVATIONS` needs of an activation class (its instances are the options).

    Attributes:
        name: the registry name (also the native loop's name, ``torch.ops.kt_kernel.activations``).
        native_id: the index of the native loop the op dispatches to (``ActKind`` in
            ``csrc/elementwise.h``).
        param_names: the constructor's parameters, in the order :meth:`params` gives them.
        gate_act_names: for an activation ``act_fn(gate) * up`` without parameters, the names
            of ``act_fn`` in transformers' ``ACT2FN`` vocabulary (how a model says which it
            uses); empty for clamped forms, which models spell as attributes.
    """

    name: ClassVar[str]
    native_id: ClassVar[int]
    param_names: ClassVar[tuple[str, ...]]
    gate_act_names: ClassVar[tuple[str, ...]]

    def params(self) -> tuple[float, ...]:
        """Native parameters, in :attr:`param_names` order."""
        ...

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The formula in PyTorch (the oracle)."""
        ...


@dataclass(frozen=True)
class SwiGLU:
    """``h = silu(gate) * up`` (Llama, Qwen, Mixtral, DeepSeek-V3 experts)."""

    name: ClassVar[str] = "swiglu"
    native_id: ClassVar[int] = 0
    param_names: ClassVar[tuple[str, ...]] = ()
    gate_act_names: ClassVar[tuple[str, ...]] = ("silu", "swish")

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
    name: ClassVar[str] = "clamped_swiglu"
    native_id: ClassVar[int] = 1
    param_names: ClassVar[tuple[str, ...]] = ("alpha", "limit")
    gate_act_names: ClassVar[tuple[str, ...]] = ()

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
    name: ClassVar[str] = "swiglu_limit"
    native_id: ClassVar[int] = 2
    param_names: ClassVar[tuple[str, ...]] = ("limit",)
    gate_act_names: ClassVar[tuple[str, ...]] = ()

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

    name: ClassVar[str] = "gelu_tanh_gated"
    native_id: ClassVar[int] = 3
    param_names: ClassVar[tuple[str, ...]] = ()
    gate_act_names: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh", "gelu_new")

    def params(self) -> tuple[float, ...]:
        """Native parameters: none."""
        return ()

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The formula in PyTorch (the oracle)."""
        return F.gelu(gate, approximate="tanh") * up


Activation = SwiGLU | ClampedSwiGLU | SwiGLULimit | GeluTanhGated
# name -> class, like transformers' ACT2FN: ACTIVATIONS["clamped_swiglu"](alpha=1.702, limit=7.0).
ACTIVATIONS: dict[str, type[ActivationClass]] = {}


def register_activation(cls: type[ActivationClass]) -> type[ActivationClass]:
    """Add ``cls`` to :data:`ACTIVATIONS` under ``cls.name`` (usable as a class decorator).

    Its ``native_id`` must name a native loop (``torch.ops.kt_kernel.activations()[id]`` is
    ``cls.name``); the conformance tests check every row against the extension.

    Raises:
        KernelInputError: the name or the native id is already taken by another class.
    """
    for other in ACTIVATIONS.values():
        if other is not cls and (other.name == cls.name or other.native_id == cls.native_id):
            raise KernelInputError(
                f"activation {cls.name!r} (native_id {cls.native_id}) collides with "
                f"{other.__name__} ({other.name!r}, native_id {other.native_id})"
            )
    ACTIVATIONS[cls.name] = cls
    return cls


for _cls in (SwiGLU, ClampedSwiGLU, SwiGLULimit, GeluTanhGated):
    register_activation(_cls)
