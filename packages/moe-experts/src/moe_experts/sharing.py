"""One copy of the frozen experts per machine under torchrun, and the kernel's thread share.

With several local ranks (``LOCAL_WORLD_SIZE`` > 1 and ``torch.distributed`` initialised),
each MoE block's :class:`kt_kernel.ExpertWeights` is built by local rank 0 only, copied into
an anonymous, sealed memory file (:func:`kt_kernel.write_shared`, ``memfd_create``) and its
descriptor handed to the other local ranks over a Unix-domain socket (``SCM_RIGHTS``); they
map it read-only (:func:`kt_kernel.map_shared`). The memory never has a name in a file
system, so there is no moment at which a crash can leave anything behind: the kernel frees it
with the last descriptor and mapping, whichever process dies when. The socket lives in the
abstract namespace (no file either), exists only while the ranks connect, and accepts only
the pids of the machine's own ranks. LoRA is not touched: it stays per rank.

Every rank of the world takes part in the same collectives per block, so the writer's failure
(e.g. no memory for the copy) reaches the other ranks as an error instead of a hang. The
caller holds the sharing in a ``with`` block (:func:`expert_sharing`) around its loop over the
blocks: a rank that fails anywhere in the loop, outside :meth:`ExpertSharing.weights` too, joins
the other ranks' next agreement with its failure on leaving the block, and every path closes
the sockets.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import struct
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

import kt_kernel
from moe_experts.errors import WrapError

__all__ = [
    "SHARE_ENV",
    "ExpertSharing",
    "default_kernel_threads",
    "destroy_sharing_groups",
    "expert_sharing",
    "shared_or_local",
]

# "0" turns sharing off for every wrap/load_pretrained call that does not pass share_experts.
SHARE_ENV = "MOE_EXPERTS_SHARE_EXPERTS"
# Tests only: "N:PATH" makes local rank 0 write its pid to PATH and stop right after creating
# block N's storage, before any other rank has it (the moment a named segment would leak).
PAUSE_ENV = "MOE_EXPERTS_TEST_PAUSE_AFTER_CREATE"
# Seconds a rank waits for its machine's other ranks to connect or for a block's descriptor;
# the collectives before each hand-over already wait for local rank 0 to build the block.
SOCKET_TIMEOUT = 300.0
_POLL = 0.5  # seconds between local rank 0's checks that the ranks it waits for still run
_FIX = (
    "or keep one copy per rank: share_experts=False, MOE_EXPERTS_SHARE_EXPERTS=0, or the "
    "finetune CLI's --no-share-experts"
)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_BLOCK = struct.Struct("<q")


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


def _supported() -> bool:
    """Whether this platform has what sharing needs (Linux: memfd, abstract sockets, creds)."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and hasattr(socket, "SO_PEERCRED")
        and hasattr(socket, "send_fds")
    )


def _address(token: str) -> bytes:
    """The writer's socket address in the abstract namespace (a leading NUL: no file)."""
    return b"\0moe-experts-" + token.encode()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no procfs: every rank counts as one namespace
        return 0


def _listen(token: str, backlog: int) -> tuple[socket.socket | None, str]:
    """The writer's listening socket, or ``None`` and the reason it could not be opened."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(_address(token))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        return None, f"{type(exc).__name__}: {exc}"
    sock.settimeout(SOCKET_TIMEOUT)
    return sock, ""


# The default process group and the gloo group made for the sharing collectives beside it
# (NCCL cannot reduce CPU tensors), both by weak reference: torch holds them until the world is
# destroyed. A strong reference here would keep the gloo group's worker threads alive past
# destroy_process_group, into interpreter exit, where a worker still releasing a finished
# collective's tensors needs the GIL and is killed by Python's finalisation: SIGABRT
# ("terminate called without an active exception"). A world destroyed and initialised again is
# a new object (the old one's weak reference is dead) and gets a new group.
_GLOO_GROUP: list[tuple[weakref.ref[Any], weakref.ref[Any]]] = []


def _collective_group() -> Any:
    """The group of the sharing collectives: ``None`` (the default) where it runs gloo.

    Under another backend (NCCL) one gloo group per default process group, made on first use
    and reused by every later call: ``new_group`` is a collective of the whole world and torch
    frees no group before the world is destroyed, so a group per call would pile up.
    """
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()):
        return None
    world = dist.group.WORLD
    if _GLOO_GROUP and _GLOO_GROUP[0][0]() is world:
        group = _GLOO_GROUP[0][1]()
        if group is not None:
            return group
    group = dist.new_group(backend="gloo")
    _GLOO_GROUP[:] = [(weakref.ref(world), weakref.ref(group))]
    return group


def destroy_sharing_groups() -> None:
    """Destroy the gloo group of the sharing collectives, if one was made (before the world).

    Call it before ``torch.distributed.destroy_process_group()`` on the way out of a torchrun
    job whose default group is not gloo, so that the groups go in the reverse order of their
    making. Idempotent; a no-op without a process group.
    """
    import torch.distributed as dist

    entries, _GLOO_GROUP[:] = list(_GLOO_GROUP), []
    if not (dist.is_available() and dist.is_initialized()):
        return
    for _, ref in entries:
        group = ref()
        if group is not None:
            with suppress(ValueError):  # already destroyed with its world
                dist.destroy_process_group(group)


def _pause_for_tests(block: int, label: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    at, _, path = spec.partition(":")
    if not path or not at.isdigit() or int(at) != block:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "label": label, "block": block}, f)
    os.replace(tmp, path)
    while True:  # until the test SIGKILLs this process
        signal.pause()


@dataclass
class ExpertSharing:
    """This rank's part in sharing expert storage with the other ranks of its machine.

    Attributes:
        writer: whether this rank builds and writes the storage (local rank 0).
        token: the writer's random token (names its socket and memory files).
        group: the process group of the per-block collectives (gloo).
        local_ranks: how many ranks of this machine map the storage.
        conns: the writer's connections to the other local ranks, or the reader's one
            connection to the writer.
        writer_rank: the global rank of this machine's local rank 0.
    """

    writer: bool
    token: str
    group: Any
    local_ranks: int
    conns: list[socket.socket] = field(default_factory=list)
    writer_rank: int = 0
    _count: int = 0
    # True once every rank knows that this call failed, or the collectives themselves broke:
    # no further agreement may be attempted (the other ranks will not join it).
    _settled: bool = False

    @classmethod
    def detect(cls, share: bool | None) -> ExpertSharing | None:
        """Sharing for this call: ``None`` when off, single-process or one local rank.

        Args:
            share: ``True``/``None`` share when possible (``None`` also reads
                ``MOE_EXPERTS_SHARE_EXPERTS``), ``False`` never.

        Raises:
            WrapError: ``share=True`` under torchrun but the launcher's ranks cannot be
                matched to their machine's local rank 0, the platform is not Linux, or the
                local ranks cannot connect (a reader also refuses a socket that another
                process than its local rank 0 owns).
        """
        if share is False or (share is None and os.environ.get(SHARE_ENV, "1") == "0"):
            return None
        import torch.distributed as dist

        local_world = _local_world()
        if not (dist.is_available() and dist.is_initialized()) or local_world <= 1:
            return None
        if not _supported():
            if share:
                raise WrapError(
                    "share_experts=True needs Linux (memfd_create, abstract Unix-domain sockets "
                    "and SO_PEERCRED), which this platform lacks; pass share_experts=False (the "
                    "finetune CLI's --no-share-experts) to keep one copy per rank"
                )
            return None  # every rank of this platform decides alike: one copy per rank
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        token = secrets.token_hex(8)
        # The writer listens before anyone can learn its address, so a connect never races.
        listener, why = _listen(token, local_world) if local_rank == 0 else (None, "")
        # The last field: why this local rank 0 has no socket ("" when it has one).
        me = (socket.gethostname(), _pid_namespace(), os.getpid(), token, local_rank, why)
        peers: list[Any] = [None] * dist.get_world_size()
        try:
            group = _collective_group()
            dist.all_gather_object(peers, me, group=group)
        except RuntimeError as exc:  # gloo: a peer died or closed its connection
            if listener is not None:
                listener.close()
            raise _lost_contact("setting up expert sharing", exc) from exc
        # Every rank decides from the same table, so all ranks share or none does.
        writers = []
        for r, (host, ns, _, _, lr, _) in enumerate(peers):
            w = r - lr
            if not 0 <= w < len(peers) or peers[w][0] != host or peers[w][1] != ns or peers[w][4]:
                if listener is not None:
                    listener.close()
                if share:
                    raise WrapError(
                        f"share_experts=True, but rank {r} (LOCAL_RANK={lr}) has no local rank 0 "
                        f"on its machine at rank {w}; launch with torchrun (ranks contiguous per "
                        "node) or pass share_experts=False"
                    )
                return None
            writers.append(w)
        rank = dist.get_rank()
        writer_rank = writers[rank]
        sharing = cls(
            writer=writer_rank == rank,
            token=peers[writer_rank][3],
            group=group,
            local_ranks=writers.count(writer_rank),
            writer_rank=writer_rank,
        )
        error: BaseException | None = None
        try:
            failed = sorted((w, peers[w][5]) for w in set(writers) if peers[w][5])
            if failed:
                w, why = failed[0]
                raise WrapError(
                    f"local rank 0 (rank {w}) could not open its Unix-domain socket (abstract "
                    f"namespace) to hand the shared experts over ({why}); {_FIX}"
                )
            if sharing.writer:
                readers = {peers[r][2] for r, w in enumerate(writers) if w == rank and r != rank}
                sharing.conns = _accept(listener, readers)
            else:
                sharing.conns = [_connect(sharing.token, peers[writer_rank][2])]
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
        finally:
            if listener is not None:
                listener.close()  # every reader is connected (or failed): nothing to find
        try:
            if sharing._agree(error is not None) is not None:
                sharing.close()
                if isinstance(error, WrapError):
                    raise error
                raise WrapError(
                    "the local ranks could not connect to hand the shared experts over"
                    + (f" ({error})" if error else " (another rank failed; its output says why)")
                    + f"; {_FIX}"
                ) from error
        finally:
            # A caught error kept in a local refers to this frame through its traceback: the
            # cycle would keep what the frames hold (the model, its mapped storage) until a gc.
            error = None
        return sharing

    def close(self) -> None:
        """Close the connections (the storage already handed over stays mapped)."""
        for conn in self.conns:
            conn.close()
        self.conns = []

    def __enter__(self) -> ExpertSharing:
        """Hold the sharing for a loop over the blocks (every rank must enter it)."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the sockets; first, every rank learns whether any failed during the loop.

        A rank leaving on an exception the others have not agreed on yet (raised outside
        :meth:`weights`, or between its two agreements) joins their next agreement with its
        failure, so they raise too instead of waiting for it forever; a rank that finished its
        loop learns there whether another failed after the last block.

        Raises:
            WrapError: this rank finished, but another one failed.
        """
        try:
            if self._settled:
                return
            if exc is None:
                failed = self._agree(False)
                if failed is not None:
                    raise WrapError(
                        f"rank {failed} failed while wrapping or loading the shared "
                        "experts; its own output says why"
                    )
                return
            # This rank's own error is the one to report, not a broken collective's.
            with suppress(Exception):
                self._agree(True)
        finally:
            self.close()

    def _agree(self, failed: bool) -> int | None:
        """All ranks learn whether any failed (a barrier as well): the highest such rank.

        Raises:
            WrapError: the collective itself failed (another rank died or its connection
                broke); no further agreement is attempted.
        """
        import torch.distributed as dist

        self._settled = True  # until this agreement is known to have completed without failure
        flag = torch.tensor([dist.get_rank() + 1 if failed else 0], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:  # gloo: a peer died or closed its connection
            raise _lost_contact("sharing the experts", exc) from exc
        worst = int(flag.item())
        self._settled = worst > 0
        return worst - 1 if worst else None

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
            WrapError: this rank or local rank 0 failed to write, hand over or map the block
                (the writer re-raises its own error; a lack of memory says how to make room).
        """
        self._count += 1
        block = self._count
        made: kt_kernel.SharedExperts | None = None
        shared: kt_kernel.ExpertWeights | None = None
        error: BaseException | None = None
        if self.writer:
            try:
                made = kt_kernel.write_shared(build(), label=f"moe-{self.token}-b{block}")
                shared = made.weights
                _pause_for_tests(block, f"moe-{self.token}-b{block}")
            except kt_kernel.SharedMemoryError as exc:
                error = WrapError(f"{label}: {exc}; {_FIX}")
                error.__cause__ = exc
            except Exception as exc:
                error = exc
        try:
            failed = self._agree(error is not None)
            if failed is not None:
                self.close()  # every rank raises: the sockets are of no further use
                if error is not None:
                    raise error
                if failed == self.writer_rank:
                    raise WrapError(
                        f"{label}: local rank 0 failed to build the shared expert storage; its "
                        "own output says why"
                    )
                raise WrapError(
                    f"{label}: rank {failed} failed while wrapping or loading the "
                    "shared experts; its own output says why"
                )
            try:
                if made is not None:
                    for conn in self.conns:
                        socket.send_fds(conn, [_BLOCK.pack(block)], [made.fd])
                else:
                    shared = self._receive(block, spec, fmt)
            except Exception as exc:  # every rank must reach the agreement below
                error = exc
            failed = self._agree(error is not None)
            if failed is not None:
                self.close()
                if error is not None:
                    raise WrapError(f"{label}: {error}") from error
                raise WrapError(
                    f"{label}: rank {failed} failed to hand over or map the shared "
                    "experts; its own output says why"
                )
        finally:
            if made is not None:
                os.close(made.fd)  # the readers hold their own descriptors and mappings
            error = None  # no reference cycle through the traceback (see detect)
        if shared is None:  # unreachable: every path that leaves it unset raised
            raise WrapError(f"{label}: the shared expert storage was not set up")
        return shared

    def _receive(
        self, block: int, spec: kt_kernel.ExpertSpec, fmt: kt_kernel.WeightFormat
    ) -> kt_kernel.ExpertWeights:
        msg, fds, _, _ = socket.recv_fds(self.conns[0], _BLOCK.size, 1)
        try:
            if not msg:
                raise WrapError(
                    "local rank 0 closed its connection before handing block "
                    f"{block}'s shared experts over"
                )
            if len(fds) != 1 or len(msg) != _BLOCK.size or _BLOCK.unpack(msg)[0] != block:
                raise WrapError(
                    f"local rank 0 sent {msg!r} with {len(fds)} descriptors for "
                    f"block {block}; every rank must load the same model"
                )
            return kt_kernel.map_shared(fds[0], spec, fmt)
        finally:
            for fd in fds:
                os.close(fd)


def _lost_contact(doing: str, exc: BaseException) -> WrapError:
    """The error of a sharing collective that failed because another rank went away."""
    return WrapError(
        f"lost contact with the other ranks while {doing} ({' '.join(str(exc).split())[:300]}); "
        "another rank probably died, and its output or exit status says why"
    )


def _accept(listener: socket.socket | None, readers: set[int]) -> list[socket.socket]:
    """The writer's connections, one per reader pid; connections from other pids are refused."""
    if listener is None:
        raise WrapError("local rank 0 has no socket to hand the shared experts over")
    conns: list[socket.socket] = []
    waiting = set(readers)
    deadline = time.monotonic() + SOCKET_TIMEOUT
    listener.settimeout(_POLL)
    try:
        while waiting:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                # A reader that died before connecting never will: say so now, not at the
                # deadline (its pid is in this namespace, checked by detect).
                gone = sorted(pid for pid in waiting if not _alive(pid))
                if gone:
                    raise WrapError(
                        f"the local rank(s) with pid {gone} exited before "
                        "connecting to local rank 0"
                    ) from None
                if time.monotonic() > deadline:
                    raise
                continue
            pid, uid, _ = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            if pid not in waiting or uid != os.getuid():
                conn.close()  # not one of this machine's ranks: it gets nothing
                continue
            waiting.discard(pid)
            conn.settimeout(SOCKET_TIMEOUT)
            conns.append(conn)
    except BaseException:
        for conn in conns:
            conn.close()
        raise
    return conns


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it is dead, only not yet reaped)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 (tiny read)
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def _connect(token: str, writer_pid: int) -> socket.socket:
    """A reader's connection to its machine's local rank 0 (pid ``writer_pid``), checked."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.settimeout(SOCKET_TIMEOUT)
    try:
        conn.connect(_address(token))
        pid, uid, _ = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        conn.close()
        raise
    # Abstract names have no permissions and are listed in /proc/net/unix: once local rank 0
    # stops listening anyone may bind its name, and must not feed this rank expert weights.
    if pid != writer_pid or uid != os.getuid():
        conn.close()
        raise WrapError(
            f"the socket {_address(token)[1:].decode()!r} belongs to pid {pid} (uid {uid}), "
            f"not local rank 0 (pid {writer_pid}); another process took its name"
        )
    return conn


@contextmanager
def expert_sharing(share: bool | None) -> Iterator[ExpertSharing | None]:
    """:meth:`ExpertSharing.detect`, held for a loop over the blocks (``None``: no sharing).

    Every rank must enter it at the same point. On the way out the sockets are closed on every
    path, and a failure on any rank during the loop is an error on every rank.

    Args:
        share: as in :meth:`ExpertSharing.detect`.

    Raises:
        WrapError: as :meth:`ExpertSharing.detect`; or, on leaving, another rank failed.
    """
    sharing = ExpertSharing.detect(share)
    if sharing is None:
        yield None
        return
    with sharing:
        yield sharing


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
