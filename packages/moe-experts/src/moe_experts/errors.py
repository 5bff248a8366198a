"""Exception classes raised by moe-experts; each subclasses the builtin a caller would expect."""

from __future__ import annotations

__all__ = [
    "AdaptError",
    "GradientCheckError",
    "LoadError",
    "PackingError",
    "PlaceholderAccessError",
    "SelfCheckError",
    "TransformersVersionError",
    "UnsupportedModelError",
    "WrapError",
]


class UnsupportedModelError(ValueError):
    """The model is not one of the MoE families with an architecture spec; lists the supported."""


class TransformersVersionError(UnsupportedModelError):
    """The installed transformers is older than a family needs; names both versions and the fix."""


class WrapError(ValueError):
    """A model cannot be wrapped (bad argument, unexpected expert shapes or activation)."""


class SelfCheckError(WrapError):
    """``wrap``'s self-check found the kernel disagreeing with the original experts module."""


class GradientCheckError(RuntimeError):
    """Trainable parameters received no gradient, a non-finite one, or an all-zero one."""


class AdaptError(ValueError):
    """Expert LoRA cannot be applied (model not wrapped, config mismatch, foreign PEFT layout)."""


class PlaceholderAccessError(RuntimeError):
    """Code tried to read the values of a zero-storage expert placeholder."""


class LoadError(ValueError):
    """A checkpoint cannot be streamed (missing file or key, mis-shaped tensor); names them."""


class PackingError(ValueError):
    """A packed batch does not keep its examples apart the way the model's family needs."""
