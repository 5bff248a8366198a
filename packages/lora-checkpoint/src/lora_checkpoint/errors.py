"""Exceptions of lora-checkpoint; all subclass :class:`CheckpointError` (a ``ValueError``)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointLockedError",
    "DigestMismatchError",
    "DtypeMismatchError",
    "ManifestError",
    "MissingFileError",
    "MissingTensorError",
    "NonFiniteTensorError",
    "ShapeMismatchError",
    "TruncatedFileError",
    "UnexpectedTensorError",
    "UnknownFormatVersionError",
    "UnsafeFileError",
]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, read, verified or restored."""


class ManifestError(CheckpointError):
    """``manifest.json`` is missing fields, malformed or inconsistent."""


class UnknownFormatVersionError(ManifestError):
    """The manifest's ``format_version`` is not one this reader knows or can migrate."""


class MissingFileError(CheckpointError):
    """A file the manifest (or the checkpoint layout) requires does not exist."""


class TruncatedFileError(CheckpointError):
    """A file is shorter than the manifest says, or its header is cut off."""


class DigestMismatchError(CheckpointError):
    """A file's or tensor's digest (or size) differs from the manifest's record."""


class MissingTensorError(CheckpointError):
    """A tensor that should be present (in a file or in the model) is absent."""


class UnexpectedTensorError(CheckpointError):
    """A tensor is present that the manifest (or the model) does not expect."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape differs from the expected one."""


class DtypeMismatchError(CheckpointError):
    """A tensor's dtype differs from the expected one."""


class UnsafeFileError(CheckpointError):
    """A file could execute code when read (pickle, ``.bin``/``.pt``) or escapes the directory."""


class CheckpointExistsError(CheckpointError):
    """A checkpoint with the requested name already exists under the root."""


class CheckpointIOError(CheckpointError):
    """The operating system refused a read or write (disk full, read-only, permissions)."""


class CheckpointLockedError(CheckpointError):
    """Another process held the checkpoint root's lock for longer than the timeout."""


class NonFiniteTensorError(CheckpointError):
    """A tensor holds NaN or infinite values (``save``/``verify`` refuse it unless allowed).

    Attributes:
        tensors: the offending tensors (``NonFiniteTensor`` records: name, file, counts).
    """

    def __init__(self, message: str, *, tensors: tuple[Any, ...] = ()) -> None:
        """Keep ``tensors`` beside the message."""
        super().__init__(message)
        self.tensors = tensors
