"""Plain reads of single tensors from safetensors files, for ``load_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moe_experts.errors import LoadError

__all__ = ["ST_DTYPES", "Shards", "expect_shape", "weight_map"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"

# safetensors dtype names -> torch dtypes (the ones a checkpoint of these families uses).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def expect_shape(have: tuple[int, ...], shape: tuple[int, ...], key: str, file: Path) -> None:
    """Raise :class:`LoadError` naming ``key`` and ``file`` unless ``have == shape``."""
    if tuple(have) != tuple(shape):
        raise LoadError(
            f"{file.name}: tensor {key!r} has shape {list(have)}, the model expects "
            f"{list(shape)}; the checkpoint does not match its config.json"
        )


class Shards:
    """Reads single tensors from safetensors files with plain reads into owned memory.

    Not a memory map: the pages of a mapped shard count as resident while it is mapped (a
    block's experts would stay resident once read), whereas ``readinto`` leaves them in the
    page cache only and every tensor owns aligned memory.
    """

    def __init__(self) -> None:
        """Start with no header read."""
        self._headers: dict[Path, tuple[dict[str, Any], int]] = {}

    def _header(self, file: Path) -> tuple[dict[str, Any], int]:
        if file not in self._headers:
            try:
                with file.open("rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except (OSError, ValueError) as exc:
                raise LoadError(f"cannot read {file} as safetensors: {exc}") from exc
            header.pop("__metadata__", None)
            self._headers[file] = (header, 8 + size)
        return self._headers[file]

    def info(self, file: Path, key: str) -> tuple[tuple[int, ...], torch.dtype, int, int]:
        """``(shape, dtype, start, end)`` of ``key`` in ``file`` (absolute byte offsets)."""
        header, base = self._header(file)
        entry = header.get(key)
        if not isinstance(entry, dict):
            raise LoadError(f"{file.name} has no tensor {key!r} although the index names it")
        dtype = ST_DTYPES.get(entry.get("dtype", ""))
        if dtype is None:
            raise LoadError(f"{file.name}: tensor {key!r} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        return tuple(entry["shape"]), dtype, base + start, base + end

    def _fill(self, file: Path, key: str, out: torch.Tensor, start: int, end: int) -> None:
        if end - start != out.numel() * out.element_size():
            raise LoadError(f"{file.name}: tensor {key!r} has a corrupt byte range")
        if not out.numel():
            return
        buf = out.view(-1).view(torch.uint8).numpy()
        with file.open("rb") as f:
            f.seek(start)
            if f.readinto(buf) != end - start:
                raise LoadError(f"{file.name} is truncated inside tensor {key!r}")

    def read(self, file: Path, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor ``key`` in owned memory; with ``shape``, a mismatch is a LoadError."""
        have, dtype, start, end = self.info(file, key)
        if shape is not None:
            expect_shape(have, shape, key, file)
        out = torch.empty(have, dtype=dtype)
        self._fill(file, key, out, start, end)
        return out

    def read_into(self, file: Path, key: str, dst: torch.Tensor) -> None:
        """Read ``key`` straight into the contiguous ``dst`` (same shape and dtype), no copy.

        Raises:
            LoadError: the shape or dtype differs, or the file is corrupt.
        """
        have, dtype, start, end = self.info(file, key)
        expect_shape(have, tuple(dst.shape), key, file)
        if dtype != dst.dtype:
            raise LoadError(f"{file.name}: tensor {key!r} is {dtype}, expected {dst.dtype}")
        self._fill(file, key, dst, start, end)


def weight_map(path: Path) -> dict[str, Path]:
    """``{checkpoint key: shard file}`` from the index, or from the single-file checkpoint."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {exc}"
            ) from exc
        if not isinstance(weight_map, dict):
            raise LoadError(
                f"{index}: 'weight_map' is a JSON {type(weight_map).__name__}, not an "
                "object of checkpoint key -> shard file; re-save the checkpoint"
            )
        out = {str(k): path / str(v) for k, v in weight_map.items()}
        missing = sorted({str(f) for f in out.values() if not f.is_file()})
        if missing:
            raise LoadError(f"{index} names shard files that do not exist: {missing}")
        return out
    single = path / _SINGLE
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as exc:  # safetensors' SafetensorError derives from Exception only
            raise LoadError(f"cannot read {single} as safetensors: {exc}") from exc
    raise LoadError(
        f"{path} holds neither {_INDEX} nor {_SINGLE}; load_pretrained reads local safetensors "
        "checkpoints (save them with save_pretrained or download them first)"
    )
