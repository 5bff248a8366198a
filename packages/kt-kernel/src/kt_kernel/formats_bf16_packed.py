"""bf16 weights repacked once for the kernel's own products: :class:`Bf16Packed`.

Storage of one projection ``W [..., N, K]`` (parts, in the native loader's order):

- ``packed`` bfloat16 ``[..., ceil(N/16), 16 Kp + 32]`` (``Kp``: ``K`` rounded up to even). Row
  ``b`` (output rows ``16b .. 16b + 15``) holds, per column pair ``p`` and row pair ``g < 8``,
  the 2x2 tile ``W[16b + 2g + s, 2p + h]`` at ``p * 32 + g * 4 + h * 2 + s``, then 32 zeros;
  rows past ``N`` and the column past an odd ``K`` are zeros.
- ``shape`` int64 ``[..., 2]``: ``N`` and ``K`` (the padded ``packed`` does not tell them).

The values are the bf16 weights themselves, rearranged: the format is lossless and takes about
``1 + 2/K`` of dense bf16's bytes (for ``N`` a multiple of 16 and ``K`` even).

The native products (``csrc/format_bf16_packed.cpp``) stream this one copy for ``x W^T`` and
for ``dy W``, at every row count, where the CPU has AVX512_BF16; elsewhere (or with fp32
compute) the op dequantises tiles, an exact permutation, and runs oneDNN.
"""

from __future__ import annotations

import torch

from kt_kernel.formats import (
    _DENSE_TOLERANCE,
    Parts,
    StackedFormat,
    _check_quantisable,
    check_bf16_compute,
    register_format,
)

__all__ = ["Bf16Packed", "pack_bf16", "unpack_bf16"]

_BLOCK = 16  # output rows per block
_PAD = 32  # zero elements ending each block (64 bytes: the stride is no multiple of 4 KiB)


def pack_bf16(w: torch.Tensor) -> Parts:
    """``(packed, shape)`` of ``w [..., N, K]`` rounded to bf16 (the layout above)."""
    *lead, n, k = w.shape
    nb, kp = -(-n // _BLOCK), k + k % 2
    padded = torch.zeros((*lead, nb * _BLOCK, kp), dtype=torch.bfloat16)
    padded[..., :n, :k] = w.detach().to(torch.bfloat16)
    # [nb, g, s, p, h] -> [nb, p, g, h, s]
    tiles = padded.reshape(*lead, nb, _BLOCK // 2, 2, kp // 2, 2)
    body = tiles.permute(*range(len(lead)), -5, -2, -4, -1, -3)
    pad = torch.zeros((*lead, nb, _PAD), dtype=torch.bfloat16)
    packed = torch.cat([body.reshape(*lead, nb, _BLOCK * kp), pad], dim=-1).contiguous()
    shape = torch.tensor([n, k], dtype=torch.int64).expand(*lead, 2).contiguous()
    return packed, shape


def unpack_bf16(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bf16`: bf16 ``W [..., N, K]``."""
    *lead, nb, cols = packed.shape
    n, k = (int(v) for v in shape.reshape(-1, 2)[0])
    kp = (cols - _PAD) // _BLOCK
    tiles = packed[..., : _BLOCK * kp].reshape(*lead, nb, kp // 2, _BLOCK // 2, 2, 2)
    # [nb, p, g, h, s] -> [nb, g, s, p, h]
    full = tiles.permute(*range(len(lead)), -5, -3, -1, -4, -2).reshape(*lead, nb * _BLOCK, kp)
    return full[..., :n, :k].contiguous()


class Bf16Packed(StackedFormat):
    """Lossless bf16 storage in the layout the native products stream (no per-call repack).

    Where ``bf16`` leaves the weights as ``[N, K]`` rows for oneDNN, which repacks them on
    every product, this format stores them once in the kernel's own layout, so the 16-64 rows
    per expert of a small batch run near the matmul peak, forward and backward, from one copy.
    """

    name = "bf16_packed"
    weight_dtype = "bf16-packed"
    # As dense: the products read the storage in place, so tasks need not be tall.
    tile_rows = 256
    lossy = False
    compute_dtypes = (torch.bfloat16,)
    # The same values as dense bf16: its tolerance.
    self_check_tolerance = _DENSE_TOLERANCE[torch.bfloat16]

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        """Compute in bf16 (the only compute dtype; ``None`` means it).

        Raises:
            KernelDTypeError: any other compute dtype.
        """
        self.compute_dtype = check_bf16_compute("bf16-packed", compute_dtype, "fp32")

    @classmethod
    def own_products_here(cls) -> bool:
        """Whether the native extension runs AVX-512 on a CPU with AVX512_BF16 (the products')."""
        from kt_kernel._native import backend_info

        info = backend_info()
        return info.isa == "avx512" and "avx512bf16" in info.cpu_features

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(packed bf16, shape int64)``: ``w`` rounded to bf16 and rearranged.

        Raises:
            KernelDTypeError: ``w`` is not floating point.
            KernelInputError: ``w`` has fewer than 2 dims.
        """
        _check_quantisable(w)
        return pack_bf16(w)

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The bf16 weights ``[..., N, K]`` (exact), cast to ``dtype`` if given."""
        return unpack_bf16(parts[0], parts[1]).to(dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``packed bf16 [ceil(N/16), 16 Kp + 32]`` and ``shape int64 [2]``."""
        cols = _BLOCK * (k + k % 2) + _PAD
        return (("packed", (-(-n // _BLOCK), cols), torch.bfloat16), ("shape", (2,), torch.int64))

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """Zeros: the values are stored as they are."""
        n = int(parts[1].reshape(-1, 2)[0, 0])
        return torch.zeros((*parts[0].shape[:-2], n), dtype=torch.float32)

    def select_rows(self, parts: Parts, index: torch.Tensor) -> Parts:
        """Parts of ``W[..., index, :]`` (rows move freely: nothing spans several rows)."""
        return pack_bf16(self.dequantize(parts)[..., index, :])

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]``: gate rows, then up rows."""
        return pack_bf16(torch.cat([self.dequantize(gate), self.dequantize(up)], dim=-2))

    def __repr__(self) -> str:
        """Class name."""
        return "Bf16Packed()"


register_format("bf16-packed", Bf16Packed)
