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
import os
import struct
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_checkpoint._digest import (
    WRITE_ALGORITHM,
    DigestAlgorithm,
    Hasher,
    digest_of,
    new_hasher,
    pool_pays,
)
from lora_checkpoint._fs import io_error
from lora_checkpoint._st_header import (
    DTYPE_TO_CODE,
    NAME_TO_DTYPE,
    header_length,
    match_manifest,
    parse_header,
)
from lora_checkpoint._st_header import (
    dtype_name as dtype_name,  # re-exported: writer and reader name dtypes through here
)
from lora_checkpoint.errors import (
    CheckpointError,
    DigestMismatchError,
    TruncatedFileError,
)

# Chunks hashed/written/read at a time: big enough to amortise thread hand-offs, small
# enough that the hash of chunk i overlaps the write (or read) of chunk i+1 and that a
# chunk is still in the last-level cache when its hashes read it (4 MiB measured as fast
# as 2 MiB and faster than 8-16 MiB for load; the same for save).
CHUNK_BYTES = 4 * 1024 * 1024
# Bytes written between background fdatasync calls (see write_safetensors); 16 MiB
# measured ~10% faster saves than 64 MiB (the disk starts earlier), 8 MiB no faster.
FLUSH_BYTES = 16 * 1024 * 1024


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
        CheckpointIOError: the file system refused the write (disk full, read-only...).
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

    try:
        return _write_prepared(path, prepared, prefix, offset)
    except OSError as exc:
        raise io_error(exc, path, "write the checkpoint file") from exc


def _write_prepared(
    path: Path, prepared: list[tuple[str, torch.Tensor]], prefix: bytes, offset: int
) -> FileRecord:
    algorithm = WRITE_ALGORITHM
    file_hash = new_hasher(algorithm, pool_pays(len(prefix) + offset, beside_io=True))
    file_hash.update(prefix)
    tensor_hashes: list[tuple[str, torch.Tensor, Hasher]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        # One worker hashes the chunks in file order, each into the file hash and then into
        # its tensor's hash (the chunk is still cached for the second); blake3 releases the
        # GIL, so the hashing overlaps the write syscalls of this thread (and, with spare
        # cores, spreads over them: see pool_pays). The views are zero-copy views of tensors
        # that stay alive, so the hash queue needs no bound. Every FLUSH_BYTES a background
        # fdatasync starts the disk writeback early, so the final fsync overlaps the hashing
        # instead of following it.
        with ThreadPoolExecutor(1) as hash_pool, ThreadPoolExecutor(1) as flush_pool:
            pending: list[Future[None]] = []
            flush: Future[None] | None = None
            unflushed = 0
            _write_all(fd, memoryview(prefix))
            for key, t in prepared:
                view = _byte_view(t)
                tensor_hash = new_hasher(algorithm, pool_pays(len(view), beside_io=True))
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


def _checked_size(fd: int, path: Path, expected_size: int | None) -> int:
    size = os.fstat(fd).st_size
    if expected_size is not None and size != expected_size:
        if size < expected_size:
            raise TruncatedFileError(
                f"{path.name}: file has {size} bytes, the manifest expects {expected_size}; "
                "it was cut off - restore it from a good copy"
            )
        raise DigestMismatchError(
            f"{path.name}: file has {size} bytes, the manifest expects {expected_size}"
        )
    return size


_PREADV = getattr(os, "preadv", None)
# Buffers handed to one preadv call, well below the usual IOV_MAX of 1024.
_MAX_IOVECS = 256


def _pread_into(fd: int, views: list[memoryview], offset: int, name: str, size: int) -> None:
    # Fills ``views`` from ``offset`` on (preadv may return less than asked: loop).
    while views:
        if _PREADV is not None:
            n = _PREADV(fd, views, offset)
        else:  # no preadv on this platform: read and copy
            data = os.pread(fd, len(views[0]), offset)
            n = len(data)
            views[0][:n] = data
        if n == 0:
            raise TruncatedFileError(f"{name}: file ended at byte {offset} of {size}")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def read_file_bytes(
    path: Path,
    *,
    expected_size: int | None = None,
    algorithm: DigestAlgorithm | None = None,
    max_size: int | None = None,
) -> tuple[bytes, str]:
    """Read a whole (small) file and hash it.

    Args:
        path: the file.
        expected_size: refuse a file of another size (``TruncatedFileError`` if shorter).
        algorithm: hash the bytes with it; None: do not hash.
        max_size: refuse a larger file before reading any of it (``CheckpointError``).

    Returns:
        ``(bytes, hex digest)`` of the same bytes; the digest is ``""`` when ``algorithm`` is
        None.

    Raises:
        TruncatedFileError: the file is shorter than expected or shrank while being read.
        DigestMismatchError: the file is longer than expected.
        CheckpointError: the file is larger than ``max_size``.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = _checked_size(fd, path, expected_size)
        if max_size is not None and size > max_size:
            raise CheckpointError(
                f"{path.name}: file has {size} bytes, more than the {max_size} a file of this "
                "kind may hold; it is corrupted or was not written by lora-checkpoint"
            )
        buf = bytearray(size)
        _pread_into(fd, [memoryview(buf)], 0, path.name, size)
    finally:
        os.close(fd)
    data = bytes(buf)
    return data, ("" if algorithm is None else digest_of(algorithm, data))


@dataclass(frozen=True)
class SafetensorsRead:
    """A safetensors file being read by :func:`read_safetensors`.

    Attributes:
        tensors: key -> tensor owning its memory; filled only once :meth:`finish` returned;
            empty when ``header_error`` is set.
        header_error: why the header is unusable, when it is and the file is hashed anyway
            (so the caller can first tell a corrupted file from a malformed one).
    """

    tensors: dict[str, torch.Tensor]
    header_error: CheckpointError | None
    _done: Future[str]

    def finish(self) -> str:
        """Wait until every byte is read (and hashed); return the hex digest ("" if unhashed).

        Raises:
            TruncatedFileError: the file shrank while being read.
        """
        return self._done.result()


def _wait_then_hash(
    h: Hasher | None, read: Future[None], views: list[memoryview], owners: list[object]
) -> None:
    # ``owners`` (the tensors and buffers behind ``views``) is only held: this task is
    # queued before the read starts and ends after it, so their memory outlives both.
    del owners
    read.result()  # the bytes are in place (raises if the read failed)
    if h is not None:
        for v in views:
            h.update(v)


def _read_and_hash_range(
    fd: int, h: Hasher | None, start: int, end: int, name: str, size: int
) -> None:
    # Reads [start, end) through one CHUNK_BYTES buffer, hashing each piece as it arrives.
    buf = memoryview(bytearray(min(CHUNK_BYTES, end - start)))
    pos = start
    while pos < end:
        part = buf[: min(len(buf), end - pos)]
        _pread_into(fd, [part], pos, name, size)
        if h is not None:
            h.update(part)
        pos += len(part)


def _close_when_done(fd: int, h: Hasher | None, steps: list[Future[None]]) -> str:
    # Runs last on the file's FIFO worker: every step before it has finished.
    try:
        for step in steps:
            step.result()
    finally:
        os.close(fd)
    return "" if h is None else h.hexdigest()


def read_safetensors(
    path: Path,
    *,
    expected_size: int | None = None,
    algorithm: DigestAlgorithm | None = None,
    readers: ThreadPoolExecutor | None = None,
    file_worker: ThreadPoolExecutor | None = None,
    expected: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> SafetensorsRead:
    """Read a safetensors file into tensors that own their memory, hashing those very bytes.

    The calling thread reads the header and allocates every tensor (in its own malloc arena,
    which keeps freed memory for the next load); ``readers`` then read the bytes straight
    into the tensors' storage, in parallel (so the page faults of fresh memory spread over
    the cores), and ``file_worker`` hashes them in file order as they arrive. Nothing else
    holds that memory, so the bytes that were hashed are the bytes returned. Bytes between
    or after tensors are read into scratch and hashed too: the digest is of the whole file.

    Args:
        path: the file.
        expected_size: refuse a file of another size (``TruncatedFileError`` if shorter).
        algorithm: hash the file with it; None: do not hash.
        readers: the threads that read (default: two private ones).
        file_worker: a single-thread executor for this file alone, which hashes in order and
            closes the file (default: a private one). With both given this returns while
            the bytes are still arriving, so the caller can start the next file.
        expected: key -> (dtype name, shape) the manifest records; a header that differs
            (another key, dtype or shape) is refused before any tensor is allocated.

    Returns:
        The tensors, valid once ``finish()`` returned the digest. With ``algorithm`` set, a
        header that cannot be used is returned as ``header_error`` (the whole file is still
        hashed) instead of raised, so the caller can tell corrupted bytes from a malformed
        file.

    Raises:
        TruncatedFileError: the file is shorter than expected; without ``algorithm``, also
            a header that claims more bytes than the file has.
        DigestMismatchError: the file is longer than expected.
        CheckpointError: a malformed header, when ``algorithm`` is None.
    """
    if readers is None or file_worker is None:
        with ThreadPoolExecutor(2) as own_readers, ThreadPoolExecutor(1) as own_worker:
            read = read_safetensors(
                path,
                expected_size=expected_size,
                algorithm=algorithm,
                readers=readers or own_readers,
                file_worker=file_worker or own_worker,
                expected=expected,
            )
            read.finish()
        return read
    name = path.name
    fd = os.open(path, os.O_RDONLY)
    steps: list[Future[None]] = []
    closing = False
    try:
        size = _checked_size(fd, path, expected_size)
        h = None if algorithm is None else new_hasher(algorithm, pool_pays(size, beside_io=True))
        # The file's bytes as regions in file order, batched into reads of up to CHUNK_BYTES
        # (and _MAX_IOVECS buffers); each read is followed, in order, by its hashing.
        views: list[memoryview] = []
        owners: list[object] = []
        batch_at = batched = 0

        def flush() -> None:
            nonlocal views, owners, batched
            if views:
                read = readers.submit(_pread_into, fd, list(views), batch_at, name, size)
                steps.append(file_worker.submit(_wait_then_hash, h, read, views, owners))
                views, owners, batched = [], [], 0

        def add(view: memoryview, owner: object, pos: int) -> None:
            nonlocal batch_at, batched
            for i in range(0, len(view), CHUNK_BYTES):
                part = view[i : i + CHUNK_BYTES]
                if not views:
                    batch_at = pos + i
                views.append(part)
                owners.append(owner)
                batched += len(part)
                if batched >= CHUNK_BYTES or len(views) >= _MAX_IOVECS:
                    flush()

        def add_scratch(end: int, pos: int) -> None:
            # Bytes no tensor owns: gaps, trailing bytes, or the rest behind a bad header.
            # One task reads and hashes them through one reused chunk, in file order: the
            # memory is bounded whatever the header claims (a scratch buffer per chunk, all
            # queued at once, once held the whole of a hostile file).
            if pos < end:
                flush()
                steps.append(file_worker.submit(_read_and_hash_range, fd, h, pos, end, name, size))

        def done(
            tensors: dict[str, torch.Tensor], error: CheckpointError | None
        ) -> SafetensorsRead:
            nonlocal closing
            flush()
            closing = True  # from here on the file worker closes the descriptor
            last = file_worker.submit(_close_when_done, fd, h, list(steps))
            return SafetensorsRead(tensors, error, last)

        head = bytearray(min(size, 8))
        _pread_into(fd, [memoryview(head)], 0, name, size)
        header = b""
        try:
            hlen = header_length(head, name, size)
            header = os.pread(fd, hlen, 8)
            data_start, entries = parse_header(head + header, name, size)
            plan = sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end))
            end_so_far = 0
            for key, e in plan:
                if e.begin < end_so_far and e.begin < e.end:  # an empty tensor overlaps nothing
                    raise CheckpointError(
                        f"{name}: key {key!r} (data_offsets {[e.begin, e.end]}) overlaps the "
                        "bytes of another tensor; a safetensors file holds each tensor once"
                    )
                end_so_far = max(end_so_far, e.end)
            if expected is not None:
                match_manifest(name, entries, expected)
        except CheckpointError as exc:
            if h is None:
                raise
            h.update(head + header)  # no read is queued yet: this comes first in the hash
            add_scratch(size, len(head) + len(header))
            return done({}, exc)
        if h is not None:
            h.update(head + header)
        tensors: dict[str, torch.Tensor] = {}
        pos = data_start
        for key, e in plan:
            try:
                t = torch.empty(e.shape, dtype=e.dtype)
            except RuntimeError as exc:  # out of memory: the sizes themselves were checked
                raise CheckpointError(
                    f"{name}: cannot allocate {e.end - e.begin} bytes for key {key!r}: {exc}; "
                    "load on a machine with more memory"
                ) from exc
            if e.begin < e.end:
                add_scratch(data_start + e.begin, pos)
                add(_byte_view(t), t, data_start + e.begin)
                pos = data_start + e.end
            tensors[key] = t
        add_scratch(size, pos)
        return done(tensors, None)
    except BaseException:
        if not closing:
            # No queued read may still use the descriptor when it is closed (its number
            # could meanwhile be reused for another file).
            for step in steps:
                step.exception()
            os.close(fd)
        raise


def tensor_digest(tensor: torch.Tensor, algorithm: DigestAlgorithm) -> str:
    """Return the digest of a tensor's raw C-order bytes in ``algorithm``."""
    owned = as_cpu_contiguous(tensor)  # keeps the memory alive while the view is read
    view = _byte_view(owned)
    h = new_hasher(algorithm, pool_pays(len(view), beside_io=False))
    for chunk in _chunks(view):
        h.update(chunk)
    return h.hexdigest()
