"""Streaming safetensors writer and reader that hash the bytes they move.

We write the safetensors format ourselves (8-byte little-endian header length, JSON header,
contiguous data) so each tensor's bytes are hashed from the same memory that is written,
without an extra copy; the files are byte-compatible with ``safetensors.torch.load_file``.
Reading never unpickles anything: it parses JSON and wraps raw bytes with ``torch.frombuffer``.
Files are written with BLAKE3 digests; reading checks whichever algorithm the manifest names.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_checkpoint._digest import WRITE_ALGORITHM, DigestAlgorithm, Hasher, new_hasher
from lora_checkpoint.errors import (
    CheckpointError,
    DigestMismatchError,
    TruncatedFileError,
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

# Chunks hashed/written at a time: big enough to amortise thread hand-offs and to give
# blake3's pool work for every core, small enough that the hash of chunk i overlaps the
# write (or read) of chunk i+1 and that the chunk is still in the last-level cache when
# its second hash (file, then tensor) reads it.
CHUNK_BYTES = 8 * 1024 * 1024
# Bytes written between background fdatasync calls (see write_safetensors).
FLUSH_BYTES = 64 * 1024 * 1024
# safetensors refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest's name for ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a written file and the digest of its raw C-order bytes."""

    key: str
    dtype: str  # torch name, e.g. "bfloat16"
    shape: tuple[int, ...]
    digest: str


@dataclass(frozen=True)
class FileRecord:
    """Size and digest of a written file, plus the records of the tensors inside it."""

    size: int
    digest: str  # of the whole file's bytes, in ``algorithm``
    algorithm: DigestAlgorithm
    tensors: tuple[TensorRecord, ...]


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor described by a safetensors header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    end: int


def as_cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """Return a detached, CPU, contiguous tensor with the same values (no copy if already so)."""
    return tensor.detach().to("cpu").contiguous()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    # A zero-copy view of a contiguous CPU tensor's bytes, without needing numpy; the caller
    # keeps ``tensor`` alive for as long as the view is used.
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _chunks(view: memoryview) -> list[memoryview]:
    return [view[i : i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES)] or [view]


def _hash_chunk(file_hash: Hasher, tensor_hash: Hasher, chunk: memoryview) -> None:
    # Both hashes read the chunk back to back, so the second finds it in the cache.
    file_hash.update(chunk)
    tensor_hash.update(chunk)


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> FileRecord:
    """Write ``tensors`` to ``path`` in safetensors format, hashing while writing, and fsync it.

    Args:
        path: the file to create (must not exist).
        tensors: key -> CPU tensor; non-contiguous tensors are made contiguous.
        metadata: optional ``__metadata__`` strings.

    Returns:
        The file's size and BLAKE3 digest and every tensor's BLAKE3 digest.

    Raises:
        CheckpointError: for a dtype safetensors cannot store.
    """
    prepared: list[tuple[str, torch.Tensor]] = []
    for key, t in tensors.items():
        if t.dtype not in DTYPE_TO_CODE:
            raise CheckpointError(
                f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store; "
                f"convert it to one of {sorted(NAME_TO_DTYPE)}"
            )
        prepared.append((key, as_cpu_contiguous(t)))
    # Same order safetensors uses (widest dtype first, then name): keeps every tensor aligned.
    prepared.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for key, t in prepared:
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": DTYPE_TO_CODE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * ((8 - (8 + len(hjson)) % 8) % 8)
    prefix = struct.pack("<Q", len(hjson)) + hjson

    algorithm = WRITE_ALGORITHM
    file_hash = new_hasher(algorithm, len(prefix) + offset)
    file_hash.update(prefix)
    tensor_hashes: list[tuple[str, torch.Tensor, Hasher]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # One worker hashes the chunks in file order, each into the file hash and then into
        # its tensor's hash (the chunk is still cached for the second); blake3 spreads a
        # large chunk over every core and releases the GIL, so the hashing overlaps the
        # write syscalls of this thread. The views are zero-copy views of tensors that stay
        # alive, so the hash queue needs no bound. Every FLUSH_BYTES a background fdatasync
        # starts the disk writeback early, so the final fsync overlaps the hashing instead
        # of following it.
        with ThreadPoolExecutor(1) as hash_pool, ThreadPoolExecutor(1) as flush_pool:
            pending: list[Future[None]] = []
            flush: Future[None] | None = None
            unflushed = 0
            _write_all(fd, memoryview(prefix))
            for key, t in prepared:
                view = _byte_view(t)
                tensor_hash = new_hasher(algorithm, len(view))
                tensor_hashes.append((key, t, tensor_hash))
                for chunk in _chunks(view):
                    pending.append(hash_pool.submit(_hash_chunk, file_hash, tensor_hash, chunk))
                    _write_all(fd, chunk)
                    unflushed += len(chunk)
                    if unflushed >= FLUSH_BYTES and (flush is None or flush.done()):
                        flush = flush_pool.submit(os.fdatasync, fd)
                        unflushed = 0
            for f in pending:
                f.result()
            if flush is not None:
                flush.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(
        size=len(prefix) + offset,
        digest=file_hash.hexdigest(),
        algorithm=algorithm,
        tensors=tuple(
            TensorRecord(key, dtype_name(t.dtype), tuple(t.shape), h.hexdigest())
            for key, t, h in tensor_hashes
        ),
    )


def parse_header(
    buf: bytes | bytearray | memoryview, file: str
) -> tuple[int, dict[str, HeaderEntry]]:
    """Parse and validate a safetensors header.

    Args:
        buf: at least the first ``8 + header_len`` bytes of the file (the whole file to check
            that the data section is complete).
        file: the file's name, for error messages.

    Returns:
        ``(data_start, entries)``: where the data section begins and key -> entry.

    Raises:
        TruncatedFileError: if the file ends inside the header or the data.
        CheckpointError: if the header is not valid safetensors.
    """
    size = len(buf)
    if size < 8:
        raise TruncatedFileError(f"{file}: {size} bytes is too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > MAX_HEADER_BYTES:
        raise CheckpointError(f"{file}: header length {hlen} exceeds {MAX_HEADER_BYTES} bytes")
    if 8 + hlen > size:
        raise TruncatedFileError(
            f"{file}: header says {hlen} header bytes but the file has only {size} bytes"
        )
    try:
        raw = json.loads(bytes(buf[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: safetensors header is not valid JSON: {exc}") from exc
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
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if any(s < 0 for s in shape) or begin < 0 or end - begin != nbytes:
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


def read_file_bytes(
    path: Path, *, expected_size: int | None = None, algorithm: DigestAlgorithm | None = None
) -> tuple[bytearray, str]:
    """Read a whole file into one buffer, hashing that buffer while reading.

    The digest is of the returned buffer itself, which nothing else can write, so the bytes
    that were verified are the bytes the caller builds tensors on.

    Args:
        path: the file.
        expected_size: refuse a file of another size (``TruncatedFileError`` if shorter).
        algorithm: hash the bytes with it (in a worker thread, overlapping the reads);
            None: do not hash.

    Returns:
        ``(buffer, hex digest)``; the digest is ``""`` when ``algorithm`` is None.

    Raises:
        TruncatedFileError: the file is shorter than expected or shrank while being read.
        DigestMismatchError: the file is longer than expected.
    """
    name = path.name
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            if size < expected_size:
                raise TruncatedFileError(
                    f"{name}: file has {size} bytes, the manifest expects {expected_size}; "
                    "it was cut off - restore it from a good copy"
                )
            raise DigestMismatchError(
                f"{name}: file has {size} bytes, the manifest expects {expected_size}"
            )
        buf = bytearray(size)
        view = memoryview(buf)
        h = None if algorithm is None else new_hasher(algorithm, size)
        with ThreadPoolExecutor(1) as pool:
            pending: list[Future[object]] = []
            pos = 0
            while pos < size:
                n = f.readinto(view[pos : pos + CHUNK_BYTES])
                if not n:
                    raise TruncatedFileError(f"{name}: file ended at byte {pos} of {size}")
                if h is not None:
                    pending.append(pool.submit(h.update, view[pos : pos + n]))
                pos += n
            for p in pending:
                p.result()
    return buf, ("" if h is None else h.hexdigest())


def tensors_from_buffer(buf: bytearray, file: str) -> dict[str, torch.Tensor]:
    """Parse a safetensors file held in ``buf`` into tensors that share ``buf`` (no copy).

    Raises:
        TruncatedFileError, CheckpointError: for a cut-off or malformed file.
    """
    data_start, entries = parse_header(memoryview(buf), file)
    tensors: dict[str, torch.Tensor] = {}
    for key, e in entries.items():
        if e.end == e.begin:
            tensors[key] = torch.empty(e.shape, dtype=e.dtype)
        else:
            tensors[key] = torch.frombuffer(
                buf, dtype=e.dtype, count=math.prod(e.shape), offset=data_start + e.begin
            ).reshape(e.shape)
    return tensors


def tensor_digest(tensor: torch.Tensor, algorithm: DigestAlgorithm) -> str:
    """Return the digest of a tensor's raw C-order bytes in ``algorithm``."""
    owned = as_cpu_contiguous(tensor)  # keeps the memory alive while the view is read
    view = _byte_view(owned)
    h = new_hasher(algorithm, len(view))
    for chunk in _chunks(view):
        h.update(chunk)
    return h.hexdigest()
