"""Durable file-system primitives: fsync'd writes, atomic replace, directory fsync, the root
lock, claims on temp directories, bounded reads and OSError translation."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from lora_checkpoint.errors import CheckpointIOError, CheckpointLockedError, UnsafeFileError

LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
# Lock file in the root: writers hold it exclusively to create temp directories, publish and
# prune; readers of the root hold it shared while they resolve ``latest`` and read.
LOCK_FILE = ".lock"
# Seconds a writer (or reader) waits for the root lock before giving up; a save normally
# holds it for milliseconds (a rename, a pointer update, a prune), so a minute of waiting
# means the holder is stuck.
DEFAULT_LOCK_TIMEOUT = 60.0
_POLL_MAX_S = 0.05
# Test hook for crash-safety tests: "<point>:<checkpoint name>" kills this process with
# SIGKILL when the save of that checkpoint reaches that point (see crash_point).
KILL_AT_ENV = "LORA_CHECKPOINT_KILL_AT"
# The points of a save, in order (writer.save, _publish, replace_atomic, remove_tree).
CRASH_POINTS = (
    "temp-created",
    "files-written",
    "manifest-written",
    "renamed",
    "published",
    "latest-temp-written",
    "latest-written",
    "trash-renamed",
    "pruned",
)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_HINTS = {
    errno.ENOSPC: "the disk is full; free space or save to another directory",
    errno.EDQUOT: "the disk quota is exhausted; free space or save to another directory",
    errno.EROFS: "the file system is read-only; save to a writable directory",
    errno.EACCES: "permission denied; check the directory's owner and mode",
    errno.EPERM: "operation not permitted; check the directory's owner and mode",
    errno.EIO: "the device reported an I/O error; check the disk",
}


def crash_point(point: str, name: str) -> None:
    """SIGKILL this process here when ``LORA_CHECKPOINT_KILL_AT`` is ``<point>:<name>``.

    Only crash-safety tests set the variable: it lets them stop a save at each of its
    ``CRASH_POINTS`` exactly as a power cut or the OOM killer would.
    """
    spec = os.environ.get(KILL_AT_ENV)
    if spec and spec == f"{point}:{name}":
        os.kill(os.getpid(), signal.SIGKILL)


def io_error(exc: OSError, path: str | os.PathLike[str], action: str) -> CheckpointIOError:
    """Return the :class:`CheckpointIOError` naming ``path`` for an ``OSError``, to raise."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    hint = _HINTS.get(exc.errno or 0, "check the file system")
    reason = exc.strerror or type(exc).__name__
    return CheckpointIOError(f"{path}: could not {action}: {reason} ({code}); {hint}")


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durable(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` and fsync it (the file must not exist)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomic(path: Path, data: bytes, *, crash_name: str = "") -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, ``os.replace``, dir fsync.

    ``crash_name`` names the checkpoint being saved, for :func:`crash_point`.
    """
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    try:
        write_bytes_durable(tmp, data)
        crash_point("latest-temp-written", crash_name)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def remove_tree(path: Path, *, crash_name: str = "") -> None:
    """Delete a directory so that no crash can leave a partial one under its real name.

    ``crash_name`` names the checkpoint being saved, for :func:`crash_point`.
    """
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    crash_point("trash-renamed", crash_name)
    shutil.rmtree(trash, ignore_errors=True)


def claim_dir(path: Path) -> int:
    """Hold an exclusive ``flock`` on directory ``path`` (a live writer's temp directory).

    Returns:
        The descriptor; closing it (or the process dying) releases the claim.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _claimed(path: Path) -> bool:
    # A temp directory whose writer is alive is flocked by it; a dead writer's lock is gone.
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_stale(root: Path) -> None:
    """Delete temp/trash leftovers of writers that died (call with the root lock held).

    Temp directories still claimed by a live writer (see :func:`claim_dir`) are kept.
    """
    for child in root.iterdir():
        if not child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            continue
        if child.is_dir() and not child.is_symlink():
            if not _claimed(child):
                shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a reader or a process that did not record its pid"


@contextmanager
def root_lock(root: Path, *, exclusive: bool, timeout: float) -> Iterator[bool]:
    """Hold ``<root>/.lock`` (``flock``): exclusive for writers, shared for readers.

    Args:
        root: the checkpoint root.
        exclusive: writers (create temp dirs, publish, prune); False for readers.
        timeout: seconds to wait for the lock; 0 fails at once if it is taken.

    Yields:
        Whether the lock is held: a reader of a root without a lock file (never written by
        this version, or read-only to us) reads without one.

    Raises:
        CheckpointLockedError: the lock stayed taken for ``timeout`` seconds; names the pid of
            the writer holding it.
        CheckpointIOError: a writer cannot create the lock file.
        UnsafeFileError: the lock file is a symbolic link.
    """
    path = root / LOCK_FILE
    fd = -1
    try:
        if exclusive:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
        else:
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(
                f"{path} is a symbolic link; delete it (the lock file must be a regular file)"
            ) from exc
        if exclusive:
            raise io_error(exc, path, "create the checkpoint root's lock file") from exc
    if fd < 0:
        yield False
        return
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = time.monotonic() + max(0.0, timeout)
    turnstile = -1
    try:
        # The root directory's own flock is a turnstile that keeps a stream of readers from
        # starving a writer: a waiting writer holds it, so new readers queue behind it
        # while the readers already in finish.
        turnstile = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
        _wait_for(turnstile, mode, deadline, timeout, path, fd)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        _wait_for(fd, mode, deadline, timeout, path, fd)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        if exclusive:
            with suppress(OSError):  # only the pid in a waiter's error message would be lost
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield True
        if exclusive:
            with suppress(OSError):
                os.ftruncate(fd, 0)  # no stale pid for the next waiter to blame
    finally:
        if turnstile >= 0:
            os.close(turnstile)
        os.close(fd)  # releases the flock


def _wait_for(
    fd: int, mode: int, deadline: float, timeout: float, path: Path, lock_fd: int
) -> None:
    # Polls (flock has no timeout of its own) with a backoff up to _POLL_MAX_S.
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise CheckpointLockedError(
                    f"{path}: locked by {_holder(lock_fd)} for more than {timeout:g} s; another "
                    "writer is saving into this root or pruning it. Wait for it to finish, "
                    "pass a larger lock_timeout, or save to another root"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)


def read_bounded(path: Path, limit: int) -> bytes:
    """Read a small file, refusing symbolic links and files over ``limit`` bytes.

    Raises:
        UnsafeFileError: ``path`` is a symbolic link or larger than ``limit`` bytes.
        OSError: the file cannot be opened or read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(
                f"{path} is a symbolic link; checkpoint files must be regular files inside "
                "the checkpoint root (copy the target in instead)"
            ) from exc
        raise
    try:
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, limit + 1 - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > limit:
        raise UnsafeFileError(
            f"{path} is larger than {limit} bytes, far more than this file ever holds; "
            "it is not one lora-checkpoint wrote"
        )
    return b"".join(parts)
