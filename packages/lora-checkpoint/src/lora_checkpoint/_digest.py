"""The digest algorithms a manifest can name, and hashers for them.

Format 2 writes BLAKE3 (256-bit, the ``b3sum`` default); format 1 checkpoints, migrated on
read, name SHA-256. Both digests are 64 lowercase hex characters of a plain hash of the bytes.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Protocol

from blake3 import blake3

__all__ = ["WRITE_ALGORITHM", "DigestAlgorithm", "Hasher", "digest_of", "new_hasher"]

# Buffers (or files) at least this large are hashed by blake3's thread pool: below it the
# hand-off to the pool costs more than the second core gains (BLAKE3 splits its input into
# 1 KiB chunks hashed as a tree, so it needs large inputs to spread the tree over cores).
PARALLEL_HASH_BYTES = 1024 * 1024


class DigestAlgorithm(enum.StrEnum):
    """The hash a manifest's ``digest`` fields are computed with."""

    BLAKE3 = "blake3"  # format 2: fast, multithreaded, 256-bit (``b3sum`` reproduces it)
    SHA256 = "sha256"  # format 1 checkpoints (``sha256sum`` reproduces it)


# What save() writes; SHA-256 is only ever read (from migrated format 1 manifests).
WRITE_ALGORITHM = DigestAlgorithm.BLAKE3


class Hasher(Protocol):
    """The part of the ``hashlib`` interface both algorithms share."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object:
        """Feed ``data`` into the hash."""

    def hexdigest(self) -> str:
        """Return the digest of everything fed so far as lowercase hex."""


def new_hasher(algorithm: DigestAlgorithm, size_hint: int = 0) -> Hasher:
    """Return an empty hasher; blake3 may use several threads when ``size_hint`` is large.

    Args:
        algorithm: the manifest's digest algorithm.
        size_hint: the number of bytes that will be hashed (0 if unknown).
    """
    if algorithm is DigestAlgorithm.BLAKE3:
        # blake3.AUTO: the crate's shared pool, one thread per core; the bindings release
        # the GIL while hashing, so writes and reads of other threads go on meanwhile.
        threads = blake3.AUTO if size_hint >= PARALLEL_HASH_BYTES else 1
        return blake3(max_threads=threads)
    return hashlib.sha256()


def digest_of(algorithm: DigestAlgorithm, data: bytes | bytearray | memoryview) -> str:
    """Return the hex digest of ``data`` in one call."""
    h = new_hasher(algorithm, len(data))
    h.update(data)
    return h.hexdigest()
