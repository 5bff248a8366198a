"""INT4 group-wise weights repacked once for the kernel's AMX products: :class:`Int4Packed`.

Storage of one projection ``W [..., N, K]`` (parts, in the native loader's order):

- ``packed`` uint8 ``[..., ceil(N/16), 16 Ps + 64]`` (``Ps``: ``ceil(K/2)`` rounded up to 16).
  Row ``b`` (output rows ``16b .. 16b + 15``) holds, per column pair ``p``, row ``l < 8`` and
  ``h < 2``, the byte at ``16 p + 2 l + h``: ``q[16b + l, 2p + h] + 8`` in its low nibble and
  ``q[16b + 8 + l, 2p + h] + 8`` in its high one; then 64 zero bytes. Rows past ``N`` and
  columns past ``K`` hold ``q = 0``.
- ``scale`` bf16 ``[..., ceil(N/16), 16 ceil(K/G)]``: at ``16 g + l``, row ``16b + l``'s scale
  of group ``g`` (zeros past ``N``).
- ``shape`` int64 ``[..., 2]`` (``N`` and ``K``).

The values are :class:`~kt_kernel.formats_int4.Int4Grouped`'s (the same ``q`` and group
scales, ``W = q * scale`` formed in fp32 and rounded once), rearranged so that each AMX tile
step of the native products (``csrc/format_int4_packed.cpp``) reads 256 contiguous bytes per
block. On a CPU with AMX, at any row count, in bf16, they run there; elsewhere the tile loader
(vectorised with AVX512_BF16) feeds oneDNN, about as fast as ``int4``'s.
"""

from __future__ import annotations

import torch

from kt_kernel.formats import (
    Parts,
    StackedFormat,
    check_bf16_compute,
    register_format,
)
from kt_kernel.formats_int4 import Int4Grouped, pack_int4, unpack_int4

# The block shape the two integer packed formats share (csrc/amx_packed_ints.h).
from kt_kernel.formats_int8_packed import _BLOCK, _PAD, _stride_pairs

__all__ = ["Int4Packed", "pack_int4_blocks", "unpack_int4_blocks"]


def pack_int4_blocks(
    q: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, scale, shape)`` of ``q [..., N, K]`` (in ``[-7, 7]``), ``scale [..., N, ng]``."""
    *lead, n, k = q.shape
    nb, ps, ng = -(-n // _BLOCK), _stride_pairs(k), scale.shape[-1]
    u = torch.full((*lead, nb * _BLOCK, 2 * ps), 8, dtype=torch.uint8)
    u[..., :n, :k] = (q.to(torch.int16) + 8).to(torch.uint8)
    # [nb, half, l, p, h] -> [nb, p, half, l, h]; rows 8-15 (half 1) to the high nibbles
    tiles = u.reshape(*lead, nb, 2, _BLOCK // 2, ps, 2).movedim(-2, -4)
    body = (tiles[..., 0, :, :] | (tiles[..., 1, :, :] << 4)).reshape(*lead, nb, _BLOCK * ps)
    pad = torch.zeros((*lead, nb, _PAD), dtype=torch.uint8)
    packed = torch.cat([body, pad], dim=-1).contiguous()
    s = torch.zeros((*lead, nb * _BLOCK, ng), dtype=torch.bfloat16)
    s[..., :n, :] = scale
    blocked = s.reshape(*lead, nb, _BLOCK, ng).transpose(-2, -1).reshape(*lead, nb, ng * _BLOCK)
    shape = torch.tensor([n, k], dtype=torch.int64).expand(*lead, 2).contiguous()
    return packed, blocked.contiguous(), shape


def unpack_int4_blocks(parts: Parts) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int4_blocks`: int8 ``q [..., N, K]``, bf16 ``scale [..., N, ng]``."""
    packed, blocked, shape = parts
    *lead, nb, cols = packed.shape
    n, k = (int(v) for v in shape.reshape(-1, 2)[0])
    ps = (cols - _PAD) // _BLOCK
    body = packed[..., : _BLOCK * ps].reshape(*lead, nb, ps, _BLOCK // 2, 2)
    u = torch.stack([body & 0xF, body >> 4], dim=-3)  # [nb, p, half, l, h]
    q = u.movedim(-4, -2).reshape(*lead, nb * _BLOCK, 2 * ps)[..., :n, :k]
    ng = blocked.shape[-1] // _BLOCK
    scale = blocked.reshape(*lead, nb, ng, _BLOCK).transpose(-2, -1).reshape(*lead, -1, ng)
    return (q.to(torch.int8) - 8).contiguous(), scale[..., :n, :].contiguous()


class Int4Packed(StackedFormat):
    """INT4 group-wise (``int4``'s values) in the layout the native AMX products stream.

    ``int4`` keeps row pairs per byte, which its tile loader dequantises for oneDNN (0.79x
    dense bf16 at T=512 on an AMX CPU); this format stores the same ``q`` and group scales
    once in the products' own layout, for CPUs with AMX.
    """

    weight_dtype = "int4-packed"
    # As bf16-packed: the products read the storage in place, so tasks need not be tall.
    tile_rows = 256
    compute_dtypes = (torch.bfloat16,)
    # int4's values: its self-check tolerance.
    self_check_tolerance = Int4Grouped.self_check_tolerance

    def __init__(self, compute_dtype: torch.dtype | None = None, group_size: int = 64) -> None:
        """Compute in bf16 (the only compute dtype; ``None`` means it); ``group_size`` as int4's.

        Raises:
            KernelDTypeError: any other compute dtype.
            KernelInputError: a group size other than 32, 64, 128.
        """
        self.compute_dtype = check_bf16_compute("int4-packed", compute_dtype, "int4")
        self.group_size = Int4Grouped(torch.bfloat16, group_size).group_size

    @property
    def name(self) -> str:  # type: ignore[override]
        """Native loader key: ``int4_packed_g{group_size}``."""
        return f"int4_packed_g{self.group_size}"

    @classmethod
    def own_products_here(cls) -> bool:
        """Whether the native extension runs AMX tiles here (the products')."""
        from kt_kernel._native import native_module

        return native_module() is not None and bool(torch.ops.kt_kernel.amx())

    def _int4(self) -> Int4Grouped:
        return Int4Grouped(torch.bfloat16, self.group_size)

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(packed uint8, scale bf16, shape int64)`` of int4's ``q`` and group scales.

        Raises:
            KernelDTypeError: ``w`` is not floating point.
            KernelInputError: ``w`` has fewer than 2 dims or holds NaN/inf.
        """
        packed4, scale = self._int4().quantize(w)
        return pack_int4_blocks(unpack_int4(packed4, w.shape[-2]), scale)

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """int4's dequantize of the same values: ``q * scale`` in fp32, rounded once."""
        q, scale = unpack_int4_blocks(parts)
        return self._int4().dequantize((pack_int4(q), scale), dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``packed uint8 [ceil(N/16), 16 Ps + 64]``, ``scale bf16``, ``shape int64 [2]``."""
        nb, ng = -(-n // _BLOCK), -(-k // self.group_size)
        return (
            ("packed", (nb, _BLOCK * _stride_pairs(k) + _PAD), torch.uint8),
            ("scale", (nb, _BLOCK * ng), torch.bfloat16),
            ("shape", (2,), torch.int64),
        )

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """The largest group scale of each output row."""
        return unpack_int4_blocks(parts)[1].to(torch.float32).amax(dim=-1)

    def select_rows(self, parts: Parts, index: torch.Tensor) -> Parts:
        """Parts of ``W[..., index, :]``: the rows' ``q`` and scales, not quantised again."""
        q, scale = unpack_int4_blocks(parts)
        return pack_int4_blocks(q[..., index, :], scale[..., index, :])

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]``: gate rows, then up rows (not quantised again)."""
        (qg, sg), (qu, su) = unpack_int4_blocks(gate), unpack_int4_blocks(up)
        return pack_int4_blocks(torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2))

    def __repr__(self) -> str:
        """Class name and group size."""
        return f"Int4Packed(group_size={self.group_size})"


register_format("int4-packed", Int4Packed)
