"""Typed specs for the expert op: :class:`ExpertSpec` and the frozen base :class:`ExpertWeights`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = ["ExpertSpec", "ExpertWeights", "WeightDType", "SUPPORTED_WEIGHT_DTYPES"]

WeightDType = Literal["float32", "bfloat16", "float64"]
# float64 exists so torch.autograd.gradcheck can run through both implementations.
SUPPORTED_WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class ExpertSpec:
    """Shape of a routed SwiGLU expert bank.

    Attributes:
        num_experts: E, number of routed experts.
        hidden_size: H, model width (expert input and output size).
        intermediate_size: I, per-expert width of gate/up (the input of down).
        activation: gate activation; only ``"silu"`` (SwiGLU) is implemented.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"

    def __post_init__(self) -> None:
        """Reject non-positive sizes and unknown activations."""
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KernelInputError(
                    f"ExpertSpec.{name} must be a positive int, got {value!r}"
                )
        if self.activation not in _SUPPORTED_ACTIVATIONS:
            raise KernelInputError(
                f"ExpertSpec.activation must be one of {_SUPPORTED_ACTIVATIONS}, "
                f"got {self.activation!r}"
            )


def _resolve_dtype(dtype: torch.dtype | str | None, fallback: torch.dtype) -> torch.dtype:
    if dtype is None:
        dtype = fallback
    if isinstance(dtype, str):
        if dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise KernelDTypeError(
                f"dtype must be one of {sorted(SUPPORTED_WEIGHT_DTYPES)}, got {dtype!r} "
                "(int8 weights are not implemented yet)"
            )
        return SUPPORTED_WEIGHT_DTYPES[dtype]
    if dtype not in SUPPORTED_WEIGHT_DTYPES.values():
        raise KernelDTypeError(
            f"dtype must be one of torch.float32, torch.bfloat16, torch.float64, got {dtype}"
        )
    return dtype


def check_shape(name: str, tensor: object, expected: tuple[int, ...]) -> torch.Tensor:
    """Raise :class:`KernelInputError` naming ``name`` unless ``tensor`` has shape ``expected``."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(expected):
        raise KernelInputError(
            f"{name} must have shape {list(expected)}, got {list(tensor.shape)}"
        )
    if not tensor.dtype.is_floating_point:
        raise KernelDTypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    return tensor


class ExpertWeights:
    """Frozen base expert weights in kernel-owned contiguous storage.

    Storage is one ``gate_up [E, 2I, H]`` tensor (rows ``[0, I)`` are gate, ``[I, 2I)`` up, the
    transformers 5.x fused-experts order) and one ``down [E, H, I]`` tensor, both contiguous and
    detached from any autograd graph. Build with :meth:`from_fused` or :meth:`from_split`.

    Attributes:
        spec: the :class:`ExpertSpec` the tensors match.
        dtype: storage (and compute) dtype.
        weight_dtype: the storage format name; ``"int8"`` is reserved for weight-only int8.
    """

    def __init__(self, spec: ExpertSpec, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Wrap already-validated contiguous tensors; prefer the ``from_*`` classmethods."""
        self.spec = spec
        self._gate_up = gate_up
        self._down = down
        self.dtype: torch.dtype = gate_up.dtype
        self.weight_dtype: str = str(gate_up.dtype).removeprefix("torch.")

    @classmethod
    def from_fused(
        cls,
        spec: ExpertSpec,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        dtype: torch.dtype | str | None = None,
    ) -> ExpertWeights:
        """Copy fused weights into kernel storage.

        Args:
            spec: expert shapes.
            gate_up: ``[E, 2I, H]``; rows ``[0, I)`` are gate, ``[I, 2I)`` are up.
            down: ``[E, H, I]``.
            dtype: storage dtype (``torch.float32``/``torch.bfloat16``/``torch.float64`` or the
                names); defaults to ``gate_up.dtype``.

        Returns:
            A new :class:`ExpertWeights` that owns its memory (inputs are never aliased).

        Raises:
            KernelInputError: a shape does not match ``spec``.
            KernelDTypeError: an unsupported dtype.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_shape("gate_up", gate_up, (e, 2 * i, h))
        check_shape("down", down, (e, h, i))
        target = _resolve_dtype(dtype, gate_up.dtype)
        with torch.no_grad():
            gu = torch.empty((e, 2 * i, h), dtype=target)
            gu.copy_(gate_up.detach())
            dn = torch.empty((e, h, i), dtype=target)
            dn.copy_(down.detach())
        return cls(spec, gu, dn)

    @classmethod
    def from_split(
        cls,
        spec: ExpertSpec,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        *,
        dtype: torch.dtype | str | None = None,
    ) -> ExpertWeights:
        """Copy separate gate ``[E, I, H]``, up ``[E, I, H]`` and down ``[E, H, I]`` into storage.

        Raises:
            KernelInputError: a shape does not match ``spec``.
            KernelDTypeError: an unsupported dtype.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_shape("gate", gate, (e, i, h))
        check_shape("up", up, (e, i, h))
        check_shape("down", down, (e, h, i))
        target = _resolve_dtype(dtype, gate.dtype)
        with torch.no_grad():
            gu = torch.empty((e, 2 * i, h), dtype=target)
            gu[:, :i].copy_(gate.detach())
            gu[:, i:].copy_(up.detach())
            dn = torch.empty((e, h, i), dtype=target)
            dn.copy_(down.detach())
        return cls(spec, gu, dn)

    @property
    def gate_up(self) -> torch.Tensor:
        """Read-only view ``[E, 2I, H]`` (gate rows first); do not modify it in place."""
        return self._gate_up.detach()

    @property
    def gate(self) -> torch.Tensor:
        """Read-only view ``[E, I, H]`` of the gate projection."""
        return self._gate_up[:, : self.spec.intermediate_size].detach()

    @property
    def up(self) -> torch.Tensor:
        """Read-only view ``[E, I, H]`` of the up projection."""
        return self._gate_up[:, self.spec.intermediate_size :].detach()

    @property
    def down(self) -> torch.Tensor:
        """Read-only view ``[E, H, I]`` of the down projection."""
        return self._down.detach()

    @property
    def nbytes(self) -> int:
        """Bytes held by the kernel-owned storage."""
        return self._gate_up.nbytes + self._down.nbytes

    def __repr__(self) -> str:
        """Short summary: spec, dtype and size."""
        return f"ExpertWeights({self.spec}, dtype={self.weight_dtype}, nbytes={self.nbytes})"
