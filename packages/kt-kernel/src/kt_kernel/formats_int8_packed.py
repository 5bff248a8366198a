"""INT8 per-channel weights repacked once for the kernel's AMX products: :class:`Int8Packed`.

Storage of one projection ``W [..., N, K]`` (parts, in the native loader's order):

- ``packed`` int8 ``[..., ceil(N/16), 32 Ps + 64]`` (``Ps``: ``ceil(K/2)`` rounded up to 16).
  Row ``b`` (output rows ``16b .. 16b + 15``) holds, per column pair ``p`` and row ``l``,
  ``q[16b + l, 2p + h]`` at ``32 p + 2 l + h``, then 64 zeros; rows past ``N`` and columns past
  ``K`` are zeros.
- ``scale`` fp32 ``[..., N]`` and ``shape`` int64 ``[..., 2]`` (``N`` and ``K``).

The values are :class:`~kt_kernel.formats.Int8PerChannel`'s (the same ``q`` and ``scale``,
``W = q * scale`` formed in fp32 and rounded once), rearranged so that each AMX tile step of
the native products (``csrc/format_int8_packed.cpp``) reads 512 contiguous bytes per block.
On a CPU with AMX, at any row count, in bf16, they run there; elsewhere the tile loader
(vectorised with AVX512_BF16) feeds oneDNN, about as fast as ``int8``'s.
"""

from __future__ import annotations

import torch

from kt_kernel.formats import (
    Int8PerChannel,
    Parts,
    StackedFormat,
    _check_quantisable,
    check_bf16_compute,
    dequantize_per_channel,
    quantize_per_channel,
    register_format,
)

__all__ = ["Int8Packed", "pack_int8", "unpack_int8"]

_BLOCK = 16  # output rows per block
_PAD = 64  # zero bytes ending each block (the stride is no multiple of 4 KiB)


def _stride_pairs(k: int) -> int:
    """Column pairs per block row: ``ceil(K/2)`` rounded up to 16 (whole tile steps)."""
    return ((k + 1) // 2 + 15) // 16 * 16


def pack_int8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, shape)`` of int8 ``q [..., N, K]`` in the layout above."""
    *lead, n, k = q.shape
    nb, ps = -(-n // _BLOCK), _stride_pairs(k)
    padded = torch.zeros((*lead, nb * _BLOCK, 2 * ps), dtype=torch.int8)
    padded[..., :n, :k] = q
    # [nb, l, p, h] -> [nb, p, l, h]
    tiles = padded.reshape(*lead, nb, _BLOCK, ps, 2)
    body = tiles.transpose(-3, -2).reshape(*lead, nb, 2 * _BLOCK * ps)
    pad = torch.zeros((*lead, nb, _PAD), dtype=torch.int8)
    packed = torch.cat([body, pad], dim=-1).contiguous()
    shape = torch.tensor([n, k], dtype=torch.int64).expand(*lead, 2).contiguous()
    return packed, shape


def unpack_int8(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int8`: int8 ``q [..., N, K]``."""
    *lead, nb, cols = packed.shape
    n, k = (int(v) for v in shape.reshape(-1, 2)[0])
    ps = (cols - _PAD) // (2 * _BLOCK)
    tiles = packed[..., : 2 * _BLOCK * ps].reshape(*lead, nb, ps, _BLOCK, 2)
    full = tiles.transpose(-3, -2).reshape(*lead, nb * _BLOCK, 2 * ps)
    return full[..., :n, :k].contiguous()


class Int8Packed(StackedFormat):
    """INT8 per channel (``int8``'s values) in the layout the native AMX products stream.

    ``int8`` keeps ``q`` as ``[N, K]`` rows, which its tile loader dequantises for oneDNN (0.90x
    dense bf16 at T=512 on an AMX CPU); this format stores the same ``q`` and scales once in
    the products' own layout, for CPUs with AMX.
    """

    name = "int8_packed"
    weight_dtype = "int8-packed"
    # As bf16-packed: the products read the storage in place, so tasks need not be tall.
    tile_rows = 256
    compute_dtypes = (torch.bfloat16,)
    # int8's values: its self-check tolerance.
    self_check_tolerance = Int8PerChannel.self_check_tolerance

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        """Compute in bf16 (the only compute dtype; ``None`` means it).

        Raises:
            KernelDTypeError: any other compute dtype.
        """
        self.compute_dtype = check_bf16_compute(self.weight_dtype, compute_dtype, "int8")

    @classmethod
    def own_products_here(cls) -> bool:
        """Whether the native extension runs AMX tiles here (the products')."""
        from kt_kernel._native import native_module

        return native_module() is not None and bool(torch.ops.kt_kernel.amx())

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(packed int8, scale fp32, shape int64)`` of :func:`quantize_per_channel`'s ``q``.

        Raises:
            KernelDTypeError: ``w`` is not floating point.
            KernelInputError: ``w`` has fewer than 2 dims.
        """
        _check_quantisable(w)
        q, scale = quantize_per_channel(w)
        packed, shape = pack_int8(q)
        return packed, scale, shape

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * scale`` in fp32, rounded once to ``dtype`` (default: the compute dtype)."""
        q = unpack_int8(parts[0], parts[2])
        return dequantize_per_channel(q, parts[1], dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``packed int8 [ceil(N/16), 32 Ps + 64]``, ``scale fp32 [N]``, ``shape int64 [2]``."""
        cols = 2 * _BLOCK * _stride_pairs(k) + _PAD
        return (
            ("packed", (-(-n // _BLOCK), cols), torch.int8),
            ("scale", (n,), torch.float32),
            ("shape", (2,), torch.int64),
        )

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """The per-channel scales (one step per output row)."""
        return parts[1].to(torch.float32)

    def select_rows(self, parts: Parts, index: torch.Tensor) -> Parts:
        """Parts of ``W[..., index, :]``: the rows' ``q`` and scales, not quantised again."""
        q = unpack_int8(parts[0], parts[2])[..., index, :]
        packed, shape = pack_int8(q)
        return packed, parts[1][..., index].contiguous(), shape

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]``: gate rows, then up rows (not quantised again)."""
        q = torch.cat([unpack_int8(gate[0], gate[2]), unpack_int8(up[0], up[2])], dim=-2)
        packed, shape = pack_int8(q)
        return packed, torch.cat([gate[1], up[1]], dim=-1).contiguous(), shape

    def __repr__(self) -> str:
        """Class name (the W8A8 subclass's too)."""
        return f"{type(self).__name__}()"


register_format("int8-packed", Int8Packed)


class Int8PackedA8(Int8Packed):
    """``int8-packed``'s storage whose products quantise the activations to int8 (W8A8).

    Where the CPU has AMX-INT8 tiles (``own_products_here``), both expert products quantise
    their input rows to int8 per row (``x`` forward; ``dy`` times the weight scales backward)
    and multiply int8 by int8 with int32 sums (``csrc/format_int8_packed.cpp`` defines the
    values): on a 2-core AMX Xeon the whole op ran 1.17-1.31x ``bf16-packed`` and 1.15-1.46x
    ``int8-packed``. The price is the activations' rounding: against fp32 on the same draw,
    ``y`` 1.2e-2 and ``dx`` 1.3e-2 where ``int8-packed`` has 0.8e-2 (Gaussian inputs; outlier
    channels cost more). Elsewhere the products are ``int8-packed``'s, bitwise. Chosen by
    name only: ``"auto"`` never picks a lossy format. The reference computes with the
    dequantised weights and unquantised activations; the conformance suite bounds the
    difference as for every format.
    """

    name = "int8_packed_a8"
    weight_dtype = "int8-packed-a8"

    @classmethod
    def own_products_here(cls) -> bool:
        """Whether the native extension runs AMX-INT8 tiles here (the W8A8 products')."""
        from kt_kernel._native import native_module

        return native_module() is not None and bool(torch.ops.kt_kernel.amx_int8())


register_format("int8-packed-a8", Int8PackedA8)
