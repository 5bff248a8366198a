"""FP8-block checkpoints (DeepSeek-V3 style) for :func:`moe_experts.load_pretrained`.

Such a checkpoint stores a projection as ``<name>.weight`` in ``float8_e4m3fn`` plus
``<name>.weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]`` (one scale per 128x128
block, ``W = weight * scale_inv``), and says so in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], ...}

The experts keep that storage: their bytes and scales are read straight into the banks of
kt-kernel's :class:`~kt_kernel.formats_fp8.Fp8Block` format (no bf16 copy is ever made). Dense
FP8 weights (attention, shared experts, dense MLPs) are dequantised to the model dtype as
transformers does it (``weight * scale_inv`` formed in fp32, rounded once), and the model is
built without its ``quantization_config`` so its dense layers are plain modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kt_kernel import Fp8Block, KernelDTypeError, KernelInputError
from moe_experts._safetensors import Shards, expect_shape
from moe_experts.errors import LoadError

__all__ = [
    "SCALE_SUFFIX",
    "Fp8Reader",
    "check_quantization_config",
    "read_fp8_bank",
]

SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = Fp8Block.block_size  # rows and columns per scale block


def check_quantization_config(config_file: Path, raw: object) -> bool:
    """Whether ``config.json``'s ``quantization_config`` declares 128x128 FP8 blocks.

    Args:
        config_file: the ``config.json`` (for messages).
        raw: its ``quantization_config`` value, ``None`` when absent.

    Returns:
        ``True`` for a supported FP8-block config, ``False`` when there is none.

    Raises:
        LoadError: another quantisation method, block size, activation scheme or scale format.
    """
    if raw is None:
        return False
    cfg: dict[str, Any] = raw if isinstance(raw, dict) else getattr(raw, "__dict__", {})
    method = str(cfg.get("quant_method", ""))
    if method != "fp8":
        raise LoadError(
            f"{config_file}: quantization_config.quant_method is {method!r}; load_pretrained "
            "streams unquantised checkpoints and FP8-block ones (quant_method 'fp8', DeepSeek-V3 "
            "style); dequantise this checkpoint first"
        )
    block = cfg.get("weight_block_size")
    if block is None or list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise LoadError(
            f"{config_file}: quantization_config.weight_block_size is {block}; kt-kernel's FP8 "
            f"format has one scale per [{FP8_BLOCK}, {FP8_BLOCK}] block (DeepSeek-V3's layout) "
            "only; re-quantise with 128x128 blocks or dequantise the checkpoint"
        )
    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise LoadError(
            f"{config_file}: quantization_config.activation_scheme is {scheme!r}; only "
            "'dynamic' is supported (the kernel computes activations in bf16, there are no "
            "static activation scales to use)"
        )
    for field, ok in (("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if cfg.get(field, ok) != ok:
            raise LoadError(
                f"{config_file}: quantization_config.{field} is {cfg[field]!r}; only {ok!r} "
                "(float32 or bfloat16 scales over E4M3 weights) is supported"
            )
    return True


class Fp8Reader:
    """Reads checkpoint tensors, dequantising FP8 ones that come with a ``weight_scale_inv``."""

    def __init__(self, shards: Shards, where: Mapping[str, Path], fp8: bool) -> None:
        """Pair every ``*_scale_inv`` key with its weight.

        Raises:
            LoadError: a scale without its weight, or scales in a checkpoint whose
                ``config.json`` declares no FP8 quantisation.
        """
        self.shards = shards
        self.where = where
        self.scales: dict[str, str] = {}
        for key in where:
            if not key.endswith(SCALE_SUFFIX):
                continue
            weight = key.removesuffix(SCALE_SUFFIX)
            if weight not in where:
                raise LoadError(
                    f"{where[key].name}: tensor {key!r} is a block scale without its weight "
                    f"{weight!r}; the checkpoint is incomplete"
                )
            if not fp8:
                raise LoadError(
                    f"{where[key].name}: tensor {key!r} is a FP8 block scale, but config.json "
                    "has no quantization_config {'quant_method': 'fp8', 'weight_block_size': "
                    "[128, 128]}; add it (the checkpoint is FP8) or remove the scales"
                )
            self.scales[weight] = key

    def parts(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight e4m3 shape, scale_inv fp32 grid)`` of a FP8 ``key``, validated.

        Raises:
            LoadError: naming the key and file: no scale, not E4M3, a wrong shape or scale grid,
                or NaN bytes.
        """
        file = self.where[key]
        scale_key = self._scale_key(key)
        weight = self.shards.read(file, key, shape)
        scale = self.shards.read(self.where[scale_key], scale_key)
        return self._adopt(key, file, scale_key, weight, scale)

    def _scale_key(self, key: str) -> str:
        scale_key = self.scales.get(key)
        if scale_key is None:
            raise LoadError(
                f"{self.where[key].name}: tensor {key!r} is float8_e4m3fn but the checkpoint "
                f"has no {key + SCALE_SUFFIX!r} beside it (a FP8-block checkpoint ships one "
                "per weight)"
            )
        return scale_key

    def _adopt(
        self, key: str, file: Path, scale_key: str, weight: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.dtype != torch.float8_e4m3fn:
            raise LoadError(
                f"{file.name}: tensor {key!r} has a {scale_key!r} but is {weight.dtype}; "
                "scaled weights must be float8_e4m3fn"
            )
        try:
            return Fp8Block.from_checkpoint(weight, scale)
        except (KernelDTypeError, KernelInputError) as exc:
            raise LoadError(
                f"{self.where[scale_key].name}: {scale_key!r} does not fit {key!r}: {exc}"
            ) from exc

    def read(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``key`` in ``dtype`` (floating point) or as stored (others); FP8 is dequantised.

        FP8 values are ``weight * scale_inv`` formed in fp32 and rounded once to ``dtype``.

        Raises:
            LoadError: a mis-shaped tensor, an integer one where ``dtype`` is floating point,
                or a FP8 one without a valid scale.
        """
        file = self.where[key]
        stored = self.shards.info(file, key)[1]
        if stored == torch.float8_e4m3fn or key in self.scales:
            return _dequantize(*self.parts(key, shape), dtype)
        if dtype.is_floating_point and not stored.is_floating_point:
            # torch would cast the integers silently (experts) or refuse the parameter late.
            raise LoadError(
                f"{file.name}: tensor {key!r} is {stored}, but the model's weight is {dtype}; "
                "a checkpoint stores its weights as floating point (the file is corrupt or "
                "was saved from another model)"
            )
        t = self.shards.read(file, key, shape)
        return t.to(dtype) if t.dtype.is_floating_point else t

    def is_fp8(self, key: str) -> bool:
        """Whether ``key`` is a scaled FP8 weight."""
        return key in self.scales


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale_inv`` per block in fp32, rounded once to ``dtype``, 128 rows at a time.

    The same values as :meth:`Fp8Block.dequantize` (one fp32 product per element), without
    its weight-sized fp32 temporaries: the transient is one 128-row slab of one matrix.
    """
    n, k = weight.shape[-2:]
    out = torch.empty(weight.shape, dtype=dtype)
    flat_w, flat_s, flat_out = (
        weight.view(-1, n, k),
        scale.view(-1, *scale.shape[-2:]),
        out.view(-1, n, k),
    )
    for w, s, o in zip(flat_w, flat_s, flat_out, strict=True):
        for i in range(s.shape[0]):
            rows = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK)
            cols = s[i].repeat_interleave(FP8_BLOCK)[:k]
            o[rows] = (w[rows].to(torch.float32) * cols).to(dtype)
    return out


def read_fp8_bank(
    reader: Fp8Reader,
    slots: list[tuple[str, str, int | None]],
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
    label: str,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One block's FP8 parts, ``(gate_up (weight, scale_inv), down (weight, scale_inv))``.

    The E4M3 bytes and scales are read straight into ``[E, 2I, H]``/``[E, H, I]`` banks (and
    their ``[E, *, *]`` scale grids): gate rows first, then up, as kt-kernel fuses them.

    Args:
        reader: the checkpoint reader.
        slots: ``(key, "gate"|"up"|"down"|"gate_up", expert or None for fused keys)``.
        shapes: ``([E, 2I, H], [E, H, I])``.
        label: the experts module name (for messages).

    Raises:
        LoadError: naming the key and file, for any tensor that is not FP8 with a matching
            128x128 scale grid, or an ``I`` that is not a multiple of 128 with per-expert keys.
    """
    (e, two_i, h), _ = shapes
    inter = two_i // 2
    ib, hb = -(-inter // FP8_BLOCK), -(-h // FP8_BLOCK)
    if any(x is not None for _, _, x in slots) and inter % FP8_BLOCK:
        raise LoadError(
            f"{label}: per-expert FP8 gate and up weights with I = {inter} (not a multiple of "
            f"{FP8_BLOCK}) cannot share one gate_up scale grid; load with weight_dtype='bf16' "
            "to dequantise them"
        )
    gu = (
        torch.empty((e, two_i, h), dtype=torch.float8_e4m3fn),
        torch.empty((e, -(-two_i // FP8_BLOCK), hb), dtype=torch.float32),
    )
    dn = (
        torch.empty((e, h, inter), dtype=torch.float8_e4m3fn),
        torch.empty((e, hb, ib), dtype=torch.float32),
    )
    for key, role, x in slots:
        bank = dn if role == "down" else gu
        w_dst, s_dst = bank if x is None else (bank[0][x], bank[1][x])
        if role in ("gate", "up"):
            half = slice(0, inter) if role == "gate" else slice(inter, two_i)
            s_half = slice(0, ib) if role == "gate" else slice(ib, 2 * ib)
            w_dst, s_dst = w_dst[half], s_dst[s_half]
        _read_pair(reader, key, w_dst, s_dst)
    # The banks are the parts: each slice was adopted (validated) by Fp8Block.from_checkpoint
    # as it was read, so no bank-sized temporary is ever made.
    return gu, dn


def _read_pair(reader: Fp8Reader, key: str, w_dst: torch.Tensor, s_dst: torch.Tensor) -> None:
    """Read ``key`` and its scale straight into the bank slices, checking dtypes and grid."""
    shards, where = reader.shards, reader.where
    file = where[key]
    scale_key = reader._scale_key(key)
    shape, dtype = shards.info(file, key)[:2]
    expect_shape(shape, tuple(w_dst.shape), key, file)
    if dtype != torch.float8_e4m3fn:
        raise LoadError(
            f"{file.name}: expert tensor {key!r} is {dtype}; the experts of a FP8 checkpoint "
            "must all be float8_e4m3fn with a weight_scale_inv"
        )
    scale_file = where[scale_key]
    grid, scale_dtype = shards.info(scale_file, scale_key)[:2]
    if tuple(grid) != tuple(s_dst.shape):
        raise LoadError(
            f"{scale_file.name}: tensor {scale_key!r} has shape {list(grid)}, the 128x128 block "
            f"grid of {key!r} {list(shape)} is {list(s_dst.shape)}; the checkpoint's "
            "weight_block_size must be [128, 128]"
        )
    shards.read_into(file, key, w_dst)
    if scale_dtype == torch.float32:
        shards.read_into(scale_file, scale_key, s_dst)
    elif scale_dtype == torch.bfloat16:
        s_dst.copy_(shards.read(scale_file, scale_key))  # widening to fp32 is exact
    else:
        raise LoadError(
            f"{scale_file.name}: tensor {scale_key!r} is {scale_dtype}; FP8 block scales must "
            "be float32 or bfloat16"
        )
    reader._adopt(key, file, scale_key, w_dst, s_dst)  # NaN bytes, named by key
