"""Weight formats of the frozen expert base: one typed strategy per storage format.

A projection (``gate_up`` or ``down``) is logically ``W [E, N, K]`` (``N`` output rows, ``K``
input columns; gate_up is ``[E, 2I, H]``, down ``[E, H, I]``). A :class:`WeightFormat` stores
it as a tuple of tensors, its *parts*, each with the same leading dims as ``W`` (for one
expert none, for a bank ``E``): :class:`Dense` keeps ``(W,)``, :class:`Int8PerChannel`
``(q int8 [..., N, K], scale fp32 [..., N])``.

:data:`FORMATS` is the one table of weight format names in the project (``fp32``, ``bf16``,
``int8``, ``int4``, ``fp8``, ...): the names users type (``--weight-dtype``,
``wrap(weight_dtype=...)``) map to a :class:`FormatFactory` there, and every layer above reads
it. A new format is one class here (or in its own module) registered with
:func:`register_format`, plus one native tile loader registered in C++ under the same
:attr:`WeightFormat.name` (see ``csrc/formats.h``). The op, its autograd Function and
:class:`~kt_kernel.ExpertWeights` are format-agnostic.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = [
    "FORMATS",
    "FORMAT_ALIASES",
    "Dense",
    "DenseStorage",
    "FormatFactory",
    "Int8PerChannel",
    "Parts",
    "StackedFormat",
    "WeightFormat",
    "auto_format",
    "check_parts",
    "check_tiled_compute",
    "dequantize_per_channel",
    "format_name",
    "quantize_per_channel",
    "register_format",
    "resolve_format",
]

Parts = tuple[torch.Tensor, ...]

# Compute dtypes of tiled (dequantise-on-the-fly) formats: the tiles feed fp32/bf16 GEMMs.
TILED_COMPUTE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


@runtime_checkable
class WeightFormat(Protocol):
    """How one projection's frozen weights are stored and how the native op reads them.

    Attributes:
        name: key of the native tile loader registered in C++ (``csrc/formats.h``).
        weight_dtype: the format's name in :data:`FORMATS` (``"bf16"``, ``"int8"``, ...;
            ``"fp64"`` for the kernel-only float64 storage).
        compute_dtype: dtype of ``x``, the activations, the LoRA compute and the tiles.
        tile_rows: rows per (expert, row tile) task of the native op.
        lossy: whether storing rounds the weights (``False`` only for dense storage).
        self_check_tolerance: the largest ``max|kernel - reference| / max|reference|`` a
            wrap-time self-check accepts for weights in this format: the rounding of the
            storage, far below the order-one error of a wrong layout or activation.
    """

    weight_dtype: str
    compute_dtype: torch.dtype
    tile_rows: int

    @property
    def name(self) -> str:
        """Key of the native tile loader registered in C++."""
        ...

    @property
    def lossy(self) -> bool:
        """Whether storing rounds the weights."""
        ...

    @property
    def self_check_tolerance(self) -> float:
        """The wrap-time self-check's accepted relative error."""
        ...

    def quantize(self, w: torch.Tensor) -> Parts:
        """Parts of ``w [..., N, K]`` (floating point); the parts keep the leading dims."""
        ...

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``W [..., N, K]`` formed in fp32 and rounded once to ``dtype``.

        ``dtype`` defaults to :attr:`compute_dtype`, and then the result is bitwise the tiles
        the native loader writes (the oracle's weights); ``torch.float32`` gives the exact
        quantised values (for error reports).
        """
        ...

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``(part name, per-expert shape, dtype)`` of each part of an ``[N, K]`` projection."""
        ...

    def expert(self, parts: Parts, e: int) -> Parts:
        """Expert ``e``'s slice of a bank's parts (views, no copy)."""
        ...

    def nbytes(self, parts: Parts) -> int:
        """Bytes held by ``parts``."""
        ...

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """``[..., N]`` fp32: the largest quantisation step in each output row (0 if dense)."""
        ...

    def native_args(self, parts: Parts) -> Parts:
        """The tensors the native loader receives, in its order (contiguous, expert dim 0)."""
        ...

    def select_rows(self, parts: Parts, index: torch.Tensor) -> Parts:
        """Parts of ``W[..., index, :]`` (e.g. interleaved gate/up rows put gate first)."""
        ...

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]`` from those of ``gate`` and ``up`` ``[..., I, H]``."""
        ...


def check_parts(
    fmt: WeightFormat, parts: object, leading: tuple[int, ...], n: int, k: int, what: str
) -> Parts:
    """Raise :class:`KernelInputError` naming ``what`` unless ``parts`` match ``fmt.part_specs``.

    Args:
        fmt: the format.
        parts: candidate tuple of tensors.
        leading: the leading dims, ``(E,)`` for a bank.
        n: output rows ``N``.
        k: input columns ``K``.
        what: projection name for the message (``"gate_up"``/``"down"``).

    Returns:
        ``parts`` as a tuple.
    """
    specs = fmt.part_specs(n, k)
    if not isinstance(parts, tuple | list) or len(parts) != len(specs):
        raise KernelInputError(
            f"{what} must be {len(specs)} tensors {[s[0] for s in specs]} for format "
            f"{fmt.name!r}, got {type(parts).__name__}"
        )
    for t, (pname, shape, dtype) in zip(parts, specs, strict=True):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{what}.{pname} must be a torch.Tensor, got {type(t)}")
        if tuple(t.shape) != (*leading, *shape) or t.dtype != dtype:
            raise KernelInputError(
                f"{what}.{pname} must be {dtype} {[*leading, *shape]} for format "
                f"{fmt.name!r}, got {t.dtype} {list(t.shape)}"
            )
    return tuple(parts)


class StackedFormat:
    """Shared plumbing for formats whose parts all carry the expert dim first.

    A quantised subclass is its own :class:`FormatFactory`: the class attributes below and
    the constructor ``cls(compute_dtype=None)`` (``None``: bf16) are what :data:`FORMATS`
    needs of it.
    """

    name: str
    weight_dtype: str
    compute_dtype: torch.dtype
    tile_rows: int
    self_check_tolerance: float
    lossy: ClassVar[bool] = True
    compute_dtypes: ClassVar[tuple[torch.dtype, ...]] = TILED_COMPUTE_DTYPES

    # How a checkpoint ships a parameter ``P`` in this format: the tensors ``P + suffix``, in
    # the order :meth:`from_checkpoint` takes them (FP8: ``("", "_scale_inv")``; MXFP4:
    # ``("_blocks", "_scales")``). Empty: no checkpoint ships this format. A loader finds and
    # adopts shipped parts through these alone, so it holds no table of format names.
    checkpoint_suffixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def matches_checkpoint(cls, quantization_config: Mapping[str, Any]) -> bool:
        """Whether a checkpoint with this ``quantization_config`` ships weights in this format.

        ``weight_dtype="auto"`` keeps such a checkpoint's experts in this format
        (:func:`auto_format`). Formats a checkpoint can ship override it (FP8 blocks).
        """
        return False

    @classmethod
    def own_products_here(cls) -> bool:
        """Whether this CPU runs the format's own products on its stored layout.

        :func:`auto_format` prefers a lossless format that does over dense storage of the same
        compute dtype. Formats with such products override it (``bf16-packed``).
        """
        return False

    @classmethod
    def check_checkpoint_config(cls, quantization_config: Mapping[str, Any]) -> None:
        """Refuse options of a matching ``quantization_config`` this format cannot read.

        Raises:
            KernelInputError: naming the option and what is supported (none here).
        """

    @staticmethod
    def from_checkpoint(*tensors: torch.Tensor) -> Parts:
        """Parts from a checkpoint's tensors ``P + suffix`` (:attr:`checkpoint_suffixes`).

        Raises:
            KernelInputError: this format is not shipped by checkpoints.
        """
        raise KernelInputError("this weight format is not read from checkpoints")

    def select_rows(self, parts: Parts, index: torch.Tensor) -> Parts:
        """Parts of ``W[..., index, :]`` (reordering output rows, e.g. interleaved gate/up).

        Raises:
            KernelInputError: the format's scales span several rows, so rows cannot move alone.
        """
        raise KernelInputError(
            f"weight format {self.weight_dtype!r} cannot reorder output rows (its scales span "
            "several rows); dequantise with a dense weight_dtype"
        )

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]``: gate rows, then up rows.

        Raises:
            KernelInputError: the format cannot stack rows of separately stored parts.
        """
        raise KernelInputError(
            f"weight format {self.weight_dtype!r} cannot fuse separately stored gate and up "
            "parts; dequantise with a dense weight_dtype"
        )

    def expert(self, parts: Parts, e: int) -> Parts:
        """Expert ``e``'s slice of every part."""
        return tuple(p[e] for p in parts)

    def nbytes(self, parts: Parts) -> int:
        """Sum of the parts' bytes."""
        return sum(p.nbytes for p in parts)

    def native_args(self, parts: Parts) -> Parts:
        """The parts themselves, contiguous."""
        return tuple(p.contiguous() for p in parts)

    def __eq__(self, other: object) -> bool:
        """Same class and same options."""
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        """Hash of the class and options."""
        return hash((type(self).__name__, tuple(sorted(map(str, vars(self).items())))))

    def __repr__(self) -> str:
        """Class name and compute dtype."""
        return f"{type(self).__name__}(compute_dtype={self.compute_dtype})"


class Dense(StackedFormat):
    """Unquantised storage in the compute dtype (fp32, bf16, or fp64 for gradcheck).

    The native op's GEMMs read this storage directly (no tile copy).
    """

    name = "dense"
    # Rows per task: small enough to spread a hot expert over threads, large enough that each
    # single-threaded GEMM stays near peak.
    tile_rows = 256
    lossy = False

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        """Store in ``dtype`` (``torch.float32``, ``torch.bfloat16`` or ``torch.float64``)."""
        if dtype not in _DENSE_NAMES:
            raise KernelDTypeError(
                f"Dense dtype must be torch.float32, torch.bfloat16 or torch.float64, got {dtype}"
            )
        self.compute_dtype = dtype
        self.weight_dtype = _DENSE_NAMES[dtype]

    @property
    def self_check_tolerance(self) -> float:  # type: ignore[override]
        """The storage dtype's rounding: 1e-4 (fp32), 3e-2 (bf16), 1e-9 (fp64)."""
        return _DENSE_TOLERANCE[self.compute_dtype]

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(w cast to the dtype,)``."""
        return (w.detach().to(self.compute_dtype).contiguous(),)

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored tensor itself (detached), cast to ``dtype`` if given."""
        return parts[0].detach().to(dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """One part ``weight [N, K]``."""
        return (("weight", (n, k), self.compute_dtype),)

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """Zeros: nothing is quantised."""
        return torch.zeros(parts[0].shape[:-1], dtype=torch.float32)


# The names of dense storage. "fp64" is kernel-only (gradcheck runs through it; nobody stores
# a model in it), so it is not in FORMATS.
_DENSE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}
# Self-check tolerance per dense dtype. The reference runs on the original weights; bf16
# storage adds rounding of the weights (about 2^-9 relative per weight), while a swapped
# gate/up, a wrong activation or a missed clamp gives errors of 9e-2 and more.
_DENSE_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float64: 1e-9,
    torch.bfloat16: 3e-2,
}

_QMAX = 127


def _check_quantisable(w: object) -> None:
    """The input check every format's ``quantize`` shares: a floating-point ``[..., N, K]``.

    Raises:
        KernelDTypeError: ``w`` is not a floating-point tensor.
        KernelInputError: ``w`` has fewer than 2 dims.
    """
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise KernelDTypeError(f"w must be a floating-point tensor to quantise, got {got}")
    if w.dim() < 2:
        raise KernelInputError(f"w must be [..., N, K] with at least 2 dims, got {list(w.shape)}")


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
    _check_quantisable(w)
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

    The native tile loader computes exactly this, so the result is the oracle's weights.
    """
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def check_tiled_compute(fmt: str, dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if the tiled formats can compute in it.

    Raises:
        KernelDTypeError: naming the format and the accepted dtypes.
    """
    if dtype not in TILED_COMPUTE_DTYPES:
        raise KernelDTypeError(
            f"with weight_dtype={fmt!r}, dtype (the compute dtype) must be torch.float32 or "
            f"torch.bfloat16, got {dtype}"
        )
    return dtype


def check_bf16_compute(fmt: str, dtype: torch.dtype | None, fp32_format: str) -> torch.dtype:
    """bf16 for a format that computes only in it (``None`` means bf16).

    Raises:
        KernelDTypeError: naming the format, the dtype given and ``fp32_format`` for fp32.
    """
    if dtype not in (None, torch.bfloat16):
        raise KernelDTypeError(
            f"with weight_dtype={fmt!r}, dtype (the compute dtype) must be torch.bfloat16, "
            f"got {dtype}; use weight_dtype={fp32_format!r} for fp32"
        )
    return torch.bfloat16


class Int8PerChannel(StackedFormat):
    """Weight-only INT8: symmetric per output channel, fp32 scales; tiles dequantised in C++."""

    name = "int8"
    weight_dtype = "int8"
    # Each task dequantises every weight tile of its expert once, so tiles twice the dense
    # format's halve that work at large T.
    tile_rows = 512
    # Against a dense kernel on the same weights, measured on the 37 tiny families (gaussian
    # weights, the worst case for max-scaled formats): <= 2.4e-2.
    self_check_tolerance = 5e-2

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        """Compute in ``compute_dtype`` (``torch.bfloat16``, the default, or ``torch.float32``)."""
        self.compute_dtype = check_tiled_compute("int8", compute_dtype or torch.bfloat16)

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(q int8 [..., N, K], scale fp32 [..., N])`` by :func:`quantize_per_channel`."""
        return quantize_per_channel(w)

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * scale`` in fp32, rounded once to ``dtype`` (default: the compute dtype)."""
        return dequantize_per_channel(parts[0], parts[1], dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``q int8 [N, K]`` and ``scale fp32 [N]``."""
        return (("q", (n, k), torch.int8), ("scale", (n,), torch.float32))

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """The per-channel scales (one step per output row)."""
        return parts[1].to(torch.float32)


@runtime_checkable
class FormatFactory(Protocol):
    """A row of :data:`FORMATS`: builds the format and tells :func:`auto_format` about it.

    A quantised format class is its own factory (see :class:`StackedFormat`); dense storage
    in one dtype is a :class:`DenseStorage`.

    Attributes:
        lossy: whether storing rounds the weights (a quantised format).
        compute_dtypes: the compute dtypes the format can be built for.
    """

    @property
    def lossy(self) -> bool:
        """Whether storing rounds the weights."""
        ...

    @property
    def compute_dtypes(self) -> tuple[torch.dtype, ...]:
        """The compute dtypes the format can be built for."""
        ...

    def __call__(self, compute_dtype: torch.dtype | None = None) -> WeightFormat:
        """The format computing in ``compute_dtype`` (``None``: its default).

        Raises:
            KernelDTypeError: a compute dtype the format cannot use.
        """
        ...

    def matches_checkpoint(self, quantization_config: Mapping[str, Any]) -> bool:
        """Whether a checkpoint with this ``quantization_config`` ships this format."""
        ...

    @property
    def checkpoint_suffixes(self) -> tuple[str, ...]:
        """Suffixes of the checkpoint tensors a parameter is shipped as (empty: none)."""
        ...

    def own_products_here(self) -> bool:
        """Whether this CPU runs the format's own products on its stored layout."""
        ...

    def check_checkpoint_config(self, quantization_config: Mapping[str, Any]) -> None:
        """Refuse a matching ``quantization_config``'s options the format cannot read."""
        ...


class DenseStorage:
    """The :class:`FormatFactory` of unquantised storage in one dtype (``fp32``, ``bf16``).

    Attributes:
        dtype: the storage dtype, which is also the compute dtype.
    """

    lossy = False

    def __init__(self, dtype: torch.dtype) -> None:
        """Dense storage in ``dtype`` (a dtype :class:`Dense` accepts)."""
        Dense(dtype)  # validates
        self.dtype = dtype
        self.compute_dtypes: tuple[torch.dtype, ...] = (dtype,)

    def __call__(self, compute_dtype: torch.dtype | None = None) -> Dense:
        """:class:`Dense` in :attr:`dtype`.

        Raises:
            KernelDTypeError: ``compute_dtype`` is given and is not :attr:`dtype`.
        """
        if compute_dtype is not None and compute_dtype != self.dtype:
            raise KernelDTypeError(
                f"weight_dtype={_DENSE_NAMES[self.dtype]!r} stores and computes in "
                f"{self.dtype}, got dtype {compute_dtype}; pass one of them"
            )
        return Dense(self.dtype)

    def matches_checkpoint(self, quantization_config: Mapping[str, Any]) -> bool:
        """Never: a quantised checkpoint is not dense."""
        return False

    checkpoint_suffixes: tuple[str, ...] = ()  # dense checkpoints ship the parameter itself

    def own_products_here(self) -> bool:
        """Never: dense storage is the layout oneDNN reads."""
        return False

    def check_checkpoint_config(self, quantization_config: Mapping[str, Any]) -> None:
        """Nothing to check: never matches a ``quantization_config``."""

    def __repr__(self) -> str:
        """Class name and dtype."""
        return f"DenseStorage({self.dtype})"


# name -> factory: the names users type, in the order choices are listed (registration order).
FORMATS: dict[str, FormatFactory] = {}
# Old spellings still accepted, with a FutureWarning: old name -> its name in FORMATS.
FORMAT_ALIASES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16"}


def register_format(name: str, factory: FormatFactory) -> None:
    """Make ``weight_dtype=name`` build ``factory(compute_dtype)``.

    Args:
        name: the name users type (``--weight-dtype``, ``weight_dtype=``).
        factory: a quantised format class (a :class:`StackedFormat` subclass) or another
            :class:`FormatFactory`.

    Raises:
        KernelInputError: ``name`` is reserved or already registered to another factory.
    """
    if name == "auto" or name in FORMAT_ALIASES:
        raise KernelInputError(f"weight format name {name!r} is reserved")
    known = FORMATS.get(name)
    if known is not None and known is not factory:
        raise KernelInputError(f"weight format {name!r} is already registered ({known})")
    FORMATS[name] = factory


register_format("fp32", DenseStorage(torch.float32))
register_format("bf16", DenseStorage(torch.bfloat16))
register_format("int8", Int8PerChannel)


def format_name(name: str) -> str:
    """``name`` as :data:`FORMATS` spells it; an old spelling gives a ``FutureWarning``.

    Raises:
        KernelDTypeError: ``name`` is no registered format (the message lists them).
    """
    if not isinstance(name, str):
        raise KernelDTypeError(f"weight_dtype must be one of {list(FORMATS)}, got {name!r}")
    if name in FORMAT_ALIASES:
        new = FORMAT_ALIASES[name]
        warnings.warn(
            f"weight format {name!r} is deprecated; use {new!r}", FutureWarning, stacklevel=3
        )
        return new
    if name not in FORMATS:
        raise KernelDTypeError(f"weight_dtype must be one of {list(FORMATS)}, got {name!r}")
    return name


def auto_format(
    source_dtype: torch.dtype, quantization_config: Mapping[str, Any] | None = None
) -> str:
    """The format ``weight_dtype="auto"`` stands for, given how the weights are stored.

    A ``quantization_config`` selects the registered format whose factory
    ``matches_checkpoint`` it (``{"quant_method": "fp8", ...}``: ``"fp8"``), so the shipped
    bytes are kept. Otherwise the dense format of ``source_dtype``: ``"fp32"`` for float32
    weights, ``"bf16"`` for any other floating dtype (bf16, fp16, ...); except that a lossless
    format with that compute dtype whose own products run on this CPU
    (``own_products_here``) replaces it: ``"bf16-packed"`` for ``"bf16"`` where the native
    extension runs AVX-512 with AVX512_BF16 (the same values, 1.05-1.47x dense bf16's speed
    forward and backward in ``bench_formats``).

    Args:
        source_dtype: the dtype the weights are stored in (a checkpoint's, a module's).
        quantization_config: a checkpoint's ``quantization_config`` (``config.json``), if any.

    Raises:
        KernelDTypeError: a ``quantization_config`` that no registered format ships.
    """
    if quantization_config:
        for name, factory in FORMATS.items():
            if factory.matches_checkpoint(quantization_config):
                return name
        method = quantization_config.get("quant_method")
        raise KernelDTypeError(
            f"no weight format of kt_kernel.FORMATS reads checkpoints quantised with "
            f"quant_method={method!r}; dequantise the checkpoint, or pass a weight_dtype"
        )
    dense = next(
        (
            name
            for name, factory in FORMATS.items()
            if not factory.lossy and factory.compute_dtypes == (source_dtype,)
        ),
        _DENSE_NAMES[torch.bfloat16],
    )
    for name, factory in FORMATS.items():
        if (
            not factory.lossy
            and factory.compute_dtypes == FORMATS[dense].compute_dtypes
            and factory.own_products_here()
        ):
            return name
    return dense


def resolve_format(
    weight_dtype: str | WeightFormat | None,
    compute_dtype: torch.dtype | None,
    source_dtype: torch.dtype,
) -> WeightFormat:
    """The format for ``from_fused``'s ``weight_dtype`` and ``dtype`` arguments.

    Args:
        weight_dtype: a name from :data:`FORMATS` (or an old spelling of one), a
            :class:`WeightFormat`, or ``None`` for dense storage in ``compute_dtype``.
        compute_dtype: the resolved ``dtype`` argument, ``None`` when not given.
        source_dtype: the dtype of the weights being stored (the default's basis).

    Raises:
        KernelDTypeError: an unknown name or an unusable compute dtype.
    """
    if weight_dtype is None:
        return Dense(compute_dtype or source_dtype)
    if isinstance(weight_dtype, WeightFormat):
        if compute_dtype is not None and compute_dtype != weight_dtype.compute_dtype:
            raise KernelDTypeError(
                f"dtype {compute_dtype} disagrees with the format's compute dtype "
                f"{weight_dtype.compute_dtype}; pass one of them"
            )
        return weight_dtype
    if not isinstance(weight_dtype, str):
        raise KernelDTypeError(
            f"weight_dtype must be one of {list(FORMATS)}, a WeightFormat or None, got "
            f"{weight_dtype!r}"
        )
    factory = FORMATS[format_name(weight_dtype)]
    if compute_dtype is None and factory.lossy:
        compute_dtype = torch.float32 if source_dtype == torch.float32 else torch.bfloat16
    return factory(compute_dtype)
