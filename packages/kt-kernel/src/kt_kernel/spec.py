"""Typed specs for the expert op: :class:`ExpertSpec` and the frozen base :class:`ExpertWeights`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kt_kernel.errors import KernelDTypeError, KernelInputError
from kt_kernel.quant import (
    INT8_COMPUTE_DTYPES,
    QuantizationReport,
    dequantize_per_channel,
    quantize_experts,
)

__all__ = [
    "SUPPORTED_WEIGHT_DTYPES",
    "ExpertSpec",
    "ExpertWeights",
    "QuantizedWeightDType",
    "WeightDType",
]

WeightDType = Literal["float32", "bfloat16", "float64"]
# float64 exists so torch.autograd.gradcheck can run through both implementations.
SUPPORTED_WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# Storage formats other than a compute dtype: "int8" is weight-only INT8 with per-channel scales.
QuantizedWeightDType = Literal["int8"]
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
                raise KernelInputError(f"ExpertSpec.{name} must be a positive int, got {value!r}")
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
                "(for int8 storage pass weight_dtype='int8' and a float32/bfloat16 dtype)"
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
        raise KernelInputError(f"{name} must have shape {list(expected)}, got {list(tensor.shape)}")
    if not tensor.dtype.is_floating_point:
        raise KernelDTypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    return tensor


class ExpertWeights:
    """Frozen base expert weights in kernel-owned contiguous storage.

    Storage is one ``gate_up [E, 2I, H]`` tensor (rows ``[0, I)`` are gate, ``[I, 2I)`` up, the
    transformers 5.x fused-experts order) and one ``down [E, H, I]`` tensor, both contiguous and
    detached from any autograd graph. Build with :meth:`from_fused` or :meth:`from_split`.

    With ``weight_dtype="int8"`` the storage is int8 ``gate_up``/``down`` plus fp32
    per-output-channel scales ``gate_up_scale [E, 2I]`` and ``down_scale [E, H]``; the op
    dequantises tiles on the fly in :attr:`dtype` and never builds a full-precision copy.

    Attributes:
        spec: the :class:`ExpertSpec` the tensors match.
        dtype: compute dtype (the storage dtype too, except for int8).
        weight_dtype: the storage format name: ``"float32"``, ``"bfloat16"``, ``"float64"``
            or ``"int8"``.
    """

    def __init__(
        self,
        spec: ExpertSpec,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        gate_up_scale: torch.Tensor | None = None,
        down_scale: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
        report: QuantizationReport | None = None,
    ) -> None:
        """Wrap already-validated contiguous tensors; prefer the ``from_*`` classmethods."""
        self.spec = spec
        self._gate_up = gate_up
        self._down = down
        self._gate_up_scale = gate_up_scale
        self._down_scale = down_scale
        self._report = report
        quantized = gate_up.dtype == torch.int8
        self.dtype: torch.dtype = compute_dtype if quantized and compute_dtype else gate_up.dtype
        self.weight_dtype: str = str(gate_up.dtype).removeprefix("torch.")

    @classmethod
    def from_fused(
        cls,
        spec: ExpertSpec,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        dtype: torch.dtype | str | None = None,
        weight_dtype: QuantizedWeightDType | None = None,
    ) -> ExpertWeights:
        """Copy fused weights into kernel storage.

        Args:
            spec: expert shapes.
            gate_up: ``[E, 2I, H]``; rows ``[0, I)`` are gate, ``[I, 2I)`` are up.
            down: ``[E, H, I]``.
            dtype: storage dtype (``torch.float32``/``torch.bfloat16``/``torch.float64`` or the
                names); defaults to ``gate_up.dtype``. With ``weight_dtype="int8"`` it is the
                compute dtype (float32 or bfloat16; default bfloat16 unless the input is fp32).
            weight_dtype: ``"int8"`` quantises once here (symmetric, per output channel, fp32
                scales); ``None`` stores ``dtype``.

        Returns:
            A new :class:`ExpertWeights` that owns its memory (inputs are never aliased).

        Raises:
            KernelInputError: a shape does not match ``spec``.
            KernelDTypeError: an unsupported dtype or weight_dtype.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_shape("gate_up", gate_up, (e, 2 * i, h))
        check_shape("down", down, (e, h, i))
        if weight_dtype is not None:
            return cls._quantized(spec, gate_up, down, dtype, weight_dtype)
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
        weight_dtype: QuantizedWeightDType | None = None,
    ) -> ExpertWeights:
        """Copy separate gate ``[E, I, H]``, up ``[E, I, H]`` and down ``[E, H, I]`` into storage.

        ``dtype`` and ``weight_dtype`` as in :meth:`from_fused`.

        Raises:
            KernelInputError: a shape does not match ``spec``.
            KernelDTypeError: an unsupported dtype or weight_dtype.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_shape("gate", gate, (e, i, h))
        check_shape("up", up, (e, i, h))
        check_shape("down", down, (e, h, i))
        if weight_dtype is not None:
            # Expert by expert, so the fused temporary is one expert's size.
            fused = _LazyFused(gate, up)
            return cls._quantized(spec, fused, down, dtype, weight_dtype)  # type: ignore[arg-type]
        target = _resolve_dtype(dtype, gate.dtype)
        with torch.no_grad():
            gu = torch.empty((e, 2 * i, h), dtype=target)
            gu[:, :i].copy_(gate.detach())
            gu[:, i:].copy_(up.detach())
            dn = torch.empty((e, h, i), dtype=target)
            dn.copy_(down.detach())
        return cls(spec, gu, dn)

    @classmethod
    def _quantized(
        cls,
        spec: ExpertSpec,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        dtype: torch.dtype | str | None,
        weight_dtype: str,
    ) -> ExpertWeights:
        if weight_dtype != "int8":
            raise KernelDTypeError(
                f"weight_dtype must be 'int8' or None, got {weight_dtype!r}; pass a float "
                "storage format through dtype instead"
            )
        default = torch.float32 if gate_up.dtype == torch.float32 else torch.bfloat16
        compute = _resolve_dtype(dtype, default)
        if compute not in INT8_COMPUTE_DTYPES:
            raise KernelDTypeError(
                f"with weight_dtype='int8', dtype (the compute dtype) must be torch.float32 or "
                f"torch.bfloat16, got {compute}"
            )
        gu_q, gu_s, dn_q, dn_s, report = quantize_experts(gate_up, down, spec.intermediate_size)
        return cls(
            spec,
            gu_q,
            dn_q,
            gate_up_scale=gu_s,
            down_scale=dn_s,
            compute_dtype=compute,
            report=report,
        )

    @property
    def is_quantized(self) -> bool:
        """Whether the base is stored as int8 with per-channel scales."""
        return self._gate_up_scale is not None

    @property
    def device(self) -> torch.device:
        """Device of the storage."""
        return self._gate_up.device

    def _full(self, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            return q.detach()
        return dequantize_per_channel(q, scale, self.dtype)

    @property
    def gate_up(self) -> torch.Tensor:
        """Read-only view ``[E, 2I, H]`` (gate rows first); do not modify it in place.

        For int8 storage this is a freshly dequantised copy in :attr:`dtype` (for inspection
        and tests; the op never builds it).
        """
        return self._full(self._gate_up, self._gate_up_scale)

    @property
    def gate(self) -> torch.Tensor:
        """Read-only view ``[E, I, H]`` of the gate projection (dequantised copy for int8)."""
        return self.gate_up[:, : self.spec.intermediate_size]

    @property
    def up(self) -> torch.Tensor:
        """Read-only view ``[E, I, H]`` of the up projection (dequantised copy for int8)."""
        return self.gate_up[:, self.spec.intermediate_size :]

    @property
    def down(self) -> torch.Tensor:
        """Read-only view ``[E, H, I]`` of the down projection (dequantised copy for int8)."""
        return self._full(self._down, self._down_scale)

    def expert_gate_up(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``[2I, H]`` in :attr:`dtype` (dequantised for int8, one expert only)."""
        s = None if self._gate_up_scale is None else self._gate_up_scale[e]
        return self._full(self._gate_up[e], s)

    def expert_down(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``[H, I]`` in :attr:`dtype` (dequantised for int8, one expert only)."""
        s = None if self._down_scale is None else self._down_scale[e]
        return self._full(self._down[e], s)

    def int8_storage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate_up_q [E, 2I, H], gate_up_scale [E, 2I], down_q [E, H, I], down_scale [E, H])``.

        Raises:
            KernelDTypeError: the weights are not int8.
        """
        if self._gate_up_scale is None or self._down_scale is None:
            raise KernelDTypeError(
                f"int8_storage() needs weight_dtype='int8' weights, these are {self.weight_dtype}"
            )
        return self._gate_up, self._gate_up_scale, self._down, self._down_scale

    def dequantized(self) -> ExpertWeights:
        """A full-precision copy in :attr:`dtype` (the oracle's weights for int8; else a copy)."""
        return ExpertWeights(self.spec, self.gate_up.clone(), self.down.clone())

    def quantization_report(self) -> QuantizationReport:
        """Per projection (gate, up, down): max abs error, relative Frobenius error, max step.

        Raises:
            KernelDTypeError: the weights are not int8 (nothing was quantised).
        """
        if self._report is None:
            raise KernelDTypeError(
                f"quantization_report() needs weight_dtype='int8' weights, these are "
                f"{self.weight_dtype}"
            )
        return self._report

    @property
    def nbytes(self) -> int:
        """Bytes held by the kernel-owned storage (int8 values plus fp32 scales for int8)."""
        extra = sum(t.nbytes for t in (self._gate_up_scale, self._down_scale) if t is not None)
        return self._gate_up.nbytes + self._down.nbytes + extra

    def __repr__(self) -> str:
        """Short summary: spec, dtype and size."""
        return f"ExpertWeights({self.spec}, dtype={self.weight_dtype}, nbytes={self.nbytes})"


class _LazyFused:
    """``[E, 2I, H]`` gate_up assembled one expert at a time from separate gate and up."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor) -> None:
        self._gate, self._up = gate, up
        self.shape = torch.Size((gate.shape[0], 2 * gate.shape[1], gate.shape[2]))
        self.dtype = gate.dtype

    def __getitem__(self, e: int) -> torch.Tensor:
        return torch.cat([self._gate[e], self._up[e]], dim=0)
