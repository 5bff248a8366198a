"""Durable file-system primitives: fsync'd writes, atomic replace, directory fsync."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durable(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` and fsync it (the file must not exist)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, ``os.replace``, dir fsync."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    write_bytes_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no crash can leave a partial one under its real name."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Delete temp/trash leftovers of writers that died (single writer per root assumed)."""
    for child in root.iterdir():
        if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
