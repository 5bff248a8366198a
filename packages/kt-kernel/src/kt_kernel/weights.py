"""The frozen expert base: :class:`ExpertWeights` = spec + weight format + storage (+ biases)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kt_kernel.errors import KernelDTypeError
from kt_kernel.formats import Dense, Parts, WeightFormat, check_parts, resolve_format
from kt_kernel.quant import ErrorSum, QuantizationReport
from kt_kernel.spec import ExpertSpec, _resolve_dtype, check_shape

__all__ = ["ExpertWeights", "NativeArgs"]

# (format name, gate_up tensors, down tensors, gate_up_bias, down_bias, E, I, activation id,
# activation parameters): the weight-side arguments of torch.ops.kt_kernel.forward/backward.
NativeArgs = tuple[
    str,
    list[torch.Tensor],
    list[torch.Tensor],
    torch.Tensor | None,
    torch.Tensor | None,
    int,
    int,
    int,
    list[float],
]


class ExpertWeights:
    """Frozen base expert weights in kernel-owned storage, in one :class:`WeightFormat`.

    Logically ``gate_up [E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up, the transformers
    5.x fused-experts order) and ``down [E, H, I]``; physically the format's parts of each
    (:attr:`storage`). Optional frozen biases ``gate_up_bias [E, 2I]`` and
    ``down_bias [E, H]`` (GPT-OSS) are kept in the compute dtype. Build with
    :meth:`from_fused`, :meth:`from_split` or :meth:`from_parts`.

    Attributes:
        spec: the :class:`ExpertSpec` the tensors match (shapes and activation).
        format: the :class:`WeightFormat`.
        dtype: compute dtype (``format.compute_dtype``; the storage dtype too for dense).
        weight_dtype: the storage format's name in :data:`kt_kernel.FORMATS`: ``"fp32"``,
            ``"bf16"``, ``"int8"``, ... (``"fp64"`` for the kernel-only float64 storage).
    """

    def __init__(
        self,
        spec: ExpertSpec,
        fmt: WeightFormat,
        gate_up: Parts,
        down: Parts,
        *,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        report: QuantizationReport | None = None,
    ) -> None:
        """Wrap already-validated parts; prefer the ``from_*`` classmethods."""
        self.spec = spec
        self.format = fmt
        self.dtype: torch.dtype = fmt.compute_dtype
        self.weight_dtype: str = fmt.weight_dtype
        self._parts = (tuple(gate_up), tuple(down))
        self._bias = (gate_up_bias, down_bias)
        self._report = report

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_fused(
        cls,
        spec: ExpertSpec,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        dtype: torch.dtype | str | None = None,
        weight_dtype: str | WeightFormat | None = None,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> ExpertWeights:
        """Store fused weights in kernel storage (copied, or quantised expert by expert).

        Args:
            spec: expert shapes and activation.
            gate_up: ``[E, 2I, H]``; rows ``[0, I)`` are gate, ``[I, 2I)`` are up.
            down: ``[E, H, I]``.
            dtype: for dense storage the storage dtype (``torch.float32``/``torch.bfloat16``/
                ``torch.float64`` or the names), default ``gate_up.dtype``; for a quantised
                format the compute dtype (float32 or bfloat16; default bfloat16 unless the
                input is fp32).
            weight_dtype: ``None`` (dense, in ``dtype``), a name registered in
                :data:`kt_kernel.FORMATS` (``"bf16"``, ``"int8"``, ...) or a
                :class:`WeightFormat` object.
            gate_up_bias: optional frozen ``[E, 2I]`` bias of gate_up.
            down_bias: optional frozen ``[E, H]`` bias of down.

        Returns:
            A new :class:`ExpertWeights` that owns its memory (inputs are never aliased).

        Raises:
            KernelInputError: a shape does not match ``spec``.
            KernelDTypeError: an unsupported dtype or weight_dtype.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_shape("gate_up", gate_up, (e, 2 * i, h))
        check_shape("down", down, (e, h, i))
        fmt = resolve_format(weight_dtype, _resolve_dtype(dtype), gate_up.dtype)
        return cls._build(spec, fmt, gate_up.__getitem__, down, gate_up_bias, down_bias)

    @classmethod
    def from_split(
        cls,
        spec: ExpertSpec,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        *,
        dtype: torch.dtype | str | None = None,
        weight_dtype: str | WeightFormat | None = None,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> ExpertWeights:
        """Store separate gate ``[E, I, H]``, up ``[E, I, H]`` and down ``[E, H, I]``.

        Other arguments as in :meth:`from_fused`.

        Raises:
            KernelInputError: a shape does not match ``spec``.
            KernelDTypeError: an unsupported dtype or weight_dtype.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_shape("gate", gate, (e, i, h))
        check_shape("up", up, (e, i, h))
        check_shape("down", down, (e, h, i))
        fmt = resolve_format(weight_dtype, _resolve_dtype(dtype), gate.dtype)

        def fused(x: int) -> torch.Tensor:  # one expert's [2I, H] at a time
            return torch.cat([gate[x], up[x]], dim=0)

        return cls._build(spec, fmt, fused, down, gate_up_bias, down_bias)

    @classmethod
    def from_parts(
        cls,
        spec: ExpertSpec,
        fmt: WeightFormat,
        gate_up: Parts,
        down: Parts,
        *,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> ExpertWeights:
        """Adopt storage already in ``fmt`` (e.g. FP8 blocks as a checkpoint ships them).

        The parts are used as they are (contiguous ones are not copied).

        Raises:
            KernelInputError: a part's shape or dtype does not match ``fmt.part_specs``.
        """
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        gu = check_parts(fmt, gate_up, (e,), 2 * i, h, "gate_up")
        dn = check_parts(fmt, down, (e,), h, i, "down")
        gu = tuple(t.detach().contiguous() for t in gu)
        dn = tuple(t.detach().contiguous() for t in dn)
        gb, db = _biases(spec, fmt.compute_dtype, gate_up_bias, down_bias)
        return cls(spec, fmt, gu, dn, gate_up_bias=gb, down_bias=db)

    @classmethod
    def _build(
        cls,
        spec: ExpertSpec,
        fmt: WeightFormat,
        gate_up_of: Callable[[int], torch.Tensor],
        down: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_bias: torch.Tensor | None,
    ) -> ExpertWeights:
        # Expert by expert, so the only full-precision temporaries are one expert's (a
        # whole-model fp32 copy of a large model would not fit beside it).
        e_count, inter = spec.num_experts, spec.intermediate_size
        quantised = fmt.lossy
        errs = {"gate": ErrorSum(), "up": ErrorSum(), "down": ErrorSum()}
        banks: list[list[torch.Tensor]] = [[], []]
        with torch.no_grad():
            for x in range(e_count):
                for b, src in enumerate((gate_up_of(x), down[x])):
                    parts = fmt.quantize(src.detach())
                    if x == 0:
                        banks[b] = [torch.empty((e_count, *p.shape), dtype=p.dtype) for p in parts]
                    for bank, p in zip(banks[b], parts, strict=True):
                        bank[x].copy_(p)
                    if quantised:
                        deq = fmt.dequantize(parts, torch.float32)
                        steps = fmt.row_steps(parts)
                        if b == 0:
                            errs["gate"].add(src[:inter], deq[:inter], steps[:inter])
                            errs["up"].add(src[inter:], deq[inter:], steps[inter:])
                        else:
                            errs["down"].add(src, deq, steps)
        report = None
        if quantised:
            report = QuantizationReport(
                errs["gate"].result(), errs["up"].result(), errs["down"].result()
            )
        gb, db = _biases(spec, fmt.compute_dtype, gate_up_bias, down_bias)
        return cls(
            spec,
            fmt,
            tuple(banks[0]),
            tuple(banks[1]),
            gate_up_bias=gb,
            down_bias=db,
            report=report,
        )

    # ---------------------------------------------------------------------- reading
    @property
    def storage(self) -> tuple[Parts, Parts]:
        """``(gate_up parts, down parts)`` in the format's layout (read-only; do not modify)."""
        return self._parts

    @property
    def gate_up_bias(self) -> torch.Tensor | None:
        """The frozen ``[E, 2I]`` gate_up bias in the compute dtype, or ``None``."""
        return self._bias[0]

    @property
    def down_bias(self) -> torch.Tensor | None:
        """The frozen ``[E, H]`` down bias in the compute dtype, or ``None``."""
        return self._bias[1]

    @property
    def is_quantized(self) -> bool:
        """Whether the base is stored in a quantised (non-dense) format."""
        return self.format.lossy

    @property
    def device(self) -> torch.device:
        """Device of the storage."""
        return self._parts[0][0].device

    @property
    def gate_up(self) -> torch.Tensor:
        """``[E, 2I, H]`` in :attr:`dtype` (gate rows first); read-only.

        For dense storage a view of it; for a quantised format a freshly dequantised copy (for
        inspection and tests; the op never builds it).
        """
        return self.format.dequantize(self._parts[0])

    @property
    def gate(self) -> torch.Tensor:
        """``[E, I, H]`` of the gate projection (dequantised copy for quantised formats)."""
        return self.gate_up[:, : self.spec.intermediate_size]

    @property
    def up(self) -> torch.Tensor:
        """``[E, I, H]`` of the up projection (dequantised copy for quantised formats)."""
        return self.gate_up[:, self.spec.intermediate_size :]

    @property
    def down(self) -> torch.Tensor:
        """``[E, H, I]`` in :attr:`dtype` (dequantised copy for quantised formats)."""
        return self.format.dequantize(self._parts[1])

    def expert_gate_up(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``[2I, H]`` in :attr:`dtype` (one expert dequantised)."""
        return self.format.dequantize(self.format.expert(self._parts[0], e))

    def expert_down(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``[H, I]`` in :attr:`dtype` (one expert dequantised)."""
        return self.format.dequantize(self.format.expert(self._parts[1], e))

    def int8_storage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate_up_q [E, 2I, H], gate_up_scale [E, 2I], down_q [E, H, I], down_scale [E, H])``.

        Raises:
            KernelDTypeError: the weights are not int8.
        """
        if self.format.name != "int8":
            raise KernelDTypeError(
                f"int8_storage() needs weight_dtype='int8' weights, these are {self.weight_dtype}"
            )
        (gu_q, gu_s), (dn_q, dn_s) = self._parts
        return gu_q, gu_s, dn_q, dn_s

    def dequantized(self) -> ExpertWeights:
        """A dense copy in :attr:`dtype` with the same biases (the oracle's weights)."""
        fmt = Dense(self.dtype)
        return ExpertWeights(
            self.spec,
            fmt,
            (self.gate_up.clone(),),
            (self.down.clone(),),
            gate_up_bias=self.gate_up_bias,
            down_bias=self.down_bias,
        )

    def quantization_report(self) -> QuantizationReport:
        """Per projection (gate, up, down): max abs error, relative Frobenius error, max step.

        Raises:
            KernelDTypeError: the weights were not quantised here (dense, or adopted parts).
        """
        if self._report is None:
            raise KernelDTypeError(
                f"quantization_report() needs weights quantised by from_fused/from_split "
                f"(weight_dtype='int8', ...), these are {self.weight_dtype}"
            )
        return self._report

    def native_args(self) -> NativeArgs:
        """The weight-side arguments of ``torch.ops.kt_kernel.forward``/``backward``."""
        act = self.spec.activation
        return (
            self.format.name,
            list(self.format.native_args(self._parts[0])),
            list(self.format.native_args(self._parts[1])),
            self.gate_up_bias,
            self.down_bias,
            self.spec.num_experts,
            self.spec.intermediate_size,
            act.native_id,
            list(act.params()),
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by the kernel-owned storage (all parts, plus biases)."""
        fmt = self.format
        biases = sum(b.nbytes for b in self._bias if b is not None)
        return fmt.nbytes(self._parts[0]) + fmt.nbytes(self._parts[1]) + biases

    def __repr__(self) -> str:
        """Short summary: spec, format and size."""
        return f"ExpertWeights({self.spec}, format={self.format!r}, nbytes={self.nbytes})"


def _biases(
    spec: ExpertSpec,
    dtype: torch.dtype,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validated contiguous copies of the optional biases in the compute dtype."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    out: list[torch.Tensor | None] = []
    expected = {"gate_up_bias": (e, 2 * i), "down_bias": (e, h)}
    for name, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if b is None:
            out.append(None)
            continue
        check_shape(name, b, expected[name])
        out.append(b.detach().to(dtype).clone().contiguous())
    return out[0], out[1]
