"""One copy of the frozen experts per machine under torchrun, and the kernel's thread share.

With several local ranks (``LOCAL_WORLD_SIZE`` > 1 and ``torch.distributed`` initialised),
each MoE block's :class:`kt_kernel.ExpertWeights` is built by local rank 0 only, written to a
shared-memory segment (:func:`kt_kernel.write_shared`) and mapped read-only by the other local
ranks; as soon as every rank has mapped it, local rank 0 removes its name, so a crash at any
later point leaves nothing behind (the mappings hold the memory until the last rank exits).
A segment left by a local rank 0 that died while loading is removed by the next job's
:func:`kt_kernel.remove_stale_segments`. LoRA is not touched: it stays per rank.

Every rank of the world takes part in the same two collectives per block, so the writer's
failure (e.g. no room in ``/dev/shm``) reaches the other ranks as an error instead of a hang.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import kt_kernel
from moe_experts.errors import WrapError

__all__ = ["SHARE_ENV", "ExpertSharing", "default_kernel_threads", "shared_or_local"]

# "0" turns sharing off for every wrap/load_pretrained call that does not pass share_experts.
SHARE_ENV = "MOE_EXPERTS_SHARE_EXPERTS"


def _local_world() -> int:
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def default_kernel_threads() -> int | None:
    """Give the kernel ``cores / LOCAL_WORLD_SIZE`` threads under torchrun, unless pinned.

    ``KT_KERNEL_THREADS`` and an ``OMP_NUM_THREADS`` other than 1 are the user's choice and
    are left alone. torchrun itself exports ``OMP_NUM_THREADS=1`` to its workers when it is
    unset, so 1 is taken as torchrun's default, not a choice (pin the kernel with
    ``KT_KERNEL_THREADS=1`` to really get one thread).

    Returns:
        The thread count set, or ``None`` when nothing was changed.
    """
    local = _local_world()
    if local <= 1 or os.environ.get("KT_KERNEL_THREADS"):  # read by kt-kernel's extension
        return None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp and omp != "1":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // local)
    kt_kernel.set_num_threads(threads)
    return threads


@dataclass
class ExpertSharing:
    """This rank's part in sharing expert storage with the other ranks of its machine.

    Attributes:
        writer: whether this rank builds and writes the segments (local rank 0).
        name: the segment name template (writer pid, pid namespace, job token).
        group: the process group of the per-block collectives (gloo).
    """

    writer: bool
    name: kt_kernel.SegmentName
    group: Any
    _count: int = 0

    @classmethod
    def detect(cls, share: bool | None) -> ExpertSharing | None:
        """Sharing for this call: ``None`` when off, single-process or one local rank.

        Args:
            share: ``True``/``None`` share when possible (``None`` also reads
                ``MOE_EXPERTS_SHARE_EXPERTS``), ``False`` never.

        Raises:
            WrapError: ``share=True`` under torchrun but the launcher's ranks cannot be
                matched to their machine's local rank 0.
        """
        if share is False or (share is None and os.environ.get(SHARE_ENV, "1") == "0"):
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or _local_world() <= 1:
            return None
        group = None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        template = kt_kernel.SegmentName("x", token=secrets.token_hex(6))
        me = (socket.gethostname(), template.pid_namespace, template.owner_pid, template.token,
              local_rank)
        peers: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peers, me, group=group)
        # Every rank decides from the same table, so all ranks share or none does.
        writers = []
        for r, (host, ns, _, _, lr) in enumerate(peers):
            w = r - lr
            if not 0 <= w < len(peers) or peers[w][0] != host or peers[w][1] != ns or peers[w][4]:
                if share:
                    raise WrapError(
                        f"share_experts=True, but rank {r} (LOCAL_RANK={lr}) has no local rank 0 "
                        f"on its machine at rank {w}; launch with torchrun (ranks contiguous per "
                        "node) or pass share_experts=False"
                    )
                return None
            writers.append(w)
        writer_rank = writers[dist.get_rank()]
        _, ns, pid, token, _ = peers[writer_rank]
        if local_rank == 0:
            kt_kernel.remove_stale_segments()
        name = kt_kernel.SegmentName("x", token=token, owner_pid=pid, pid_namespace=ns)
        return cls(writer=local_rank == 0, name=name, group=group)

    def _agree(self, failed: bool) -> bool:
        """All ranks learn whether any failed (a barrier as well)."""
        import torch.distributed as dist

        flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def weights(
        self,
        build: Callable[[], kt_kernel.ExpertWeights],
        spec: kt_kernel.ExpertSpec,
        fmt: kt_kernel.WeightFormat,
        label: str,
    ) -> kt_kernel.ExpertWeights:
        """One block's weights: built and written by the writer, mapped by the others.

        Args:
            build: builds the block's weights (called on the writer only).
            spec: the block's spec as every rank knows it (from the model's shapes).
            fmt: the weight format every rank expects.
            label: the experts module's name, for errors.

        Raises:
            WrapError: this rank or local rank 0 failed to write or map the block (the writer
                re-raises its own error).
        """
        from dataclasses import replace

        self._count += 1
        name = replace(self.name, key=f"b{self._count}")
        shared: kt_kernel.ExpertWeights | None = None
        error: BaseException | None = None
        if self.writer:
            try:
                shared = kt_kernel.write_shared(build(), name)
            except Exception as exc:
                error = exc
        try:
            if self._agree(error is not None):
                if error is not None:
                    raise error
                raise WrapError(
                    f"{label}: local rank 0 (pid {name.owner_pid}) failed to build the shared "
                    "expert storage; its own output says why"
                )
            if not self.writer:
                try:
                    shared = kt_kernel.map_shared(name, spec, fmt)
                except kt_kernel.SharedMemoryError as exc:
                    error = exc
            if self._agree(error is not None):
                if error is not None:
                    raise WrapError(f"{label}: {error}") from error
                raise WrapError(f"{label}: another local rank failed to map the shared experts")
        finally:
            if self.writer:
                kt_kernel.unlink_shared(name)  # every rank has mapped it, or none will
        if shared is None:  # unreachable: every path that leaves it unset raised
            raise WrapError(f"{label}: the shared expert storage was not set up")
        return shared


def shared_or_local(
    sharing: ExpertSharing | None,
    build: Callable[[], kt_kernel.ExpertWeights],
    spec: kt_kernel.ExpertSpec,
    fmt: kt_kernel.WeightFormat,
    label: str,
) -> kt_kernel.ExpertWeights:
    """``build()`` without sharing, else the machine's one shared copy (:class:`ExpertSharing`)."""
    if sharing is None:
        return build()
    return sharing.weights(build, spec, fmt, label)
