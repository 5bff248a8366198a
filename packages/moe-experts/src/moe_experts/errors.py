"""Exception classes raised by moe-experts; each subclasses the builtin a caller would expect."""

from __future__ import annotations

__all__ = [
    "AdaptError",
    "LoadError",
    "PlaceholderAccessError",
    "UnsupportedModelError",
    "WrapError",
]


class UnsupportedModelError(ValueError):
    """The model is not one of the MoE families with an architecture spec; lists the supported."""


class WrapError(ValueError):
    """A model cannot be wrapped (bad argument, unexpected expert shapes or activation)."""


class AdaptError(ValueError):
    """Expert LoRA cannot be applied (model not wrapped, config mismatch, foreign PEFT layout)."""


class PlaceholderAccessError(RuntimeError):
    """Code tried to read the values of a zero-storage expert placeholder."""


class LoadError(ValueError):
    """A checkpoint cannot be streamed (missing file or key, mis-shaped tensor); names them."""
