"""The one error type the fine-tune CLI turns into a message and a non-zero exit."""

from __future__ import annotations

__all__ = ["FinetuneError"]


class FinetuneError(RuntimeError):
    """A user-facing problem: bad config, missing file, unsupported model, corrupt checkpoint."""
