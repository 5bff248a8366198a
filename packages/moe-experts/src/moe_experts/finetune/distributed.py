"""torchrun support: the process group, FSDP2 on the dense layers, and naming a lost peer."""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from moe_experts.finetune.errors import FinetuneError, PeerLostError

__all__ = [
    "Ranks",
    "clip_grad_norm",
    "diagnose_peer_loss",
    "exit_without_finalizing",
    "init_distributed",
    "shard_dense",
    "teardown_distributed",
]

# Words gloo and c10d use when the other side of a connection went away.
_CONNECTION_WORDS = (
    "connection closed",
    "connection reset",
    "closed by peer",
    "broken pipe",
    "connection refused",
    "end of file",
    "eof",
)


@dataclass(frozen=True)
class Ranks:
    """This process's rank, the world size, and every rank's (host, pid) for diagnosis."""

    rank: int
    world: int
    peers: tuple[tuple[str, int], ...] = ()


def init_distributed(backend: str = "gloo", device: torch.device | None = None) -> Ranks:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1).

    Args:
        backend: ``"gloo"`` (CPU), or ``"cpu:gloo,cuda:nccl"`` with ``device`` a CUDA device:
            CUDA tensors then go over NCCL, host tensors over gloo.
        device: this rank's CUDA device (set current, and NCCL started on it at once).

    Raises:
        FinetuneError: NCCL did not start; names the rank, its device and the cause.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    nccl = device is not None and device.type == "cuda"
    # Under torchrun on GPUs even one rank starts NCCL (and FSDP on its CUDA mesh), so a
    # one-GPU machine runs the multi-GPU code path.
    launched = nccl and "TORCHELASTIC_RUN_ID" in os.environ
    if (world > 1 or launched) and not dist.is_initialized():
        # Its functions take ``group=group.WORLD`` as a default argument, evaluated on import:
        # imported after init_process_group (transformers and FSDP import it), it would hold
        # the default group for good, and teardown_distributed could not destroy it.
        import torch.distributed.nn.functional

        try:
            if nccl:
                torch.cuda.set_device(device)
                # device_id starts NCCL now, so a broken setup fails here and not mid-step.
                dist.init_process_group(backend, timeout=timedelta(seconds=120), device_id=device)
                probe = torch.ones(1, device=device)
                dist.all_reduce(probe)  # NCCL's first collective: every rank's GPU answers
            else:
                dist.init_process_group(backend, timeout=timedelta(seconds=120))
        except Exception as exc:
            if not nccl:
                raise
            rank = os.environ.get("RANK", "?")
            raise FinetuneError(
                f"rank {rank}: NCCL could not start on {device} ({_first_line(exc)}); check "
                "that every rank sees its own GPU (CUDA_VISIBLE_DEVICES, --nproc-per-node at "
                "most the GPU count) and NCCL_DEBUG=INFO's output, or run with --device cpu"
            ) from exc
    if not dist.is_initialized():
        return Ranks(0, 1)
    me = (socket.gethostname(), os.getpid())
    peers: list[tuple[str, int]] = [me] * dist.get_world_size()
    try:
        dist.all_gather_object(peers, me)
    except RuntimeError as exc:  # the pids are not known yet: no rank can be named
        raise PeerLostError(
            f"a peer rank closed its connection while the {dist.get_world_size()} ranks "
            f"started, so rank {dist.get_rank()} cannot continue; look at the other ranks' "
            f"output for why [{_first_line(exc)}]"
        ) from exc
    return Ranks(dist.get_rank(), dist.get_world_size(), tuple(peers))


def shard_dense(model: nn.Module, kept_out: set[nn.Parameter], device_type: str = "cpu") -> None:
    """FSDP2 over each decoder layer and the root; ``kept_out`` (experts) stays out of FSDP.

    ``device_type`` is the mesh's: ``"cuda"`` puts FSDP's collectives on NCCL.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", model), "layers", [])
    for layer in layers:
        mine = {p for p in layer.parameters() if p in kept_out}
        fully_shard(layer, mesh=mesh, ignored_params=mine)
    fully_shard(model, mesh=mesh, ignored_params=kept_out)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global norm over sharded (DTensor) and replicated gradients alike.

    Returns:
        The norm before clipping (``inf``/``nan`` when a gradient is not finite; then the
        gradients are left as they are and the caller stops).
    """
    from torch.distributed.tensor import DTensor

    # Summed per device of the sharded parameters (dense LoRA on a GPU goes over NCCL), the
    # same devices in the same order on every rank, so every rank joins the same collectives.
    devices = sorted({p.device for p in params if isinstance(p, DTensor)}, key=str)
    sharded = {d: torch.zeros((), dtype=torch.float64, device=d) for d in devices}
    replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            local = p.grad.to_local()
            sharded[local.device] += local.double().pow(2).sum()
        else:
            replicated += p.grad.double().pow(2).sum().cpu()
    total = torch.zeros((), dtype=torch.float64)
    for part in sharded.values():
        if dist.is_initialized():
            dist.all_reduce(part)
        total += part.cpu()
    norm = float((total + replicated).sqrt())
    if norm == norm and norm != float("inf") and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _pid_gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        # The state letter follows the parenthesised command name; Z/X: exited, not reaped.
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _first_line(exc: BaseException) -> str:
    # The innermost error is the real one (a wrapper's "waited 0:02:00" comes after it).
    return " ".join(str(_chain(exc)[-1]).split())[:300]


def diagnose_peer_loss(
    exc: BaseException,
    ranks: Ranks,
    step: int,
    wait_s: float = 3.0,
    *,
    during: str | None = None,
    lost_only: bool = False,
) -> PeerLostError | None:
    """If a peer rank is gone, say which and why, in place of a collective's error.

    A local peer's process is looked up by pid (every rank's pid was exchanged at start);
    the lookup is polled for up to ``wait_s`` because the peer may still be exiting.
    ``during`` says when it happened (default: "during step ``step``"). With ``lost_only``
    an error that does not read as a lost connection stands even if a peer is gone (every
    rank may fail alike, e.g. on a bad setting, and exit in any order).

    Returns:
        The error to raise, or None when no peer is known to be gone and the error does not
        look like a lost connection (then the original error stands).
    """
    if ranks.world <= 1:
        return None
    host = socket.gethostname()
    text = " ".join(str(e) for e in _chain(exc)).lower()
    lost_connection = any(word in text for word in _CONNECTION_WORDS)
    if lost_only and not lost_connection:
        return None
    deadline = time.monotonic() + wait_s
    gone: list[int] = []
    while True:
        gone = [
            r
            for r, (h, pid) in enumerate(ranks.peers)
            if r != ranks.rank and h == host and _pid_gone(pid)
        ]
        if gone or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    cause = _first_line(exc)
    when = during or f"during step {step}"
    if gone:
        who = ", ".join(f"rank {r} (pid {ranks.peers[r][1]})" for r in gone)
        return PeerLostError(
            f"{who} of {ranks.world} exited {when}, so its connection closed and "
            f"rank {ranks.rank} cannot continue; look at {who.split(' (')[0]}'s own output for "
            f"why it stopped [{cause}]"
        )
    if lost_connection:
        return PeerLostError(
            f"a peer rank closed its connection {when} (it exited or its host "
            f"went away), so rank {ranks.rank} cannot continue; look at the other ranks' "
            f"output for why [{cause}]"
        )
    return None


def teardown_distributed() -> bool:
    """Destroy every process group in order, so that no gloo thread outlives the interpreter.

    Each gloo group has worker threads that release a finished collective's tensors after the
    caller has seen the result; freeing a tensor whose Python object C++ now owns takes the
    GIL. If that happens once the interpreter is finalising, Python ends the thread with
    ``pthread_exit``, whose unwinding crosses a ``noexcept`` destructor: the process aborts
    ("terminate called without an active exception"). Destroying a group joins its threads,
    but only once nothing else holds it: so first collect the cycles (the FSDP-sharded model
    holds groups), then the sharing gloo group, then the world. Idempotent.

    Returns:
        Whether every group was really freed (``False``: something still holds the world
        group, and its threads live until the process ends); ``True`` without a process group.
    """
    from moe_experts.sharing import destroy_sharing_groups

    if not (dist.is_available() and dist.is_initialized()):
        return True
    gc.collect()
    destroy_sharing_groups()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    return world() is None


def exit_without_finalizing(code: int) -> NoReturn:
    """End the process now, skipping the interpreter's finalisation (after a failed teardown).

    Where :func:`teardown_distributed` could not free a group (torch's DTensor caches hold
    FSDP's device mesh, and with it the groups), its gloo threads live until the process ends,
    and the interpreter's finalisation is the one moment at which they abort it. What
    finalisation does that matters still runs: the atexit handlers (logging, reporters) and
    flushing the output.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
