"""Load the compiled extension once; fall back to the reference with one clear warning."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from types import ModuleType

from kt_kernel.errors import NativeBackendError

__all__ = [
    "REQUIRE_NATIVE_ENV",
    "THREADS_ENV",
    "BackendInfo",
    "backend_info",
    "get_num_threads",
    "native_module",
    "set_num_threads",
]

REQUIRE_NATIVE_ENV = "KT_KERNEL_REQUIRE_NATIVE"
# Read once by the extension: the kernel's thread count unless set_num_threads overrides it.
THREADS_ENV = "KT_KERNEL_THREADS"
# The native bound on set_num_threads (moe_common.h kMaxThreads): OpenMP takes an int.
MAX_THREADS = 1024


def _load() -> tuple[ModuleType | None, str | None]:
    # The extension links against libc10/libtorch, which only importing torch puts in reach.
    import torch  # noqa: F401

    try:
        from kt_kernel import _C  # type: ignore[attr-defined]
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return _C, None


_MODULE, _ERROR = _load()
if _MODULE is None:
    if os.environ.get(REQUIRE_NATIVE_ENV, "0") == "1":
        raise NativeBackendError(
            f"kt_kernel's compiled extension kt_kernel._C failed to load ({_ERROR}) and "
            f"{REQUIRE_NATIVE_ENV}=1 forbids the fallback; rebuild the wheel with "
            "`pip install --no-build-isolation` against the installed torch"
        )
    warnings.warn(
        f"kt_kernel: the compiled extension kt_kernel._C failed to load ({_ERROR}); "
        "falling back to the PyTorch reference implementation (correct but slow). "
        f"Set {REQUIRE_NATIVE_ENV}=1 to make this an ImportError.",
        RuntimeWarning,
        stacklevel=2,
    )


def native_module() -> ModuleType | None:
    """The loaded ``kt_kernel._C`` module, or ``None`` when it failed to load."""
    return _MODULE


@dataclass(frozen=True)
class BackendInfo:
    """Which implementation ``backend="auto"`` uses and what the CPU offers it.

    Attributes:
        active: ``"native"`` (the C++ extension) or ``"reference"`` (plain PyTorch).
        native_available: whether ``kt_kernel._C`` loaded.
        native_error: the load error when it did not, else ``None``.
        isa: instruction set every native loop dispatches to (``"avx512"``, ``"avx2"`` or
            ``"scalar"``): the best the CPU has, capped by ``KT_KERNEL_ISA``; ``None``
            without the extension.
        cpu_features: the CPU features the dispatcher detected.
        num_threads: OpenMP threads the kernel's parallel regions use
            (:func:`get_num_threads`).
        torch_version: torch the extension was compiled against (``None`` without it).
    """

    active: str
    native_available: bool
    native_error: str | None
    isa: str | None
    cpu_features: tuple[str, ...] = field(default_factory=tuple)
    num_threads: int = 1
    torch_version: str | None = None


def backend_info() -> BackendInfo:
    """Report the active implementation, the load error if any, and the CPU features used."""
    import torch

    if _MODULE is None:
        return BackendInfo("reference", False, _ERROR, None, (), torch.get_num_threads(), None)
    ops = torch.ops.kt_kernel
    return BackendInfo(
        active="native",
        native_available=True,
        native_error=None,
        isa=str(ops.isa()),
        cpu_features=tuple(ops.cpu_features()),
        num_threads=get_num_threads(),
        torch_version=str(ops.torch_version()),
    )


def set_num_threads(n: int | None) -> None:
    """Set the threads of the kernel's parallel regions (``None`` or 0: torch's count again).

    The kernel's count is separate from ``torch.set_num_threads`` (dense layers keep theirs);
    it starts from ``KT_KERNEL_THREADS`` when that is set. Results do not depend on it. Without
    the compiled extension the reference runs on torch's threads and this has no effect.

    Raises:
        KernelInputError: ``n`` is not an int in [0, 1024].
    """
    from kt_kernel.errors import KernelInputError

    if n is None:
        n = 0
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_THREADS:
        raise KernelInputError(
            f"set_num_threads needs an int in [0, {MAX_THREADS}] or None, got {n!r}"
        )
    if _MODULE is not None:
        import torch

        torch.ops.kt_kernel.set_num_threads(n)


def get_num_threads() -> int:
    """Threads the kernel's parallel regions use now (``torch.get_num_threads()`` by default)."""
    import torch

    if _MODULE is None:
        return torch.get_num_threads()
    return int(torch.ops.kt_kernel.get_num_threads())
