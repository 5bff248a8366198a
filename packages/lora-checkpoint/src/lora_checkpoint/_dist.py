"""Small wrappers over torch.distributed so single-process use needs no process group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def dist_active() -> bool:
    """Return True when a default process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """Return ``(rank, world_size)``; ``(0, 1)`` without a process group."""
    if dist_active():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Return True if ``t`` is a ``torch.distributed.tensor.DTensor``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def broadcast(obj: Any) -> Any:
    """Send rank 0's ``obj`` to every rank (identity without a process group)."""
    if not dist_active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Collect one ``obj`` per rank on every rank (``[obj]`` without a process group)."""
    if not dist_active():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
