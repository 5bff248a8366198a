"""Plain reads of single tensors from safetensors files, for ``load_pretrained``."""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kt_kernel
from moe_experts.errors import LoadError

__all__ = [
    "CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "ST_DTYPES",
    "Shards",
    "TensorEntry",
    "expect_shape",
    "read_header",
    "read_json",
    "weight_map",
]

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


# safetensors' own bound on the JSON header (its Rust reader refuses more): a length field
# beyond it is corruption, never a reason to allocate.
MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """One validated header entry: shape, dtype and absolute byte range in the file."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int


def read_json(text: str | bytes, where: object) -> Any:
    """``json.loads(text)``; invalid or too deeply nested JSON is a LoadError naming ``where``.

    Raises:
        LoadError: not valid JSON (UTF-8) or nested deeper than the interpreter can parse.
    """
    try:
        return json.loads(text)
    except RecursionError as exc:  # "[[[[..." a hundred thousand deep
        raise LoadError(
            f"{where}: the JSON is nested too deeply to parse; the file is corrupt or hostile"
        ) from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LoadError(f"{where}: not valid JSON ({exc})") from exc


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry(file: Path, key: str, raw: object, base: int, size: int) -> TensorEntry:
    """Validate one header entry against the safetensors rules and the file size."""
    where = f"{file}: tensor {key!r}"
    if not isinstance(raw, dict):
        raise LoadError(f"{where}: its header entry is {raw!r}, not a JSON object")
    dtype_name = raw.get("dtype")
    dtype = ST_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise LoadError(f"{where} has dtype {dtype_name!r}; expected one of {sorted(ST_DTYPES)}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise LoadError(f"{where} has shape {shape!r}; expected a list of non-negative ints")
    offsets = raw.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(x) for x in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= size - base
    ):
        raise LoadError(
            f"{where} has data_offsets {offsets!r}; expected [start, end] with "
            f"0 <= start <= end <= {size - base} (the data after the header)"
        )
    start, end = offsets
    numel = math.prod(shape)
    if end - start != numel * dtype.itemsize:
        raise LoadError(
            f"{where} has data_offsets {offsets!r} ({end - start} bytes), but {shape} "
            f"{dtype_name} holds {numel * dtype.itemsize}"
        )
    return TensorEntry(tuple(shape), dtype, base + start, base + end)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor entry of a safetensors file, validated before any data is read.

    Checks the header length against the file and :data:`MAX_HEADER_BYTES`, the JSON, each
    entry's dtype, shape and byte range (inside the data, sized for its shape and dtype), and
    that no two tensors share bytes, so no later read can reach the header or another tensor.

    Raises:
        LoadError: naming the file, and the tensor where one entry is at fault.
    """
    try:
        with file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise LoadError(
                    f"cannot read {file} as safetensors: {size} bytes, shorter than the "
                    "8-byte header length"
                )
            n = int.from_bytes(f.read(8), "little")
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise LoadError(
                    f"cannot read {file} as safetensors: its length field announces a header "
                    f"of {n} bytes, but the file has {size - 8} after it (safetensors headers "
                    f"are at most {MAX_HEADER_BYTES} bytes); the file is corrupt"
                )
            text = f.read(n)
    except OSError as exc:
        raise LoadError(f"cannot read {file} as safetensors: {exc}") from exc
    header = read_json(text, f"{file}: the safetensors header")
    if not isinstance(header, dict):
        raise LoadError(
            f"{file}: the safetensors header is a JSON {type(header).__name__}, not an object"
        )
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise LoadError(f"{file}: __metadata__ must map strings to strings, got {meta!r:.200}")
    base = 8 + n
    entries = {str(k): _entry(file, str(k), v, base, size) for k, v in header.items()}
    spans = sorted((e.start, e.end, k) for k, e in entries.items() if e.end > e.start)
    for (_, prev_end, prev), (start, _, key) in itertools.pairwise(spans):
        if start < prev_end:
            raise LoadError(
                f"{file}: tensor {key!r} overlaps tensor {prev!r} (their data_offsets share "
                "bytes); the file is corrupt"
            )
    return entries


# Bytes read and checked at a time: each chunk is scanned right after readinto wrote it, while
# the CPU may still hold it, instead of in a second pass over the whole tensor. The kernel's
# copy into fresh pages leaves most of it in memory, so the scan still mostly streams from
# memory (bench_load_checks.py: 1 MiB chunks measured a lower share than whole tensors).
# Large enough that the per-chunk calls (a few us) stay well under 1% of the read.
CHUNK_BYTES = 1 << 20


def _non_finite(t: torch.Tensor) -> bool:
    """Whether the float ``t`` holds NaN or +-inf (kt-kernel's exponent-bits test, no temporary)."""
    return not kt_kernel.all_finite(t)


class Shards:
    """Reads single tensors from safetensors files with plain reads into owned memory.

    Not a memory map: the pages of a mapped shard count as resident while it is mapped (a
    block's experts would stay resident once read), whereas ``readinto`` leaves them in the
    page cache only and every tensor owns aligned memory. Every header is validated once
    (:func:`read_header`) and every floating tensor is checked for NaN and inf as it is read,
    so a corrupt weight is named at load instead of surfacing as a diverged first step.
    """

    def __init__(self) -> None:
        """Start with no header read."""
        self._headers: dict[Path, dict[str, TensorEntry]] = {}

    def keys(self, file: Path) -> list[str]:
        """The tensor names in ``file``'s (validated) header."""
        return list(self._header(file))

    def _header(self, file: Path) -> dict[str, TensorEntry]:
        if file not in self._headers:
            self._headers[file] = read_header(file)
        return self._headers[file]

    def info(self, file: Path, key: str) -> tuple[tuple[int, ...], torch.dtype, int, int]:
        """``(shape, dtype, start, end)`` of ``key`` in ``file`` (absolute byte offsets)."""
        entry = self._header(file).get(key)
        if entry is None:
            raise LoadError(f"{file.name} has no tensor {key!r} although the index names it")
        return entry.shape, entry.dtype, entry.start, entry.end

    def _fill(self, file: Path, key: str, out: torch.Tensor, start: int, end: int) -> None:
        if end - start != out.numel() * out.element_size():
            raise LoadError(f"{file.name}: tensor {key!r} has a corrupt byte range")
        if not out.numel():
            return
        # FP8 bytes are checked where their scales are adopted (E4M3 has NaN, no inf).
        checked = out.dtype.is_floating_point and out.element_size() > 1
        flat = out.view(-1)
        buf = memoryview(flat.view(torch.uint8).numpy())
        size = out.element_size()
        step = max(size, CHUNK_BYTES - CHUNK_BYTES % size)  # whole elements per chunk
        with file.open("rb") as f:
            f.seek(start)
            for lo in range(0, end - start, step):
                hi = min(lo + step, end - start)
                if f.readinto(buf[lo:hi]) != hi - lo:
                    raise LoadError(f"{file.name} is truncated inside tensor {key!r}")
                if checked and _non_finite(flat[lo // size : hi // size]):
                    raise LoadError(
                        f"{file}: tensor {key!r} holds NaN or inf; the checkpoint is corrupt "
                        "(re-download or re-save it)"
                    )

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


def weight_map(path: Path, shards: Shards | None = None) -> dict[str, Path]:
    """``{checkpoint key: shard file}`` from the index, or from the single-file checkpoint.

    Args:
        path: the checkpoint directory.
        shards: the reader whose validated header gives a single file's keys (a new one if
            ``None``).

    Raises:
        LoadError: no index and no single file, an index that is not a JSON object mapping
            keys to existing shard files, or an unreadable single file.
    """
    index = path / _INDEX
    if index.is_file():
        try:
            text = index.read_bytes()
        except OSError as exc:
            raise LoadError(f"cannot read {index}: {exc}") from exc
        raw = read_json(text, index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            got = type(raw.get("weight_map") if isinstance(raw, dict) else raw).__name__
            raise LoadError(
                f"{index}: 'weight_map' is a JSON {got}, not an object of checkpoint key -> "
                "shard file (a safetensors index is a JSON object with a 'weight_map'); "
                "re-save the checkpoint"
            )
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise LoadError(
                f"{index}: 'weight_map' maps {bad[0]!r} to {bad[1]!r:.100}, not a shard file name"
            )
        out = {str(k): path / v for k, v in weight_map.items()}
        missing = sorted({str(f) for f in out.values() if not f.is_file()})
        if missing:
            raise LoadError(f"{index} names shard files that do not exist: {missing}")
        return out
    single = path / _SINGLE
    if single.is_file():
        return dict.fromkeys((shards or Shards()).keys(single), single)
    raise LoadError(
        f"{path} holds neither {_INDEX} nor {_SINGLE}; load_pretrained reads local safetensors "
        "checkpoints (save them with save_pretrained or download them first)"
    )
