"""Finding NaN and infinite values in tensors, chunk by chunk (no tensor-sized mask)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lora_checkpoint.errors import NonFiniteTensorError

# Elements checked at a time: a chunk (4-16 MiB) stays cached between the reductions and
# the counts, and no tensor-sized boolean mask is ever allocated.
_CHUNK = 1 << 22
_LISTED = 8


@dataclass(frozen=True)
class NonFiniteTensor:
    """A tensor holding NaN or infinite values.

    Attributes:
        name: the parameter or training-state name.
        file: the checkpoint file holding it ("" before it is written).
        nan: how many elements are NaN.
        inf: how many elements are +/-infinity.
    """

    name: str
    file: str
    nan: int
    inf: int

    def describe(self) -> str:
        """Return ``"'name' (in file): N NaN, M Inf"``."""
        where = f" in {self.file}" if self.file else ""
        return f"{self.name!r}{where}: {self.nan} NaN, {self.inf} Inf"


def count_non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    """Return ``(NaN count, infinity count)`` of a CPU tensor; ``(0, 0)`` for integer dtypes."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return 0, 0
    flat = tensor.detach().reshape(-1)
    widen = flat.element_size() == 1  # float8: no reductions for it; widen each chunk
    nan = inf = 0
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK]
        if widen:
            chunk = chunk.float()
        if not chunk.is_complex():
            # One pass without a mask: min and max propagate NaN and show +/-Inf, so both
            # finite means every element is (the counts below run only on a bad chunk).
            lo, hi = torch.aminmax(chunk)
            if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
                continue
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf


def find_non_finite(
    tensors: Iterable[tuple[str, torch.Tensor]], file: str = ""
) -> list[NonFiniteTensor]:
    """Return every tensor of ``(name, tensor)`` pairs that holds NaN or Inf values."""
    found = []
    for name, t in tensors:
        nan, inf = count_non_finite(t)
        if nan or inf:
            found.append(NonFiniteTensor(name, file, nan, inf))
    return found


def non_finite_error(found: list[NonFiniteTensor], where: str, fix: str) -> NonFiniteTensorError:
    """Return the error listing ``found`` (the first few), to raise."""
    listed = "; ".join(f.describe() for f in found[:_LISTED])
    more = f" and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
    return NonFiniteTensorError(
        f"{where}: non-finite values in {listed}{more}; {fix}", tensors=tuple(found)
    )
