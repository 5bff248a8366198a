"""MXFP4 weights as GPT-OSS ships them (OCP microscaling, E2M1 + E8M0): :class:`Mxfp4`.

Storage of one projection ``W [..., N, K]`` (parts, in the native loader's order), ``K`` a
multiple of 32 and ``G = K / 32``:

- ``blocks`` uint8 ``[..., N, G, 16]``: 32 E2M1 (FP4) codes per (row, group), two per byte,
  column ``2j`` of the group in the LOW nibble of byte ``j`` and ``2j + 1`` in the high one;
- ``scales`` uint8 ``[..., N, G]``: one E8M0 exponent per (row, group), ``2^(s - 127)``
  (``255`` is NaN and refused).

These are the checkpoint's ``*_blocks`` and ``*_scales`` tensors themselves (GPT-OSS's
``gate_up_proj_blocks [E, 2I, H/32, 16]``, ``down_proj_blocks [E, H, I/32, 16]``: output rows
first, the input dim blocked), adopted without a copy by :meth:`Mxfp4.from_checkpoint`.

``W[n, k] = E2M1[code] * 2^(s - 127)`` formed in fp32, with ``E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4,
6, -0, -0.5, ..., -6)`` (transformers' ``FP4_VALUES``). Two significant bits times a power of
two: the product is exact in fp32 and in bf16, so a bf16 tile equals transformers' own
dequantised (``convert_moe_packed_tensors``) weights bitwise. Memory: ``(1/2 + 1/32) / 2`` of
bf16, 0.266x.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kt_kernel.errors import KernelDTypeError, KernelInputError
from kt_kernel.formats import (
    Parts,
    StackedFormat,
    _check_quantisable,
    check_tiled_compute,
    register_format,
)

__all__ = ["E2M1_VALUES", "MXFP4_GROUP", "Mxfp4"]

MXFP4_GROUP = 32  # inputs per E8M0 scale
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_E2M1_MAX = 6.0
# Midpoints between neighbouring E2M1 magnitudes, for round-to-nearest.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_NAN_SCALE = 255


def _lut() -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)


def _scale_values(scales: torch.Tensor) -> torch.Tensor:
    """``2^(s - 127)`` in fp32 from E8M0 bytes, built from bits as the native loader does."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    out = bits.view(torch.float32)
    return torch.where(s == _NAN_SCALE, torch.full_like(out, float("nan")), out)


def _check_k(k: int) -> int:
    if k % MXFP4_GROUP:
        raise KernelInputError(
            f"MXFP4 needs the input dim K to be a multiple of {MXFP4_GROUP} (one E8M0 scale per "
            f"32 inputs), got K={k}; use weight_dtype 'int4' or 'bf16' for this model"
        )
    return k // MXFP4_GROUP


class Mxfp4(StackedFormat):
    """E2M1 weights with one E8M0 scale per 32 inputs of a row; tiles dequantised in C++."""

    name = "mxfp4"
    weight_dtype = "mxfp4"
    group_size = MXFP4_GROUP
    checkpoint_suffixes = ("_blocks", "_scales")  # ``P_blocks`` and ``P_scales``
    # As INT4: a task dequantises its expert's weight tiles once, so tall tasks amortise it.
    tile_rows = 512
    # Against a dense kernel on the same weights (gaussian weights): E2M1's 1 mantissa bit
    # rounds by up to 1/6 of a group's largest value, as INT4 does, so the same bound.
    self_check_tolerance = 0.4

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        """Compute in ``compute_dtype`` (``torch.bfloat16``, the default, or ``torch.float32``).

        Raises:
            KernelDTypeError: an unusable compute dtype.
        """
        compute_dtype = check_tiled_compute("mxfp4", compute_dtype or torch.bfloat16)
        self.compute_dtype = compute_dtype

    @classmethod
    def matches_checkpoint(cls, quantization_config: Mapping[str, Any]) -> bool:
        """An MXFP4 checkpoint: ``quant_method`` ``"mxfp4"`` (GPT-OSS as released)."""
        return quantization_config.get("quant_method") == "mxfp4"

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])`` of ``w``.

        Per group of 32 inputs: the smallest power-of-two scale with ``max|w| / scale <= 6``
        (so nothing is clipped), ``s = 127 + ceil(log2(max|w| / 6))`` clamped to ``[0, 254]``
        (an all-zero group gets 0), and each ``w / scale`` rounded to the nearest E2M1 value,
        ties to the even code.

        Raises:
            KernelDTypeError: ``w`` is not floating point.
            KernelInputError: fewer than 2 dims, NaN/inf, or ``K`` not a multiple of 32.
        """
        _check_quantisable(w)
        g = _check_k(w.shape[-1])
        grouped = w.detach().to(torch.float32).contiguous().view(*w.shape[:-1], g, MXFP4_GROUP)
        amax = grouped.abs().amax(dim=-1)
        if not bool(torch.isfinite(amax).all()):
            raise KernelInputError("w holds NaN or inf; MXFP4 quantisation needs finite weights")
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        exp = torch.ceil(torch.log2(safe / _E2M1_MAX)).to(torch.int32)
        s = torch.where(amax > 0, (exp + 127).clamp(0, 254), torch.zeros_like(exp))
        mag = grouped.abs() / _scale_values(s).unsqueeze(-1)  # a power of two: exact
        mids = torch.tensor(_MIDPOINTS, dtype=torch.float32)
        code = torch.bucketize(mag, mids)  # ties go down
        tie_odd = torch.isin(mag, mids) & (code % 2 == 1)  # ... to the even code instead
        code = (code + tie_odd.to(code.dtype)).clamp_(max=7)
        code = code | ((grouped < 0).to(code.dtype) << 3)
        code = code.to(torch.uint8)
        blocks = code[..., 0::2] | (code[..., 1::2] << 4)
        return blocks.contiguous(), s.to(torch.uint8).contiguous()

    @staticmethod
    def from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> Parts:  # type: ignore[override]
        """Adopt a checkpoint's ``(*_blocks, *_scales)`` pair as parts, without a copy.

        Args:
            blocks: uint8 ``[..., N, K/32, 16]`` as shipped (GPT-OSS: ``[E, 2I, H/32, 16]``).
            scales: uint8 ``[..., N, K/32]`` (E8M0 bytes).

        Returns:
            ``(blocks, scales)``: the inputs themselves when contiguous.

        Raises:
            KernelDTypeError: a dtype other than uint8.
            KernelInputError: shapes that do not pair up, or a NaN scale (255).
        """
        for what, t in (("blocks", blocks), ("scales", scales)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise KernelDTypeError(f"MXFP4 {what} must be uint8 (as shipped), got {got}")
        if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_GROUP // 2:
            raise KernelInputError(
                f"MXFP4 blocks must be [..., N, K/32, 16], got {list(blocks.shape)}"
            )
        if tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise KernelInputError(
                f"MXFP4 scales must be {list(blocks.shape[:-1])} (one per 32 inputs of blocks "
                f"{list(blocks.shape)}), got {list(scales.shape)}"
            )
        if bool((scales == _NAN_SCALE).any()):
            raise KernelInputError("MXFP4 scales hold 255 (E8M0 NaN); the checkpoint is corrupt")
        return blocks.contiguous(), scales.contiguous()

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``E2M1 * 2^(s - 127)`` in fp32 (exact), rounded once to ``dtype`` (default: compute)."""
        blocks, scales = parts
        codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).to(torch.long)
        w = _lut()[codes] * _scale_values(scales).unsqueeze(-1)
        return w.flatten(-2).to(dtype or self.compute_dtype)

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``blocks uint8 [N, K/32, 16]`` and ``scales uint8 [N, K/32]``."""
        g = _check_k(k)
        return (
            ("blocks", (n, g, MXFP4_GROUP // 2), torch.uint8),
            ("scales", (n, g), torch.uint8),
        )

    def select_rows(self, parts: Parts, index: torch.Tensor) -> Parts:
        """Parts of ``W[..., index, :]``: rows are independent (per-row scales), so a gather."""
        blocks, scales = parts
        return (
            blocks.index_select(-3, index).contiguous(),
            scales.index_select(-2, index).contiguous(),
        )

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]``: gate rows, then up rows (a copy of the bytes).

        Raises:
            KernelInputError: gate and up shapes differ.
        """
        if [g.shape for g in gate] != [u.shape for u in up]:
            raise KernelInputError(
                f"gate and up must have equal shapes, got {[list(g.shape) for g in gate]} vs "
                f"{[list(u.shape) for u in up]}"
            )
        return torch.cat([gate[0], up[0]], dim=-3), torch.cat([gate[1], up[1]], dim=-2)

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """Per output row: 2 (the E2M1 step between 4 and 6) x the row's largest scale."""
        return 2.0 * _scale_values(parts[1]).amax(dim=-1)


register_format("mxfp4", Mxfp4)
