"""The safetensors header: dtype codes, parsing and the checks made before allocating."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lora_checkpoint._jsonio import loads_bounded
from lora_checkpoint.errors import (
    CheckpointError,
    DtypeMismatchError,
    ShapeMismatchError,
    TruncatedFileError,
    UnexpectedTensorError,
)

# safetensors dtype codes; the manifest stores torch names, files store these codes.
DTYPE_TO_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CODE_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_CODE.items()}
NAME_TO_DTYPE: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in DTYPE_TO_CODE}

# safetensors refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A safetensors header nests at most 3 levels ({key: {"shape": [...]}}).
HEADER_DEPTH = 3
# torch indexes sizes and strides with int64: a shape whose element count (empty dimensions
# counted as 1, as the strides do) times the element size reaches this is refused.
MAX_TENSOR_BYTES = 1 << 62


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest's name for ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor described by a safetensors header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    end: int


def header_length(head: bytes | bytearray | memoryview, file: str, size: int) -> int:
    """Return the header length the 8-byte prefix gives, refusing one that is too big or
    longer than the file (before anything is allocated for it).

    Raises:
        TruncatedFileError, CheckpointError: naming the file.
    """
    if size < 8 or len(head) < 8:
        raise TruncatedFileError(f"{file}: {size} bytes is too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(head[:8]))
    if hlen > MAX_HEADER_BYTES:
        raise CheckpointError(f"{file}: header length {hlen} exceeds {MAX_HEADER_BYTES} bytes")
    if 8 + hlen > size:
        raise TruncatedFileError(
            f"{file}: header says {hlen} header bytes but the file has only {size} bytes"
        )
    return int(hlen)


def parse_header(
    buf: bytes | bytearray | memoryview, file: str, size: int | None = None
) -> tuple[int, dict[str, HeaderEntry]]:
    """Parse and validate a safetensors header.

    Args:
        buf: at least the first ``8 + header_len`` bytes of the file.
        file: the file's name, for error messages.
        size: the whole file's size (default ``len(buf)``), to check that the data section
            is complete.

    Returns:
        ``(data_start, entries)``: where the data section begins and key -> entry.

    Raises:
        TruncatedFileError: if the file ends inside the header or the data.
        CheckpointError: if the header is not valid safetensors.
    """
    if size is None:
        size = len(buf)
    hlen = header_length(buf, file, size)
    if 8 + hlen > len(buf):
        raise TruncatedFileError(f"{file}: only {len(buf)} bytes of the header were given")
    raw = loads_bounded(
        bytes(buf[8 : 8 + hlen]), file, "safetensors header", max_depth=HEADER_DEPTH
    )
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: safetensors header must be a JSON object")
    data_len = size - 8 - hlen
    entries: dict[str, HeaderEntry] = {}
    end_max = 0
    for key, spec in raw.items():
        if key == "__metadata__":
            continue
        try:
            dtype = CODE_TO_DTYPE[spec["dtype"]]
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{file}: bad header entry for key {key!r}: {spec!r}") from exc
        if any(s < 0 for s in shape) or math.prod(max(s, 1) for s in shape) * dtype.itemsize >= (
            MAX_TENSOR_BYTES
        ):
            raise CheckpointError(
                f"{file}: key {key!r} has shape {list(shape)[:8]}, which no tensor can have "
                "(negative or too large a dimension); the header is corrupted"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != nbytes:
            raise CheckpointError(
                f"{file}: key {key!r}: data_offsets {[begin, end]} do not hold shape "
                f"{list(shape)} of {dtype_name(dtype)} ({nbytes} bytes)"
            )
        end_max = max(end_max, end)
        entries[key] = HeaderEntry(dtype, shape, begin, end)
    if end_max > data_len:
        raise TruncatedFileError(
            f"{file}: tensors need {end_max} data bytes but only {data_len} are present"
        )
    return 8 + hlen, entries


def match_manifest(
    name: str,
    entries: Mapping[str, HeaderEntry],
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
) -> None:
    """Refuse a header whose keys, shapes or dtypes differ from the manifest's (before any
    tensor is allocated: a header may only ask for what the manifest recorded).

    Raises:
        UnexpectedTensorError, ShapeMismatchError, DtypeMismatchError: naming file and key.
    """
    for key, e in entries.items():
        if key not in expected:
            raise UnexpectedTensorError(f"{name}: key {key!r} is not listed in the manifest")
        dtype, shape = expected[key]
        if e.shape != shape:
            raise ShapeMismatchError(
                f"{name}: key {key!r} has shape {list(e.shape)[:8]}, the manifest expects "
                f"{list(shape)}"
            )
        if dtype_name(e.dtype) != dtype:
            raise DtypeMismatchError(
                f"{name}: key {key!r} has dtype {dtype_name(e.dtype)}, the manifest expects {dtype}"
            )
