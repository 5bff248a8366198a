"""Quantised checkpoints whose weights ship in a kt-kernel format, for ``load_pretrained``.

``config.json``'s ``quantization_config`` names the format: the row of
:data:`kt_kernel.FORMATS` whose ``matches_checkpoint`` accepts it (FP8 blocks for
``quant_method: fp8``, DeepSeek-V3 style; MXFP4 for ``quant_method: mxfp4``, GPT-OSS). That
row also says how a parameter ``P`` is shipped, as the tensors ``P + suffix`` for each of its
``checkpoint_suffixes`` (FP8: ``P.weight`` and ``P.weight_scale_inv``; MXFP4: ``P_blocks`` and
``P_scales``), and adopts them as its parts (``from_checkpoint``). Nothing here names a
format: a new one is read as soon as kt-kernel registers it.

The experts keep that storage: their shipped parts become the kernel's (no bf16 copy is ever
made). Shipped dense weights (FP8 attention, shared experts, dense MLPs) are dequantised to
the model dtype as transformers does it (formed in fp32, rounded once), and the model is built
without its ``quantization_config`` so its dense layers are plain modules. Shipped parts are
``[..., out, in]`` (quantisation blocks run along the input), whatever the orientation of the
model's own parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import kt_kernel
from kt_kernel import KernelDTypeError, KernelInputError
from kt_kernel.formats import StackedFormat
from moe_experts._safetensors import Shards
from moe_experts.errors import LoadError

__all__ = ["ShippedFormat", "ShippedReader", "shipped_format"]


class ShippedFormat:
    """The kt-kernel format a quantised checkpoint ships, as :data:`kt_kernel.FORMATS` has it.

    Attributes:
        name: the format's name in :data:`kt_kernel.FORMATS`.
        factory: its row there.
        format: the format computing in bf16 (to dequantise and to describe parts).
    """

    def __init__(self, name: str, factory: type[StackedFormat]) -> None:
        """The format registered as ``name``, whose row is the format class ``factory``."""
        self.name = name
        self.factory = factory
        self.format: kt_kernel.WeightFormat = kt_kernel.FORMATS[name](torch.bfloat16)

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The checkpoint tensors a parameter ``P`` is shipped as: ``P + suffix`` each."""
        return tuple(self.factory.checkpoint_suffixes)


def shipped_format(config_file: Path, raw: object) -> ShippedFormat | None:
    """The format a ``quantization_config`` ships, checked; ``None`` when there is none.

    Args:
        config_file: the ``config.json`` (for messages).
        raw: its ``quantization_config`` value (a dict or transformers' config object).

    Raises:
        LoadError: no registered format reads this ``quant_method``, or the format refuses an
            option of it (an FP8 block size other than 128x128, ...).
    """
    if raw is None:
        return None
    cfg: dict[str, Any] = raw if isinstance(raw, dict) else getattr(raw, "__dict__", {})
    method = cfg.get("quant_method")
    try:
        name = kt_kernel.auto_format(torch.float32, cfg)
    except KernelDTypeError:
        shipped = [n for n, f in kt_kernel.FORMATS.items() if f.checkpoint_suffixes]
        raise LoadError(
            f"{config_file}: quantization_config.quant_method is {method!r}; load_pretrained "
            f"streams unquantised checkpoints and those shipped in a kt-kernel format "
            f"({', '.join(shipped)}); dequantise this checkpoint first"
        ) from None
    factory = kt_kernel.FORMATS[name]
    if not (isinstance(factory, type) and issubclass(factory, StackedFormat)):
        raise LoadError(
            f"{config_file}: quant_method {method!r} matches weight format {name!r}, which is "
            "not a format class that adopts checkpoint tensors (a kt_kernel StackedFormat)"
        )
    try:
        factory.check_checkpoint_config(cfg)
    except KernelInputError as exc:
        raise LoadError(f"{config_file}: {exc}") from exc
    return ShippedFormat(name, factory)


class ShippedReader:
    """Reads checkpoint tensors; a parameter shipped as format parts is adopted or dequantised.

    Attributes:
        shards: the safetensors reader.
        where: checkpoint key -> shard file.
        shipped: the checkpoint's format, ``None`` for an unquantised checkpoint.
        parts: parameter key -> its shipped tensors' keys (in ``from_checkpoint`` order).
    """

    def __init__(
        self, shards: Shards, where: Mapping[str, Path], shipped: ShippedFormat | None
    ) -> None:
        """Pair every shipped parameter with its tensors.

        Raises:
            LoadError: a part without its siblings, or a complete set of another registered
                format's parts in a checkpoint whose ``config.json`` does not declare it.
        """
        self.shards = shards
        self.where = where
        self.shipped = shipped
        self.parts: dict[str, tuple[str, ...]] = {}
        for name, factory in kt_kernel.FORMATS.items():
            suffixes = tuple(factory.checkpoint_suffixes)
            own = shipped is not None and name == shipped.name
            for key in where:
                for suffix in (s for s in suffixes if s):
                    if not key.endswith(suffix):
                        continue
                    base = key.removesuffix(suffix)
                    keys = tuple(base + s for s in suffixes)
                    missing = [k for k in keys if k not in where]
                    if own and missing:
                        raise LoadError(
                            f"{where[key].name}: tensor {key!r} is a {name} part without "
                            f"{missing}; the checkpoint is incomplete"
                        )
                    if missing:
                        continue
                    if not own:
                        raise LoadError(
                            f"{where[key].name}: tensor {key!r} is a {name} checkpoint part, "
                            f"but config.json has no quantization_config for {name!r}; add it "
                            "(the checkpoint is quantised) or remove the tensor"
                        )
                    self.parts[base] = keys

    def param_keys(self) -> list[str]:
        """The checkpoint's parameter keys: plain tensors, and shipped parameters by name."""
        members = {k for base, keys in self.parts.items() for k in keys if k != base}
        plain = [k for k in self.where if k not in members]
        return plain + [b for b in self.parts if b not in self.where]

    def file(self, key: str) -> Path:
        """The shard holding ``key`` (a shipped parameter's first part)."""
        return self.where[self.parts[key][0]] if key in self.parts else self.where[key]

    def ships(self, key: str) -> bool:
        """Whether ``key`` is shipped as format parts."""
        return key in self.parts

    def missing_parts(self, key: str, dtype: torch.dtype) -> LoadError:
        """The error for ``key``, stored in ``dtype``, where its shipped parts are expected."""
        suffixes = self.shipped.suffixes if self.shipped is not None else ()
        name = self.shipped.name if self.shipped is not None else "quantised"
        want = [key + s for s in suffixes if s]
        return LoadError(
            f"{self.where[key].name}: tensor {key!r} is {str(dtype).removeprefix('torch.')} "
            f"but the checkpoint has no {want} beside it (a {name} checkpoint ships them per "
            "weight)"
        )

    def read_parts(self, key: str) -> tuple[torch.Tensor, ...]:
        """The format's parts of the shipped parameter ``key``, adopted and validated.

        Raises:
            LoadError: naming the keys and file: a wrong dtype, mismatched shapes, or values
                the format refuses (NaN bytes or scales).
        """
        if self.shipped is None or key not in self.parts:
            raise LoadError(f"{self.file(key).name}: tensor {key!r} is not shipped as parts")
        keys = self.parts[key]
        tensors = [self.shards.read(self.where[k], k) for k in keys]
        try:
            return self.shipped.factory.from_checkpoint(*tensors)
        except KernelDTypeError as exc:
            raise LoadError(
                f"{self.where[keys[0]].name}: tensor {keys[0]!r} is {tensors[0].dtype}; as a "
                f"{self.shipped.name} parameter shipped with {keys[1:]} it must be the format's "
                f"own dtype: {exc}"
            ) from exc
        except KernelInputError as exc:
            others = ", ".join(repr(k) for k in keys[1:])
            raise LoadError(
                f"{self.where[keys[-1]].name}: {others} does not fit {keys[0]!r}: {exc}"
            ) from exc

    def read(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``key`` in ``dtype`` (floating point) or as stored (others); shipped ones dequantised.

        Shipped values are formed in fp32 and rounded once to ``dtype`` (the format's
        ``dequantize``); ``shape`` is then the ``[..., out, in]`` of the parts.

        Raises:
            LoadError: a mis-shaped tensor, an integer one where ``dtype`` is floating point,
                or shipped parts that do not fit.
        """
        if key in self.parts and self.shipped is not None:  # parts exist only then
            t = self.shipped.format.dequantize(self.read_parts(key), dtype)
            if tuple(t.shape) != tuple(shape):
                raise LoadError(
                    f"{self.file(key).name}: tensor {key!r} dequantises to shape "
                    f"{list(t.shape)}, the model expects {list(shape)}; the checkpoint does "
                    "not match its config.json"
                )
            return t
        file = self.where[key]
        stored = self.shards.info(file, key)[1]
        if self.shipped is not None and stored.is_floating_point and stored.itemsize == 1:
            raise self.missing_parts(key, stored)  # 8-bit floats without their scales
        if dtype.is_floating_point and not stored.is_floating_point:
            # torch would cast the integers silently (experts) or refuse the parameter late.
            raise LoadError(
                f"{file.name}: tensor {key!r} is {stored}, but the model's weight is {dtype}; "
                "a checkpoint stores its weights as floating point (the file is corrupt or "
                "was saved from another model)"
            )
        t = self.shards.read(file, key, shape)
        return t.to(dtype) if t.dtype.is_floating_point else t
