"""Exception classes raised by kt-kernel; each subclasses the builtin a caller would expect."""

from __future__ import annotations

__all__ = ["KernelDTypeError", "KernelInputError", "NativeBackendError"]


class KernelInputError(ValueError):
    """An argument has the wrong shape, value or layout; the message names it."""


class KernelDTypeError(KernelInputError, TypeError):
    """An argument has a dtype (or device) the kernel does not accept; the message names it."""


class NativeBackendError(ImportError):
    """The compiled extension was required (``KT_KERNEL_REQUIRE_NATIVE=1``) but cannot load."""
