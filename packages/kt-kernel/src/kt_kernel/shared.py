"""Frozen expert storage in anonymous shared memory: written once, mapped read-only anywhere.

One process copies an :class:`~kt_kernel.ExpertWeights`' parts (any format), biases and
quantisation report into a new anonymous memory file (``memfd_create``) with
:func:`write_shared`, and gets back weights over those pages plus the file descriptor. Other
processes on the machine map the same pages with :func:`map_shared` once they hold the
descriptor (passed over a Unix-domain socket with ``SCM_RIGHTS``, or opened as
``/proc/<pid>/fd/<n>``): one physical copy whatever the number of processes.

The file never has a name in any file system, so nothing can be left behind: the kernel
frees the memory when the last descriptor and the last mapping are gone, however the
processes end (normal exit, exception, SIGKILL). Its size is reserved up front
(``posix_fallocate``), so a machine without the memory fails at creation with a
:class:`SharedMemoryError` naming the size, never later with SIGBUS, and the file is sealed
(no writes, no resizing) before anyone else sees it. This module knows descriptors and
tensors only; who writes and how the descriptor travels is the caller's business.

Layout: an 8-byte magic, an 8-byte little-endian header length, a JSON header (format, shapes,
every tensor's dtype, shape and offset, the quantisation report), then every tensor at a
4096-byte aligned offset.
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kt_kernel.errors import KernelDTypeError, KernelInputError
from kt_kernel.formats import WeightFormat, check_parts
from kt_kernel.quant import ProjectionQuantError, QuantizationReport
from kt_kernel.spec import ExpertSpec
from kt_kernel.weights import ExpertWeights

try:
    import fcntl
except ImportError:  # Windows: no shared storage, but kt_kernel itself still imports
    fcntl = None  # type: ignore[assignment]

__all__ = ["SharedExperts", "SharedMemoryError", "map_shared", "write_shared"]

_MAGIC = b"KTKSHM01"
_ALIGN = 4096
# Shown in /proc/<pid>/fd and /proc/<pid>/maps as "/memfd:ktk-<label> (deleted)".
MEMFD_PREFIX = "ktk-"
# Readers may rely on these: the pages can neither change nor shrink under a mapping.
# Linux only (memfd seals); elsewhere 0 and write_shared/map_shared refuse with one error.
_SEALS = (
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
    if hasattr(fcntl, "F_ADD_SEALS") and hasattr(os, "memfd_create")
    else 0
)
_UNSUPPORTED = (
    "shared expert storage needs Linux (memfd_create and file seals), which this "
    "platform lacks; keep one copy of the experts per process instead"
)


class SharedMemoryError(KernelInputError):
    """Shared expert storage cannot be created or mapped, or does not match what was expected."""


@dataclass(frozen=True)
class SharedExperts:
    """What :func:`write_shared` made: the weights over the shared pages and their descriptor.

    Attributes:
        weights: equal to the written weights; their storage is the shared pages (read-only).
        fd: the sealed anonymous memory file (close-on-exec). The caller owns it: hand it to
            other processes, then ``os.close`` it (the mapping keeps the memory alive).
        nbytes: the file's size, header included.
    """

    weights: ExpertWeights
    fd: int
    nbytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _entries(weights: ExpertWeights) -> list[tuple[str, torch.Tensor]]:
    gate_up, down = weights.storage
    out = [(f"gate_up.{i}", t) for i, t in enumerate(gate_up)]
    out += [(f"down.{i}", t) for i, t in enumerate(down)]
    for name, b in (("gate_up_bias", weights.gate_up_bias), ("down_bias", weights.down_bias)):
        if b is not None:
            out.append((name, b))
    return out


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _report_dict(weights: ExpertWeights) -> dict[str, dict[str, float]] | None:
    if not weights.is_quantized:
        return None
    try:
        return weights.quantization_report().as_dict()
    except KernelDTypeError:  # adopted parts (e.g. FP8 from a checkpoint) have no report
        return None


def write_shared(weights: ExpertWeights, *, label: str = "experts") -> SharedExperts:
    """Copy ``weights`` into a new sealed anonymous memory file mapped read-only.

    Args:
        weights: any :class:`ExpertWeights` (every format; biases and the quantisation report
            travel along).
        label: a debugging name, visible in ``/proc/<pid>/maps`` as ``memfd:ktk-<label>``.

    Returns:
        :class:`SharedExperts`: weights equal to ``weights`` over the shared pages (``weights``
        can be dropped afterwards) and the file descriptor, which the caller must close.

    Raises:
        SharedMemoryError: the memory cannot be created or reserved (the message says how much
            was needed, where it is charged and how to make room), or the platform is not
            Linux.
    """
    if not _SEALS:
        raise SharedMemoryError(_UNSUPPORTED)
    entries = _entries(weights)
    table: list[dict[str, Any]] = []
    offset = 0
    for key, t in entries:
        table.append(
            {"name": key, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset}
        )
        offset = _round_up(offset + t.nbytes)
    spec = weights.spec
    header = json.dumps(
        {
            "format": weights.format.name,
            "compute_dtype": _dtype_name(weights.dtype),
            "shape": [spec.num_experts, spec.hidden_size, spec.intermediate_size],
            "tensors": table,
            "report": _report_dict(weights),
        }
    ).encode()
    data_start = _round_up(16 + len(header))
    total = data_start + offset
    where = "anonymous shared memory (memfd)"
    try:
        fd = os.memfd_create(MEMFD_PREFIX + label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise SharedMemoryError(
            f"cannot create {where} for the shared expert storage: {exc}"
        ) from exc
    try:
        try:
            # Reserve every page now: a machine without the memory fails here, not with
            # SIGBUS on a later write or read.
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            raise SharedMemoryError(
                f"cannot reserve {total / 2**20:.1f} MiB of {where} for the shared expert "
                f"storage ({_available_bytes() / 2**20:.0f} MiB of RAM available): {exc}. It is "
                "charged to the machine's RAM and to the container's memory limit (not to "
                "/dev/shm); free memory or raise that limit"
            ) from exc
        with mmap.mmap(fd, total, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m[:8] = _MAGIC
            m[8:16] = len(header).to_bytes(8, "little")
            m[16 : 16 + len(header)] = header
            flat = torch.frombuffer(m, dtype=torch.uint8)
            for (_, t), row in zip(entries, table, strict=True):
                start = data_start + row["offset"]
                src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                flat[start : start + t.nbytes].copy_(src)
            del flat, src
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        shared = _assemble(
            _read_segment(fd, "the new shared expert storage", total),
            weights.spec,
            weights.format,
            "the new shared expert storage",
        )
    except BaseException:
        os.close(fd)
        raise
    return SharedExperts(shared, fd, total)


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_segment(fd: int, what: str, size: int | None = None) -> dict[str, Any]:
    """Map ``fd`` read-only (the mapping keeps its own reference to the file): the header,
    with its tensors under ``"_tensors"``."""
    if not _SEALS:
        raise SharedMemoryError(_UNSUPPORTED)
    try:
        real = os.fstat(fd).st_size
    except OSError as exc:
        raise SharedMemoryError(f"cannot read {what}: {exc}") from exc
    if size is not None and real != size:
        raise SharedMemoryError(f"{what} is {real} bytes, expected {size}")
    if real < 16:
        raise SharedMemoryError(f"{what} is too short ({real} bytes) to be shared expert storage")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memfd at all (a regular file)
        seals = 0
    if seals & _SEALS != _SEALS:
        raise SharedMemoryError(
            f"{what} is not sealed against writes and truncation; map only storage made by "
            "kt_kernel.write_shared"
        )
    try:
        # MAP_PRIVATE, not MAP_SHARED: Linux before 6.7 refuses every shared mapping of a
        # write-sealed memfd, even a read-only one. A read-only private mapping maps the same
        # page-cache pages (still one physical copy) and, written through mprotect, would
        # only copy a page for its own process.
        m = mmap.mmap(fd, real, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    except OSError as exc:
        raise SharedMemoryError(f"cannot map {what}: {exc}") from exc
    if m[:8] != _MAGIC:
        raise SharedMemoryError(f"{what} is not kt-kernel shared expert storage (bad magic)")
    hlen = int.from_bytes(m[8:16], "little")
    try:
        header: dict[str, Any] = json.loads(m[16 : 16 + hlen])
    except ValueError as exc:
        raise SharedMemoryError(f"{what} has a corrupt header: {exc}") from exc
    data_start = _round_up(16 + hlen)
    with warnings.catch_warnings():
        # The pages are read-only on purpose: the kernel never writes its base weights.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        try:
            header["_tensors"] = _tensor_table(m, header, data_start, real, what)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # Only storage not made by write_shared gets here (the readers check the seals).
            raise SharedMemoryError(
                f"{what} has a malformed header ({type(exc).__name__}: {exc}); map only storage "
                "made by kt_kernel.write_shared of the same kt-kernel version"
            ) from exc
    for key in ("format", "shape"):
        if key not in header:
            raise SharedMemoryError(f"{what} has a malformed header: no {key!r}")
    return header


def _tensor_table(
    m: mmap.mmap, header: dict[str, Any], data_start: int, real: int, what: str
) -> dict[str, torch.Tensor]:
    """The header's tensors as read-only views of the mapping, each checked to fit in it."""
    tensors: dict[str, torch.Tensor] = {}
    for row in header["tensors"]:
        dtype = getattr(torch, row["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"tensor {row['name']!r} has dtype {row['dtype']!r}")
        count = 1
        for d in row["shape"]:
            count *= int(d)
        start = data_start + int(row["offset"])
        if count < 0 or start < data_start or start + count * dtype.itemsize > real:
            raise SharedMemoryError(f"{what}: tensor {row['name']} runs past the end")
        flat = (
            torch.frombuffer(m, dtype=torch.uint8, count=count * dtype.itemsize, offset=start)
            if count
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors[row["name"]] = flat.view(dtype).view(row["shape"])
    return tensors


def _assemble(
    header: dict[str, Any], spec: ExpertSpec, fmt: WeightFormat, what: str
) -> ExpertWeights:
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if header["format"] != fmt.name or header["shape"] != [e, h, i]:
        raise SharedMemoryError(
            f"{what} holds format {header['format']!r} experts of shape (E, H, I) = "
            f"{tuple(header['shape'])}, expected {fmt.name!r} {(e, h, i)}; the writer and this "
            "process disagree about the model"
        )
    t = header["_tensors"]
    n_parts = len(fmt.part_specs(2 * i, h))
    try:
        gu = check_parts(
            fmt, tuple(t.get(f"gate_up.{k}") for k in range(n_parts)), (e,), 2 * i, h, "gate_up"
        )
        dn = check_parts(fmt, tuple(t.get(f"down.{k}") for k in range(n_parts)), (e,), h, i, "down")
    except KernelInputError as exc:
        raise SharedMemoryError(f"{what} does not hold {fmt!r} experts: {exc}") from exc
    report = None
    if header.get("report"):
        r = header["report"]
        report = QuantizationReport(*(ProjectionQuantError(**r[p]) for p in ("gate", "up", "down")))
    return ExpertWeights(
        spec,
        fmt,
        gu,
        dn,
        gate_up_bias=t.get("gate_up_bias"),
        down_bias=t.get("down_bias"),
        report=report,
    )


def map_shared(
    source: int | str | os.PathLike[str], spec: ExpertSpec, fmt: WeightFormat
) -> ExpertWeights:
    """Map storage written by :func:`write_shared` read-only, checked against spec and format.

    Args:
        source: a descriptor of the storage (received from the writer; it stays open and
            remains the caller's to close) or a path that opens it (``/proc/<pid>/fd/<n>``).
        spec: the experts' spec as this process knows it (the activation is taken from here).
        fmt: the weight format this process expects.

    Returns:
        :class:`ExpertWeights` whose storage views the shared pages (do not modify them).

    Raises:
        SharedMemoryError: the storage cannot be opened, is corrupt or unsealed, or holds other
            shapes or another format, or the platform is not Linux.
    """
    if isinstance(source, int):
        return _assemble(
            _read_segment(source, f"shared expert storage (fd {source})"),
            spec,
            fmt,
            f"shared expert storage (fd {source})",
        )
    path = Path(source)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedMemoryError(f"cannot open the shared expert storage {path}: {exc}") from exc
    try:
        return _assemble(_read_segment(fd, str(path)), spec, fmt, str(path))
    finally:
        os.close(fd)
