"""``all_finite``: whether a float tensor holds no NaN and no inf, from its exponent bits.

For load-time checks of every checkpoint tensor: the native op (``torch.ops.kt_kernel.
all_finite``, ``csrc/finite.cpp``) reads each element once as an integer and tests its exponent
field, with no temporary and no float arithmetic, so a chunk just read from a file is checked
at cache bandwidth (about 5x torch's bf16 ``sum``). Without the extension, or for tensors it
does not take (not on the CPU, not contiguous), the same test runs in PyTorch.
"""

from __future__ import annotations

import torch

from kt_kernel._native import native_module
from kt_kernel.errors import KernelDTypeError

__all__ = ["FINITE_DTYPES", "all_finite"]

# dtype -> (integer view of the same width, the bits that are all ones exactly when the value
# is NaN or +-inf). E4M3FN has no inf and one NaN pattern per sign, S.1111.111.
_MASKS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF0_0000_0000_0000),
    torch.float32: (torch.int32, 0x7F80_0000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float8_e5m2: (torch.uint8, 0x7C),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
}
FINITE_DTYPES: tuple[torch.dtype, ...] = tuple(_MASKS)


def _all_finite_torch(t: torch.Tensor) -> bool:
    view, mask = _MASKS[t.dtype]
    return not bool(((t.view(view) & mask) == mask).any())


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of the float tensor ``t`` (any shape) is neither NaN nor +-inf.

    Raises:
        KernelDTypeError: ``t`` is not one of :data:`FINITE_DTYPES`.
    """
    if t.dtype not in _MASKS:
        names = ", ".join(str(d).removeprefix("torch.") for d in FINITE_DTYPES)
        raise KernelDTypeError(f"all_finite: t is {t.dtype}; expected one of {names}")
    if native_module() is not None and t.device.type == "cpu" and t.is_contiguous():
        return bool(torch.ops.kt_kernel.all_finite(t))
    return _all_finite_torch(t)
