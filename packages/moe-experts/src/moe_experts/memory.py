"""Host-memory hygiene after expert weights leave the module tree.

``from_pretrained`` leaves weights it did not need to cast as views of the checkpoint's file
mapping. After :func:`moe_experts.wrap` frees the experts, one such view of a dense weight keeps
its whole shard mapped, so the expert pages read from it stay resident (counted in RSS as file
pages). Re-homing the few dense views into owned memory lets the mappings go; returning freed
heap pages to the OS (``malloc_trim``) removes what the allocator kept.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
from pathlib import Path

import torch
from torch import nn

from moe_experts.placeholders import is_placeholder

__all__ = ["file_backed_ranges", "release_file_views", "trim_host_heap"]


def file_backed_ranges() -> list[tuple[int, int]]:
    """Sorted ``(start, end)`` address ranges of this process's regular-file mappings.

    Returns an empty list where ``/proc/self/maps`` does not exist (non-Linux).
    """
    maps = Path("/proc/self/maps")
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        # An inode other than 0 and an absolute path: a regular file (not heap, stack, anon).
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    out.sort()
    return out


def _in_ranges(ptr: int, starts: list[int], ranges: list[tuple[int, int]]) -> bool:
    i = bisect.bisect_right(starts, ptr) - 1
    return i >= 0 and ranges[i][0] <= ptr < ranges[i][1]


def release_file_views(model: nn.Module) -> int:
    """Copy every CPU parameter/buffer that is a view of a mapped file into owned memory.

    The tensors keep their identity (``.data`` is replaced), so tied weights stay tied and
    optimizers holding them are unaffected.

    Args:
        model: any module; zero-storage placeholders are skipped.

    Returns:
        Bytes copied out of file mappings.
    """
    ranges = file_backed_ranges()
    if not ranges:
        return 0
    starts = [r[0] for r in ranges]
    moved = 0
    seen: set[int] = set()
    tensors = [*model.parameters(), *model.buffers()]
    with torch.no_grad():
        for t in tensors:
            if id(t) in seen or is_placeholder(t) or t.device.type != "cpu" or t.numel() == 0:
                continue
            seen.add(id(t))
            if _in_ranges(t.untyped_storage().data_ptr(), starts, ranges):
                t.data = t.data.clone()
                moved += t.nbytes
    return moved


def trim_host_heap() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim``); False where unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
