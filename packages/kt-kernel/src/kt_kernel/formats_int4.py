"""Weight-only INT4, symmetric and group-wise along the input dim: :class:`Int4Grouped`.

Storage of one projection ``W [..., N, K]`` (parts, in the native loader's order):

- ``packed`` uint8 ``[..., ceil(N/2), K]``: two weights per byte, from neighbouring rows: byte
  ``[p, k]`` holds ``W[2p, k]`` in its low nibble and ``W[2p + 1, k]`` in its high nibble, as
  ``q + 8`` with ``q`` in ``[-7, 7]`` (the missing row of an odd ``N`` holds 8, i.e. 0).
  Pairing rows rather than columns keeps every column of a row in its own byte, so 16
  consecutive columns unpack with one load and one mask or shift (no shuffle), any column
  offset is byte-aligned, and the shapes of the parts give ``N`` and ``K`` exactly.
- ``scale`` bfloat16 ``[..., N, ceil(K/G)]``: one scale per output row and group of ``G``
  consecutive input columns (``G`` in 32, 64, 128; default 64).

``W[n, k] = q[n, k] * scale[n, k // G]``, formed in fp32. That product is exact (a 4-bit
integer times an 8-bit-significand scale), so fp32 tiles are the quantised values exactly and
bf16 tiles are them rounded once to nearest even. Memory: ``(1/2 + 2/G) / 2`` of bf16 per
element (even N), 0.266x at ``G = 64`` (0.281x at 32, 0.258x at 128).
"""

from __future__ import annotations

import torch

from kt_kernel.errors import KernelInputError
from kt_kernel.formats import (
    Parts,
    StackedFormat,
    _check_quantisable,
    check_tiled_compute,
    register_format,
)

__all__ = ["INT4_GROUP_SIZES", "Int4Grouped", "pack_int4", "unpack_int4"]

# Group sizes with a native loader (csrc/format_int4.cpp registers int4_g32/64/128): each a
# multiple of 16, so a 16-column SIMD unit at a multiple of 16 never straddles two groups.
INT4_GROUP_SIZES = (32, 64, 128)
_QMAX = 7


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int ``q [..., N, K]`` with values in ``[-8, 7]`` into uint8 ``[..., ceil(N/2), K]``.

    Byte ``[p, k]``: ``q[2p, k] + 8`` in the low nibble, ``q[2p + 1, k] + 8`` in the high one.
    """
    n, k = q.shape[-2:]
    u = torch.full((*q.shape[:-2], n + n % 2, k), 8, dtype=torch.uint8)
    u[..., :n, :] = (q.to(torch.int16) + 8).to(torch.uint8)
    u = u.reshape(*q.shape[:-2], (n + 1) // 2, 2, k)
    return (u[..., 0, :] | (u[..., 1, :] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 ``q [..., n, K]`` from uint8 ``[..., ceil(n/2), K]``."""
    lead, k = packed.shape[:-2], packed.shape[-1]
    u = torch.stack([packed & 0xF, packed >> 4], dim=-2).reshape(*lead, -1, k)
    return (u[..., :n, :].to(torch.int8) - 8).contiguous()


class Int4Grouped(StackedFormat):
    """Weight-only INT4: symmetric, one bf16 scale per ``group_size`` input columns of a row.

    ``scale = bf16(max|W[n, group]| / 7)``, ``q = clamp(round(W / scale), -7, 7)`` (round half
    to even); an all-zero group gets scale 0 and dequantises to exactly 0. Tiles are
    dequantised on the fly by the native loader ``int4_g{group_size}``.
    """

    weight_dtype = "int4"
    # As INT8: a task dequantises its expert's weight tiles once, so tall tasks amortise it.
    tile_rows = 512
    # Against a dense kernel on the same weights, measured on the 37 tiny families (gaussian
    # weights): <= 0.26. INT4 rounding (~0.2 relative) is why a quantised base is checked
    # through a dense twin: it would hide a wrong activation.
    self_check_tolerance = 0.4

    def __init__(self, compute_dtype: torch.dtype | None = None, group_size: int = 64) -> None:
        """Compute in ``compute_dtype`` (bf16, the default, or fp32); ``group_size`` 32, 64, 128.

        Raises:
            KernelDTypeError: an unusable compute dtype.
            KernelInputError: an unsupported group size.
        """
        compute_dtype = check_tiled_compute("int4", compute_dtype or torch.bfloat16)
        if group_size not in INT4_GROUP_SIZES:
            raise KernelInputError(
                f"Int4Grouped group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}"
            )
        self.compute_dtype = compute_dtype
        self.group_size = group_size

    @property
    def name(self) -> str:  # type: ignore[override]
        """Native loader key: ``int4_g{group_size}``."""
        return f"int4_g{self.group_size}"

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(packed uint8 [..., ceil(N/2), K], scale bf16 [..., N, ceil(K/G)])`` of ``w``.

        Raises:
            KernelDTypeError: ``w`` is not floating point.
            KernelInputError: ``w`` has fewer than 2 dims or holds NaN/inf.
        """
        _check_quantisable(w)
        g, k = self.group_size, w.shape[-1]
        ng = -(-k // g)
        w32 = torch.zeros((*w.shape[:-1], ng * g), dtype=torch.float32)
        w32[..., :k] = w.detach().to(torch.float32)
        grouped = w32.reshape(*w.shape[:-1], ng, g)
        amax = grouped.abs().amax(dim=-1)
        if not bool(torch.isfinite(amax).all()):
            raise KernelInputError("w holds NaN or inf; INT4 quantisation needs finite weights")
        scale = (amax / _QMAX).to(torch.bfloat16)
        s32 = scale.to(torch.float32)
        safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
        q = torch.round(grouped / safe.unsqueeze(-1)).clamp_(-_QMAX, _QMAX)
        q = q.reshape(*w.shape[:-1], ng * g)[..., :k].to(torch.int8)
        return pack_int4(q).contiguous(), scale.contiguous()

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * scale`` formed in fp32 (exact), rounded once to ``dtype`` (default: compute)."""
        packed, scale = parts
        n, k = scale.shape[-2], packed.shape[-1]
        q = unpack_int4(packed, n).to(torch.float32)
        s = scale.to(torch.float32).repeat_interleave(self.group_size, dim=-1)[..., :k]
        return (q * s).to(dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``packed uint8 [ceil(N/2), K]`` and ``scale bf16 [N, ceil(K/G)]``."""
        ng = -(-k // self.group_size)
        return (("packed", ((n + 1) // 2, k), torch.uint8), ("scale", (n, ng), torch.bfloat16))

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """The largest group scale of each output row."""
        return parts[1].to(torch.float32).amax(dim=-1)

    def __repr__(self) -> str:
        """Class name, compute dtype and group size."""
        return f"Int4Grouped(compute_dtype={self.compute_dtype}, group_size={self.group_size})"


register_format("int4", Int4Grouped)
