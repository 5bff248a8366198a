"""Host-memory hygiene after expert weights leave the module tree.

``from_pretrained`` leaves weights it did not need to cast as views of the checkpoint's file
mapping. After :func:`moe_experts.wrap` frees the experts, one such view of a dense weight keeps
its whole shard mapped, so the expert pages read from it stay resident (counted in RSS as file
pages). Re-homing the few dense views into owned memory lets the mappings go; returning freed
heap pages to the OS (``malloc_trim``) removes what the allocator kept.

Training wants the opposite of that hygiene: every step allocates and frees the same large
activation tensors, and glibc serves each one over 32 MB with a fresh ``mmap`` that the kernel
must fault in and zero page by page; :func:`reuse_freed_host_memory` keeps them in the heap.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
from pathlib import Path

import torch
from torch import nn

from moe_experts.placeholders import is_placeholder

__all__ = [
    "file_backed_ranges",
    "release_file_views",
    "reuse_freed_host_memory",
    "trim_host_heap",
]


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


# glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_MAX.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_INT_MAX = 2**31 - 1


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def reuse_freed_host_memory() -> bool:
    """Serve large allocations from the reusable heap, not a fresh ``mmap`` each (glibc only).

    A training step frees and re-allocates the same large tensors every step; as fresh
    mappings, each costs page faults and zeroing (a DPO step at Qwen3-30B-A3B layer sizes ran
    6% faster without them). Process-wide and kept until exit: freed blocks stay in the heap
    for the next step (:func:`trim_host_heap` still returns them on request), and glibc falls
    back to ``mmap`` where the heap cannot grow. Returns False where ``mallopt`` is missing.
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc (musl, macOS)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def trim_host_heap() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim``); False where unavailable."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:  # not glibc (musl, macOS): nothing to trim
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
