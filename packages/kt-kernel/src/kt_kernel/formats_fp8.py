"""FP8 E4M3 weights with 128x128 block scales (DeepSeek-V3/R1, Kimi-K2): :class:`Fp8Block`.

Storage of one projection ``W [..., N, K]`` (parts, in the native loader's order):

- ``weight`` ``torch.float8_e4m3fn [..., N, K]``;
- ``scale_inv`` float32 ``[..., ceil(N/128), ceil(K/128)]``.

``W[n, k] = float(weight[n, k]) * scale_inv[n // 128, k // 128]`` formed in fp32 (one
rounding of the exact product), the checkpoints' ``weight_scale_inv`` convention, the same as
transformers' finegrained-FP8 dequantisation; bf16 tiles are that value rounded once more, to
nearest even. Memory: ``(1 + 4/128^2) / 2`` of bf16, 0.5001x.

Checkpoint tensors are adopted as they are (:meth:`Fp8Block.from_checkpoint`, no bf16 copy);
dense weights can also be quantised (``scale_inv = max|block| / 448``).
"""

from __future__ import annotations

import math
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

__all__ = ["FP8_BLOCK", "Fp8Block"]

FP8_BLOCK = 128  # rows and columns per scale block
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


class Fp8Block(StackedFormat):
    """E4M3 weights, one fp32 ``scale_inv`` per 128x128 block; tiles dequantised in C++."""

    name = "fp8"
    weight_dtype = "fp8"
    block_size = FP8_BLOCK  # rows and columns per scale block
    # As INT8: a task dequantises its expert's weight tiles once, so tall tasks amortise it.
    tile_rows = 512
    # Against a dense kernel on the same weights, measured on the 37 tiny families (gaussian
    # weights): <= 8.2e-2.
    self_check_tolerance = 0.15

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        """Compute in ``compute_dtype`` (``torch.bfloat16``, the default, or ``torch.float32``).

        Raises:
            KernelDTypeError: an unusable compute dtype.
        """
        compute_dtype = check_tiled_compute("fp8", compute_dtype or torch.bfloat16)
        self.compute_dtype = compute_dtype

    def quantize(self, w: torch.Tensor) -> Parts:
        """``(weight e4m3 [..., N, K], scale_inv fp32 [..., ceil(N/128), ceil(K/128)])``.

        ``scale_inv = max|block| / 448``; ``weight = e4m3(clamp(w / scale_inv, +-448))``
        (round to nearest even). An all-zero block gets scale_inv 0.

        Raises:
            KernelDTypeError: ``w`` is not floating point.
            KernelInputError: ``w`` has fewer than 2 dims or holds NaN/inf.
        """
        _check_quantisable(w)
        lead, (n, k) = w.shape[:-2], w.shape[-2:]
        nb, kb = _blocks(n), _blocks(k)
        w32 = torch.zeros((*lead, nb * FP8_BLOCK, kb * FP8_BLOCK), dtype=torch.float32)
        w32[..., :n, :k] = w.detach().to(torch.float32)
        blocks = w32.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
        amax = blocks.abs().amax(dim=(-3, -1))
        if not bool(torch.isfinite(amax).all()):
            raise KernelInputError("w holds NaN or inf; FP8 quantisation needs finite weights")
        scale_inv = amax / _FP8_MAX
        safe = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
        q = (blocks / safe[..., :, None, :, None]).clamp_(-_FP8_MAX, _FP8_MAX)
        q = q.reshape(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k]
        return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()

    checkpoint_suffixes = ("", "_scale_inv")  # ``P.weight`` and ``P.weight_scale_inv``

    @classmethod
    def matches_checkpoint(cls, quantization_config: Mapping[str, Any]) -> bool:
        """A FP8-block checkpoint: ``quant_method`` ``"fp8"`` (DeepSeek-V3, Kimi-K2)."""
        return quantization_config.get("quant_method") == "fp8"

    @classmethod
    def check_checkpoint_config(cls, quantization_config: Mapping[str, Any]) -> None:
        """Refuse block sizes other than 128x128, static activations and other scale formats.

        Raises:
            KernelInputError: naming the ``quantization_config`` field and the supported value.
        """
        cfg = quantization_config
        block = cfg.get("weight_block_size")
        if block is None or list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise KernelInputError(
                f"quantization_config.weight_block_size is {block}; kt-kernel's FP8 format has "
                f"one scale per [{FP8_BLOCK}, {FP8_BLOCK}] block (DeepSeek-V3's layout) only; "
                "re-quantise with 128x128 blocks or dequantise the checkpoint"
            )
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise KernelInputError(
                f"quantization_config.activation_scheme is {scheme!r}; only 'dynamic' is "
                "supported (the kernel computes activations in bf16, there are no static "
                "activation scales to use)"
            )
        for field, ok in (("scale_fmt", "float"), ("expert_dtype", "fp8")):
            if cfg.get(field, ok) != ok:
                raise KernelInputError(
                    f"quantization_config.{field} is {cfg[field]!r}; only {ok!r} (float32 or "
                    "bfloat16 scales over E4M3 weights) is supported"
                )

    @staticmethod
    def from_checkpoint(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> Parts:  # type: ignore[override]
        """Adopt a checkpoint's ``(weight, weight_scale_inv)`` pair as parts, without a copy.

        Args:
            weight: ``torch.float8_e4m3fn [..., N, K]`` as shipped (e.g. one expert's
                ``down_proj.weight`` or a stacked ``[E, N, K]``).
            weight_scale_inv: ``[..., ceil(N/128), ceil(K/128)]``, float32 (kept as is) or
                bfloat16 / float8_e8m0fnu (widened to float32 exactly; the scales are small).

        Returns:
            ``(weight, scale_inv)``: views of the inputs when they are contiguous float32.

        Raises:
            KernelDTypeError: a dtype other than the above.
            KernelInputError: the scale grid does not match the weight's 128x128 blocks, a
                weight byte is NaN (E4M3 has no inf), or a scale is negative, NaN or inf.
        """
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn:
            got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise KernelDTypeError(
                f"weight must be torch.float8_e4m3fn (the checkpoint's FP8 tensor), got {got}"
            )
        wide = (torch.float32, torch.bfloat16, getattr(torch, "float8_e8m0fnu", torch.float32))
        if not isinstance(weight_scale_inv, torch.Tensor) or weight_scale_inv.dtype not in wide:
            got = (
                weight_scale_inv.dtype
                if isinstance(weight_scale_inv, torch.Tensor)
                else type(weight_scale_inv).__name__
            )
            raise KernelDTypeError(
                f"weight_scale_inv must be float32, bfloat16 or float8_e8m0fnu, got {got}"
            )
        if weight.dim() < 2:
            raise KernelInputError(f"weight must be [..., N, K], got {list(weight.shape)}")
        lead, (n, k) = weight.shape[:-2], weight.shape[-2:]
        want = (*lead, _blocks(n), _blocks(k))
        if tuple(weight_scale_inv.shape) != want:
            raise KernelInputError(
                f"weight_scale_inv must have shape {list(want)} (128x128 blocks of weight "
                f"{list(weight.shape)}), got {list(weight_scale_inv.shape)}; only the "
                "[128, 128] weight_block_size is supported"
            )
        if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise KernelInputError(
                "weight holds NaN (E4M3 byte 0x7F/0xFF); the checkpoint is corrupt"
            )
        scale = weight_scale_inv.to(torch.float32).contiguous()
        if scale.numel():
            # scale_inv = max|block| / 448 >= 0; NaN fails the comparison as well.
            lo, hi = torch.aminmax(scale.view(-1))
            if not (float(lo) >= 0.0 and math.isfinite(float(hi))):
                raise KernelInputError(
                    f"weight_scale_inv holds a negative, NaN or inf scale (min {float(lo)}, "
                    f"max {float(hi)}); block scales are finite and >= 0, the checkpoint is "
                    "corrupt"
                )
        return weight.contiguous(), scale

    def fuse_gate_up(self, gate: Parts, up: Parts) -> Parts:
        """Parts of ``gate_up [..., 2I, H]`` from separately shipped gate and up parts.

        Stacks the E4M3 bytes and the scale grids along the output dim (a copy of the FP8
        data, never a bf16 one); needs ``I`` to be a multiple of 128 so no block straddles
        gate and up.

        Raises:
            KernelInputError: ``I`` is not a multiple of 128 or the shapes disagree.
        """
        (gw, gs), (uw, us) = gate, up
        if gw.shape != uw.shape or gs.shape != us.shape:
            raise KernelInputError(
                f"gate and up must have equal shapes, got weight {list(gw.shape)} vs "
                f"{list(uw.shape)}, scale_inv {list(gs.shape)} vs {list(us.shape)}"
            )
        if gw.shape[-2] % FP8_BLOCK:
            raise KernelInputError(
                f"fusing FP8 gate and up needs I = {gw.shape[-2]} to be a multiple of 128; "
                "quantise the fused weights with from_fused(..., weight_dtype='fp8') instead"
            )
        return torch.cat([gw, uw], dim=-2), torch.cat([gs, us], dim=-2)

    def dequantize(self, parts: Parts, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``weight * scale_inv`` per block in fp32, rounded once to ``dtype`` (default compute)."""
        weight, scale_inv = parts
        n, k = weight.shape[-2:]
        out = torch.empty(weight.shape, dtype=dtype or self.compute_dtype)
        # One 128-row slab of one matrix at a time: the fp32 transient stays that small
        # (load_pretrained dequantises whole checkpoint tensors through here).
        flat = zip(
            weight.reshape(-1, n, k),
            scale_inv.reshape(-1, *scale_inv.shape[-2:]),
            out.view(-1, n, k),
            strict=True,
        )
        for w, s, o in flat:
            for i in range(s.shape[0]):
                rows = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK)
                o[rows] = (w[rows].to(torch.float32) * s[i].repeat_interleave(FP8_BLOCK)[:k]).to(
                    o.dtype
                )
        return out

    def part_specs(self, n: int, k: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """``weight e4m3 [N, K]`` and ``scale_inv fp32 [ceil(N/128), ceil(K/128)]``."""
        return (
            ("weight", (n, k), torch.float8_e4m3fn),
            ("scale_inv", (_blocks(n), _blocks(k)), torch.float32),
        )

    def row_steps(self, parts: Parts) -> torch.Tensor:
        """Per output row: 32 (the E4M3 step at its top binade) x the row's largest scale."""
        weight, scale_inv = parts
        n = weight.shape[-2]
        top = scale_inv.amax(dim=-1).repeat_interleave(FP8_BLOCK, dim=-1)[..., :n]
        return 32.0 * top


register_format("fp8", Fp8Block)
