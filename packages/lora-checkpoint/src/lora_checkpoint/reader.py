"""Strict checkpoint loading, verification and in-place restore."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from lora_checkpoint import _dist, _fs
from lora_checkpoint._digest import available_cores
from lora_checkpoint._finite import NonFiniteTensor, find_non_finite, non_finite_error
from lora_checkpoint._names import checkpoint_name_problem
from lora_checkpoint._safetensors_io import (
    SafetensorsRead,
    dtype_name,
    read_file_bytes,
    read_safetensors,
    tensor_digest,
)
from lora_checkpoint.errors import (
    CheckpointError,
    DigestMismatchError,
    DtypeMismatchError,
    ManifestError,
    MissingFileError,
    MissingTensorError,
    ShapeMismatchError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnsafeFileError,
)
from lora_checkpoint.manifest import FileEntry, Manifest, TensorEntry, TensorKind, parse_manifest
from lora_checkpoint.training_state import TrainingState
from lora_checkpoint.writer import MANIFEST, training_state_files
from lora_core.contracts import AdaptationResult

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "CheckpointReport",
    "LoadedCheckpoint",
    "inspect",
    "load",
    "resolve_checkpoint",
    "restore",
    "scan_non_finite",
    "verify",
]

# Threads reading checkpoint files: 2 measured ~30% faster than 1 for loads that page-fault
# fresh memory (on 2 cores, 3 were no faster); beyond 8, a disk rarely gains more.
MAX_READ_THREADS = 8
# Extensions whose usual readers (torch.load, pickle) can execute code.
UNSAFE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
_SAFE_SUFFIXES = (".safetensors", ".json")
# ``latest`` holds one name of at most 200 bytes; read no more than this of it.
MAX_LATEST_BYTES = 4096
# A manifest lists every tensor and file; even 100k tensors stay well under this.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# The JSON files beside the tensors (adapter config, training state) are read whole to be
# parsed: a larger one is refused before it is read.
MAX_JSON_FILE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint in memory.

    Attributes:
        manifest: the checkpoint's manifest.
        tensors: parameter name -> CPU tensor (this rank's rank-local tensors included).
        training_state: this rank's training state, or None if none was saved.
        path: the checkpoint directory that was read (None if built by hand).
    """

    manifest: Manifest
    tensors: Mapping[str, torch.Tensor]
    training_state: TrainingState | None = None
    path: Path | None = None


def _read_threads() -> int:
    return max(2, min(MAX_READ_THREADS, available_cores()))


def resolve_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """Return the checkpoint directory: ``directory`` itself, or the root's ``latest`` target.

    Raises:
        MissingFileError: neither ``manifest.json`` nor a valid ``latest`` pointer exists.
    """
    path = Path(directory)
    if not path.is_dir():
        raise MissingFileError(f"checkpoint directory {str(path)!r} does not exist")
    if (path / MANIFEST).exists() or (path / MANIFEST).is_symlink():
        return path
    latest = path / _fs.LATEST
    if not latest.is_file() and not latest.is_symlink():
        raise MissingFileError(
            f"{str(path)!r} holds neither {MANIFEST} (a checkpoint) nor {_fs.LATEST!r} "
            "(a checkpoint root); pass a directory written by lora_checkpoint.save"
        )
    try:
        raw = _fs.read_bounded(latest, MAX_LATEST_BYTES)
    except OSError as exc:
        raise _fs.io_error(exc, latest, "read the latest pointer") from exc
    name = raw.decode("utf-8", errors="replace").removesuffix("\n")
    problem = checkpoint_name_problem(name)
    if problem is not None:
        raise UnsafeFileError(
            f"{str(latest)!r} names {name[:64]!r}, which is not a checkpoint name ({problem}); "
            "write the name of a checkpoint directory of this root into it"
        )
    target = path / name
    if target.is_symlink():
        real, inside = os.path.realpath(target), os.path.realpath(path)
        if os.path.dirname(real) != inside:
            raise UnsafeFileError(
                f"{target} is a symbolic link leading outside the checkpoint root {str(path)!r}; "
                "checkpoints must be directories inside the root (move the checkpoint in)"
            )
    if not (target / MANIFEST).is_file():
        raise MissingFileError(
            f"{str(latest)!r} points at {name!r}, but {str(target / MANIFEST)!r} does not exist"
        )
    return target


def _looks_like_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    # Pickle protocol 2+ starts with PROTO (0x80, version); torch.save zips start with PK.
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head.startswith(
        b"PK\x03\x04"
    )


def _check_unsafe(ckpt: Path, manifest: Manifest) -> None:
    listed = {f.file for f in manifest.files}
    for f in manifest.files:
        if not f.file.endswith(_SAFE_SUFFIXES):
            kind = Path(f.file).suffix or "suffix-less"
            raise UnsafeFileError(
                f"{ckpt / f.file}: the manifest lists a {kind} file; "
                f"only {list(_SAFE_SUFFIXES)} are read, never pickle"
            )
        if (ckpt / f.file).is_symlink():
            # A link could make a verified checkpoint read bytes from anywhere on the machine.
            raise UnsafeFileError(
                f"{ckpt / f.file} is a symbolic link; checkpoint files must be regular files "
                "inside the checkpoint directory (copy the target in instead)"
            )
    for child in ckpt.iterdir():
        if child.name in listed or child.name == MANIFEST or not child.is_file():
            continue
        if child.suffix.lower() in UNSAFE_SUFFIXES or _looks_like_pickle(child):
            raise UnsafeFileError(
                f"{child}: a pickle-capable file is in the checkpoint and is refused (it is never "
                "opened with torch.load/pickle); delete it or convert it to safetensors"
            )


def _read_safetensors_file(
    ckpt: Path,
    entry: FileEntry,
    manifest: Manifest,
    verify: bool,
    readers: ThreadPoolExecutor,
    file_worker: ThreadPoolExecutor,
) -> SafetensorsRead | CheckpointError:
    # A failure is returned, not raised, so that the first one in manifest order is reported.
    path = ckpt / entry.file
    try:
        if not path.is_file():
            raise MissingFileError(f"{path}: listed in the manifest but missing")
        return read_safetensors(
            path,
            expected_size=entry.size,
            algorithm=manifest.digest_algorithm if verify else None,
            readers=readers,
            file_worker=file_worker,
            expected={t.key: (t.dtype, t.shape) for t in manifest.tensors if t.file == entry.file},
        )
    except CheckpointError as exc:
        return exc


def _check_safetensors_file(
    ckpt: Path, entry: FileEntry, manifest: Manifest, verify: bool, read: SafetensorsRead
) -> dict[str, torch.Tensor]:
    path = ckpt / entry.file
    algorithm = manifest.digest_algorithm
    expected = [t for t in manifest.tensors if t.file == entry.file]
    digest = read.finish()
    if verify and digest != entry.digest:
        # Only now are tensor digests computed: to name the corrupted keys.
        bad = [
            t.key
            for t in expected
            if t.key in read.tensors and tensor_digest(read.tensors[t.key], algorithm) != t.digest
        ]
        where = f"tensor keys {bad}" if bad else "the safetensors header"
        raise DigestMismatchError(
            f"{path}: {algorithm.value} digest {digest} differs from the manifest's "
            f"{entry.digest}; corrupted bytes are in {where}; restore the file from a good copy"
        ) from read.header_error
    if read.header_error is not None:
        raise read.header_error
    tensors = read.tensors
    want = {t.key: t for t in expected}
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise MissingTensorError(f"{path}: keys {missing[:8]} listed in the manifest are absent")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise UnexpectedTensorError(f"{path}: keys {extra[:8]} are not listed in the manifest")
    for key, t in want.items():
        got = tensors[key]
        if tuple(got.shape) != t.shape:
            raise ShapeMismatchError(
                f"{path}: key {key!r} has shape {list(got.shape)}, "
                f"the manifest expects {list(t.shape)}"
            )
        if dtype_name(got.dtype) != t.dtype:
            raise DtypeMismatchError(
                f"{path}: key {key!r} has dtype {dtype_name(got.dtype)}, "
                f"the manifest expects {t.dtype}"
            )
    return tensors


def _read_json_file(ckpt: Path, entry: FileEntry, manifest: Manifest, verify: bool) -> bytes:
    path = ckpt / entry.file
    if not path.is_file():
        raise MissingFileError(f"{path}: listed in the manifest but missing")
    algorithm = manifest.digest_algorithm
    buf, digest = read_file_bytes(
        path,
        expected_size=entry.size,
        algorithm=algorithm if verify else None,
        max_size=MAX_JSON_FILE_BYTES,
    )
    if verify and digest != entry.digest:
        raise DigestMismatchError(
            f"{path}: {algorithm.value} digest {digest} differs from the manifest's "
            f"{entry.digest}; the file is corrupted"
        )
    return bytes(buf)


def _read_manifest(ckpt: Path) -> Manifest:
    path = ckpt / MANIFEST
    if not path.is_file() and not path.is_symlink():
        raise MissingFileError(f"{path} does not exist")
    try:
        data = _fs.read_bounded(path, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise _fs.io_error(exc, path, "read the manifest") from exc
    return parse_manifest(data, str(path))


def _lock_root(directory: str | os.PathLike[str]) -> Path | None:
    # The root whose lock guards ``directory``: the directory itself when it is a root, its
    # parent when it is a checkpoint inside a root (pruning may delete it), else None.
    path = Path(directory)
    if (path / _fs.LOCK_FILE).is_file():
        return path
    if (path / MANIFEST).is_file() and (path.parent / _fs.LOCK_FILE).is_file():
        return path.parent
    return None


@contextmanager
def _reading(directory: str | os.PathLike[str], lock_timeout: float) -> Iterator[bool]:
    # Readers hold the root's lock shared, so no writer publishes or prunes meanwhile; any
    # OSError on the way becomes a CheckpointIOError naming the file. Yields whether a lock
    # is held (roots written before 0.3 have no lock file).
    try:
        root = _lock_root(directory)
        with ExitStack() as stack:
            locked = False
            if root is not None:
                locked = stack.enter_context(
                    _fs.root_lock(root, exclusive=False, timeout=lock_timeout)
                )
            yield locked
    except OSError as exc:
        raise _fs.io_error(exc, exc.filename or directory, "read the checkpoint") from exc


def load(
    directory: str | os.PathLike[str],
    *,
    verify: bool = True,
    rank: int | None = None,
    lock_timeout: float = _fs.DEFAULT_LOCK_TIMEOUT,
) -> LoadedCheckpoint:
    """Read and verify a checkpoint.

    Args:
        directory: a checkpoint root (its ``latest`` is followed) or one checkpoint directory.
        verify: check every file's digest against the manifest, in the algorithm the
            manifest names (sizes and headers are always checked).
        rank: whose rank-local tensors and training state to read (default: this process's
            rank, 0 without a process group).
        lock_timeout: seconds to wait while a writer publishes into or prunes the root
            (the root's lock is held shared while reading, so pruning never removes the
            checkpoint being read).

    Returns:
        The manifest, the parameter tensors by name, and the training state.

    Raises:
        CheckpointError: a subclass naming the file and key for anything missing, unexpected,
            mis-shaped, mis-typed, corrupted, unsafe or of an unknown format version;
            ``CheckpointIOError`` when the operating system refuses a read;
            ``CheckpointLockedError`` when a writer holds the root for ``lock_timeout``.
    """
    with _reading(directory, lock_timeout) as locked:
        try:
            return _load(directory, verify=verify, rank=rank)
        except (MissingFileError, TruncatedFileError):
            # Without a lock (a root from before 0.3, pruned by an old writer), the checkpoint
            # `latest` named may have been pruned mid-read: resolve `latest` again, once.
            if locked or (Path(directory) / MANIFEST).exists():
                raise
    with _reading(directory, lock_timeout):
        return _load(directory, verify=verify, rank=rank)


def _load(directory: str | os.PathLike[str], *, verify: bool, rank: int | None) -> LoadedCheckpoint:
    ckpt = resolve_checkpoint(directory)
    manifest = _read_manifest(ckpt)
    _check_unsafe(ckpt, manifest)
    if rank is None:
        rank = _dist.rank_and_world()[0]
    if not 0 <= rank < manifest.world_size:
        raise CheckpointError(
            f"{ckpt}: rank {rank} asked for, but the checkpoint was written by world_size "
            f"{manifest.world_size}; pass rank= in [0, {manifest.world_size})"
        )
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    ts_json: bytes | None = None
    st_file, js_file = training_state_files(rank)
    mine = [e for e in manifest.files if e.rank is None or e.rank == rank]
    st_entries = [e for e in mine if e.file.endswith(".safetensors")]
    # This thread parses each file's header and allocates its tensors (in its own malloc
    # arena, which keeps freed memory for the next load; worker threads' arenas gave it
    # back, and every load paid the page faults again: 3-4x slower). The readers fill the
    # tensors in parallel, so the page faults of fresh memory spread over the cores, and
    # each file's worker hashes its bytes in order while the next file is already read.
    with ExitStack() as pools:
        readers = pools.enter_context(ThreadPoolExecutor(_read_threads()))
        reads = [
            _read_safetensors_file(
                ckpt, e, manifest, verify, readers, pools.enter_context(ThreadPoolExecutor(1))
            )
            for e in st_entries
        ]
        for e, read in zip(st_entries, reads, strict=True):
            if isinstance(read, CheckpointError):
                raise read
            by_file[e.file] = _check_safetensors_file(ckpt, e, manifest, verify, read)
    for entry in mine:
        if entry.file.endswith(".safetensors"):
            continue
        if entry.file == js_file:
            ts_json = _read_json_file(ckpt, entry, manifest, verify)
        elif verify:
            _read_json_file(ckpt, entry, manifest, verify)
    where: dict[str, TensorEntry] = {}
    for t in manifest.tensors:
        if t.kind is TensorKind.PARAMETER and t.file in by_file:
            if t.name in where:
                raise ManifestError(
                    f"{ckpt}: parameter {t.name!r} is stored twice, in {where[t.name].file!r} "
                    f"and {t.file!r}"
                )
            where[t.name] = t
            tensors[t.name] = by_file[t.file][t.key]
    for p in manifest.parameters:
        if p.name not in tensors:
            raise MissingTensorError(
                f"{ckpt}: parameter {p.name!r} has no stored tensor for rank {rank}; the manifest "
                "lists it but no file holds it"
            )
        got = tensors[p.name]
        # rank-local tensors (in per-rank files) may legitimately differ in shape per rank
        if where[p.name].rank is None and tuple(got.shape) != p.shape:
            raise ShapeMismatchError(
                f"{ckpt}: parameter {p.name!r} is stored with shape {list(got.shape)} in "
                f"{where[p.name].file!r}, the manifest expects {list(p.shape)}"
            )
        if p.dtype != dtype_name(got.dtype):
            raise DtypeMismatchError(
                f"{ckpt}: parameter {p.name!r} is stored as {dtype_name(got.dtype)}, the manifest "
                f"expects {p.dtype}"
            )
    extra = sorted(set(tensors) - {p.name for p in manifest.parameters})
    if extra:
        raise UnexpectedTensorError(
            f"{ckpt}: stored tensors {extra[:8]} are not manifest parameters"
        )
    state = None
    if manifest.training_state is not None:
        if ts_json is None or st_file not in by_file:
            raise MissingFileError(
                f"{ckpt}: the manifest records a training state but lists no {st_file}/{js_file}"
            )
        state = TrainingState.from_files(by_file[st_file], ts_json, str(ckpt / js_file))
    return LoadedCheckpoint(manifest=manifest, tensors=tensors, training_state=state, path=ckpt)


def verify(
    directory: str | os.PathLike[str],
    *,
    allow_non_finite: bool = False,
    lock_timeout: float = _fs.DEFAULT_LOCK_TIMEOUT,
) -> Manifest:
    """Verify every file of every rank of a checkpoint (what the CLI's ``verify`` runs).

    Args:
        directory: a checkpoint root or one checkpoint directory.
        allow_non_finite: accept tensors holding NaN/Inf (their digests still must match).
        lock_timeout: seconds to wait while a writer publishes into or prunes the root.

    Returns:
        The verified manifest.

    Raises:
        NonFiniteTensorError: a tensor holds NaN/Inf (unless ``allow_non_finite``); its
            ``tensors`` lists them all.
        CheckpointError: the first other problem found.
    """
    with _reading(directory, lock_timeout):
        ckpt = resolve_checkpoint(directory)
        manifest = _read_manifest(ckpt)
        for r in range(manifest.world_size):
            _load(ckpt, verify=True, rank=r)
        if not allow_non_finite:
            found = scan_non_finite(ckpt, manifest)
            if found:
                raise non_finite_error(
                    found,
                    str(ckpt),
                    "the files are intact but the values are unusable; resume from an earlier "
                    "checkpoint (or pass allow_non_finite=True / --allow-non-finite to accept)",
                )
    return manifest


def scan_non_finite(ckpt: Path, manifest: Manifest) -> list[NonFiniteTensor]:
    """Return every stored tensor (all ranks' files) holding NaN/Inf, in manifest order.

    Raises:
        CheckpointError: a file cannot be read (sizes and headers are checked).
    """
    names = {(t.file, t.key): t.name for t in manifest.tensors}
    found: list[NonFiniteTensor] = []
    for entry in manifest.files:
        if not entry.file.endswith(".safetensors"):
            continue
        path = ckpt / entry.file
        if not path.is_file() or path.is_symlink():
            raise MissingFileError(f"{path}: listed in the manifest but missing")
        read = read_safetensors(
            path,
            expected_size=entry.size,
            expected={t.key: (t.dtype, t.shape) for t in manifest.tensors if t.file == entry.file},
        )
        if read.header_error is not None:
            raise read.header_error
        found += find_non_finite(
            ((names.get((entry.file, k), k), t) for k, t in read.tensors.items()), entry.file
        )
    return found


@dataclass(frozen=True)
class CheckpointReport:
    """What :func:`inspect` found in a checkpoint.

    Attributes:
        path: the checkpoint directory (``latest`` followed).
        manifest: its manifest.
        non_finite: the stored tensors holding NaN/Inf (every rank's files), in manifest order.
    """

    path: Path
    manifest: Manifest
    non_finite: tuple[NonFiniteTensor, ...]


def inspect(
    directory: str | os.PathLike[str], *, lock_timeout: float = _fs.DEFAULT_LOCK_TIMEOUT
) -> CheckpointReport:
    """Read a checkpoint's manifest and scan every stored tensor for NaN/Inf values.

    Digests are not checked (that is :func:`verify`); sizes and headers are.

    Raises:
        CheckpointError: a subclass naming the file, when the checkpoint cannot be read.
    """
    with _reading(directory, lock_timeout):
        ckpt = resolve_checkpoint(directory)
        manifest = _read_manifest(ckpt)
        _check_unsafe(ckpt, manifest)
        found = scan_non_finite(ckpt, manifest)
    return CheckpointReport(ckpt, manifest, tuple(found))


def _local_part(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, Shard

    mesh = param.device_mesh
    coord = mesh.get_coordinate()
    t = full
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or coord is None:
            raise CheckpointError(f"cannot restore into a DTensor with placement {placement}")
        chunks = torch.chunk(t, mesh.size(dim), dim=placement.dim)
        t = chunks[coord[dim]] if coord[dim] < len(chunks) else t.narrow(placement.dim, 0, 0)
    return t


def restore(target: nn.Module | AdaptationResult, loaded: LoadedCheckpoint) -> tuple[str, ...]:
    """Copy loaded tensors into existing parameters in place (Parameter objects are kept).

    Args:
        target: an AdaptationResult (its named parameters) or a module (its
            ``named_parameters()``; every trainable one must be in the checkpoint).
        loaded: what :func:`load` returned.

    Returns:
        The names restored, in checkpoint order.

    Raises:
        MissingTensorError: a target parameter has no tensor in the checkpoint.
        UnexpectedTensorError: a checkpoint tensor has no target parameter.
        ShapeMismatchError, DtypeMismatchError: a tensor does not fit its parameter.
    """
    if isinstance(target, AdaptationResult):
        params = dict(target.named_optimizer_parameters)
        expected = set(params)
    elif isinstance(target, nn.Module):
        params = dict(target.named_parameters())
        expected = {n for n, p in params.items() if p.requires_grad}
    else:
        raise CheckpointError(
            f"restore expects an nn.Module or AdaptationResult, got {type(target).__name__}"
        )
    unexpected = sorted(set(loaded.tensors) - set(params))
    if unexpected:
        raise UnexpectedTensorError(
            f"{loaded.path}: checkpoint tensors {unexpected[:8]} match no parameter of the target"
        )
    missing = sorted(expected - set(loaded.tensors))
    if missing:
        raise MissingTensorError(
            f"{loaded.path}: target parameters {missing[:8]} have no tensor in the checkpoint"
        )
    plan = []
    for name, src in loaded.tensors.items():
        p = params[name]
        if _dist.is_dtensor(p):
            src = _local_part(src, p)
            dst = p.to_local()
        else:
            dst = p
        if tuple(src.shape) != tuple(dst.shape):
            raise ShapeMismatchError(
                f"{loaded.path}: tensor {name!r} has shape {list(src.shape)}, the parameter "
                f"{list(dst.shape)}"
            )
        if src.dtype != dst.dtype:
            raise DtypeMismatchError(
                f"{loaded.path}: tensor {name!r} has dtype {dtype_name(src.dtype)}, the parameter "
                f"{dtype_name(dst.dtype)}"
            )
        plan.append((dst, src))
    # Validate everything first so a failed restore leaves the parameters untouched.
    with torch.no_grad():
        for dst, src in plan:
            dst.copy_(src)
    return tuple(loaded.tensors)
