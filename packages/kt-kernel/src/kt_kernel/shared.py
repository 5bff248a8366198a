"""Frozen expert storage in a named shared-memory file, written once and mapped read-only.

One process writes an :class:`~kt_kernel.ExpertWeights`' parts (any format), biases and
quantisation report into a new file (by default under ``/dev/shm``) with
:func:`write_shared`; other processes on the same machine map it read-only with
:func:`map_shared` and get an :class:`~kt_kernel.ExpertWeights` whose storage *is* the shared
pages (one physical copy, whatever the number of processes). Once every process has mapped it,
the writer calls :func:`unlink_shared`: the mappings keep the memory alive and nothing is left
behind when the processes exit or crash.

A file is named by a :class:`SegmentName` that records its writer's pid namespace and pid, so
:func:`remove_stale_segments` can delete the files of writers that died before unlinking.
This module knows files and tensors only; who writes and when the others map is the caller's.

File layout: an 8-byte magic, an 8-byte little-endian header length, a JSON header (format,
shapes, every tensor's dtype, shape and offset, the quantisation report), then every tensor at
a 4096-byte aligned offset.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kt_kernel.errors import KernelDTypeError, KernelInputError
from kt_kernel.formats import WeightFormat, check_parts
from kt_kernel.quant import ProjectionQuantError, QuantizationReport
from kt_kernel.spec import ExpertSpec
from kt_kernel.weights import ExpertWeights

__all__ = [
    "SHARED_DIR",
    "SegmentName",
    "SharedMemoryError",
    "map_shared",
    "remove_stale_segments",
    "unlink_shared",
    "write_shared",
]

SHARED_DIR = Path("/dev/shm")
_MAGIC = b"KTKSHM01"
_ALIGN = 4096
_PREFIX = "ktk"
# ktk-<pid namespace inode>-<pid>-<token>-<key>
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-(\d+)-([0-9a-f]+)-([A-Za-z0-9_.]+)$")


class SharedMemoryError(KernelInputError):
    """A shared expert segment cannot be created, read or does not match what was expected."""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no procfs: every writer counts as one namespace
        return 0


@dataclass(frozen=True)
class SegmentName:
    """The name of one shared segment: who wrote it (for stale detection) and which it is.

    Attributes:
        key: the caller's name for the segment (letters, digits, ``_`` and ``.``), e.g. the
            block index.
        token: random hex shared by the processes of one job, so two jobs never collide.
        owner_pid: pid of the writing process.
        pid_namespace: inode of the writer's pid namespace (pids are only comparable within
            one).
        directory: where the file lives (a tmpfs such as ``/dev/shm``).
    """

    key: str
    token: str = field(default_factory=lambda: secrets.token_hex(6))
    owner_pid: int = field(default_factory=os.getpid)
    pid_namespace: int = field(default_factory=_pid_namespace)
    directory: Path = SHARED_DIR

    def __post_init__(self) -> None:
        """Reject keys and tokens that would not round-trip through the file name."""
        if not re.fullmatch(r"[A-Za-z0-9_.]+", self.key):
            raise SharedMemoryError(
                f"SegmentName.key must be letters, digits, '_' or '.', got {self.key!r}"
            )
        if not re.fullmatch(r"[0-9a-f]+", self.token):
            raise SharedMemoryError(f"SegmentName.token must be lowercase hex, got {self.token!r}")

    @property
    def path(self) -> Path:
        """The file's path."""
        name = f"{_PREFIX}-{self.pid_namespace}-{self.owner_pid}-{self.token}-{self.key}"
        return Path(self.directory) / name

    @classmethod
    def parse(cls, path: Path) -> SegmentName | None:
        """The name of a segment file, or ``None`` for a file that is not one."""
        m = _NAME.match(Path(path).name)
        if m is None:
            return None
        ns, pid, token, key = m.groups()
        return cls(key, token, int(pid), int(ns), Path(path).parent)


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


def write_shared(weights: ExpertWeights, name: SegmentName) -> ExpertWeights:
    """Copy ``weights`` into a new shared file and return weights that map it read-only.

    Args:
        weights: any :class:`ExpertWeights` (every format; biases and the quantisation report
            travel along).
        name: the segment's name; its ``owner_pid`` must be this process.

    Returns:
        An :class:`ExpertWeights` equal to ``weights`` whose storage is the shared file's
        pages. ``weights`` can be dropped afterwards.

    Raises:
        SharedMemoryError: the name is not this process's, the file exists, or the directory
            has no room (the message says how much is needed).
    """
    if name.owner_pid != os.getpid() or name.pid_namespace != _pid_namespace():
        raise SharedMemoryError(
            f"{name.path.name} names pid {name.owner_pid} as its writer; only that process may "
            "write it (stale detection relies on the pid)"
        )
    entries = _entries(weights)
    table: list[dict[str, Any]] = []
    offset = 0
    for key, t in entries:
        table.append({"name": key, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                      "offset": offset})
        offset = _round_up(offset + t.nbytes)
    spec = weights.spec
    header = json.dumps({
        "format": weights.format.name,
        "compute_dtype": _dtype_name(weights.dtype),
        "shape": [spec.num_experts, spec.hidden_size, spec.intermediate_size],
        "tensors": table,
        "report": _report_dict(weights),
    }).encode()
    data_start = _round_up(16 + len(header))
    total = data_start + offset
    path = name.path
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise SharedMemoryError(f"cannot create the shared expert segment {path}: {exc}") from exc
    try:
        try:
            # Reserve every page now: a full tmpfs fails here, not with SIGBUS on a write.
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            free = _free_bytes(path.parent)
            raise SharedMemoryError(
                f"{path.parent} has no room for {total / 2**20:.1f} MiB of shared experts "
                f"({free / 2**20:.1f} MiB free): enlarge it (e.g. docker --shm-size) or turn "
                f"expert sharing off [{exc}]"
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
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    try:
        return _assemble(_read_segment(fd, path, total), weights.spec, weights.format, path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _read_segment(fd: int, path: Path, size: int | None = None) -> dict[str, Any]:
    """Map ``fd`` read-only (closing it): the header, with its tensors under ``"_tensors"``."""
    try:
        real = os.fstat(fd).st_size
        if size is not None and real != size:
            raise SharedMemoryError(f"{path} is {real} bytes, expected {size}")
        if real < 16:
            raise SharedMemoryError(f"{path} is too short ({real} bytes) to be a segment")
        m = mmap.mmap(fd, real, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if m[:8] != _MAGIC:
        raise SharedMemoryError(f"{path} is not a kt-kernel shared expert segment (bad magic)")
    hlen = int.from_bytes(m[8:16], "little")
    try:
        header = json.loads(m[16 : 16 + hlen])
    except ValueError as exc:
        raise SharedMemoryError(f"{path} has a corrupt header: {exc}") from exc
    data_start = _round_up(16 + hlen)
    with warnings.catch_warnings():
        # The pages are read-only on purpose: the kernel never writes its base weights.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensors: dict[str, torch.Tensor] = {}
        for row in header["tensors"]:
            dtype = getattr(torch, row["dtype"])
            count = 1
            for d in row["shape"]:
                count *= d
            start = data_start + row["offset"]
            if start + count * dtype.itemsize > real:
                raise SharedMemoryError(f"{path}: tensor {row['name']} runs past the end")
            flat = torch.frombuffer(m, dtype=torch.uint8, count=count * dtype.itemsize,
                                    offset=start) if count else torch.empty(0, dtype=torch.uint8)
            tensors[row["name"]] = flat.view(dtype).view(row["shape"])
    header["_tensors"] = tensors
    return header


def _assemble(header: dict[str, Any], spec: ExpertSpec, fmt: WeightFormat,
              path: Path) -> ExpertWeights:
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if header["format"] != fmt.name or header["shape"] != [e, h, i]:
        raise SharedMemoryError(
            f"{path} holds format {header['format']!r} experts of shape (E, H, I) = "
            f"{tuple(header['shape'])}, expected {fmt.name!r} {(e, h, i)}; the writer and this "
            "process disagree about the model"
        )
    t = header["_tensors"]
    n_parts = len(fmt.part_specs(2 * i, h))
    try:
        gu = check_parts(fmt, tuple(t.get(f"gate_up.{k}") for k in range(n_parts)), (e,),
                         2 * i, h, "gate_up")
        dn = check_parts(fmt, tuple(t.get(f"down.{k}") for k in range(n_parts)), (e,), h, i,
                         "down")
    except KernelInputError as exc:
        raise SharedMemoryError(f"{path} does not hold {fmt!r} experts: {exc}") from exc
    report = None
    if header.get("report"):
        r = header["report"]
        report = QuantizationReport(*(ProjectionQuantError(**r[p]) for p in ("gate", "up", "down")))
    return ExpertWeights(spec, fmt, gu, dn, gate_up_bias=t.get("gate_up_bias"),
                         down_bias=t.get("down_bias"), report=report)


def map_shared(name: SegmentName | Path, spec: ExpertSpec, fmt: WeightFormat) -> ExpertWeights:
    """Map a segment written by :func:`write_shared` read-only, checked against spec and format.

    Args:
        name: the segment (or its path).
        spec: the experts' spec as this process knows it (the activation is taken from here).
        fmt: the weight format this process expects.

    Returns:
        :class:`ExpertWeights` whose storage views the shared pages (do not modify them).

    Raises:
        SharedMemoryError: the file is missing, corrupt, or holds other shapes or format.
    """
    path = name.path if isinstance(name, SegmentName) else Path(name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise SharedMemoryError(f"cannot open the shared expert segment {path}: {exc}") from exc
    return _assemble(_read_segment(fd, path), spec, fmt, path)


def unlink_shared(name: SegmentName) -> None:
    """Remove the segment's name (existing mappings stay valid; memory goes with the last)."""
    name.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_segments(directory: Path = SHARED_DIR) -> list[Path]:
    """Delete segments whose writer (in this pid namespace) is gone; return what was removed.

    A writer that crashed between creating a segment and unlinking it leaves the file behind;
    its memory is only freed once the name is gone. Segments of live writers and of other pid
    namespaces are never touched.
    """
    removed: list[Path] = []
    ns = _pid_namespace()
    try:
        candidates = list(Path(directory).glob(f"{_PREFIX}-*"))
    except OSError:
        return removed
    for path in candidates:
        name = SegmentName.parse(path)
        if name is None or name.pid_namespace != ns or _alive(name.owner_pid):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not ours to remove (permissions): leave it
        removed.append(path)
    return removed
