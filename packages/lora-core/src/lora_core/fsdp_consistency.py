"""Cross-rank consistency checks of the FSDP sync layer: fail loudly, never hang.

Before any reduction, every rank all-gathers a small fingerprint of what it is about to
reduce (count, hash of the ordered ``name|shape|dtype|layout`` descriptors, and how many
rank-local problems it found), waiting at most a timeout. Only when the fingerprints differ
do the ranks exchange their descriptor lists (``all_gather_object``) to name the first rank
and parameter that differ; every rank then raises the same :class:`LoraStateMismatchError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_CHECK_TIMEOUT",
    "FsdpLayoutError",
    "LoraStateMismatchError",
    "check_consistent",
    "collective_device",
    "digest",
    "first_difference",
]

# Bounds the fingerprint exchange, the first collective of every call: a rank that never
# arrives (crashed, or took another code path) turns into an error instead of a hang.
DEFAULT_CHECK_TIMEOUT = timedelta(seconds=120)


class FsdpLayoutError(ValueError):
    """The model or the parameters are not in a layout this layer can handle."""


class LoraStateMismatchError(RuntimeError):
    """Ranks disagree about the LoRA parameters; raised on every rank, naming the culprit.

    Attributes:
        rank: the first (global) rank whose state differs from the majority's, or
            that reported a problem with its own parameters.
        parameter: the first parameter name that differs (``None`` if only counts differ).
    """

    def __init__(self, message: str, *, rank: int, parameter: str | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.parameter = parameter


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small bookkeeping tensors must live for ``group``'s backend (CUDA for NCCL)."""
    backend = str(dist.get_backend(group)).lower()
    # "cpu:gloo,cuda:nccl" takes CPU tensors; a pure NCCL group only takes CUDA tensors.
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def digest(items: Sequence[str]) -> int:
    """A signed 64-bit blake2b digest of ``items`` in order (fits an int64 tensor)."""
    h = hashlib.blake2b(digest_size=8)
    for item in items:
        h.update(item.encode("utf-8"))
        h.update(b"\0")
    return int.from_bytes(h.digest(), "little", signed=True)


def first_difference(
    descriptors: list[list[str]], errors: list[list[tuple[str, str]]]
) -> tuple[int, str | None, str]:
    """The first rank (and parameter) whose state differs from the majority's, and why.

    Args:
        descriptors: per rank, the ordered ``name|shape|dtype|layout`` strings.
        errors: per rank, ``(parameter, message)`` problems that rank found locally; the
            first rank with any is reported before descriptor differences.

    Returns:
        ``(rank, parameter or None, explanation)``.
    """
    for rank, errs in enumerate(errors):
        if errs:
            name, message = errs[0]
            more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
            return rank, name, f"rank {rank}: {message}{more}"
    # The majority is the reference (ties: the lowest rank), so a lone odd rank is named.
    keys = [tuple(d) for d in descriptors]
    ref_rank = max(range(len(keys)), key=lambda r: (keys.count(keys[r]), -r))
    ref = descriptors[ref_rank]
    for rank, mine in enumerate(descriptors):
        if mine == ref:
            continue
        ref_names = {d.split("|", 1)[0] for d in ref}
        mine_names = {d.split("|", 1)[0] for d in mine}
        for i in range(max(len(ref), len(mine))):
            a = ref[i] if i < len(ref) else None
            b = mine[i] if i < len(mine) else None
            if a == b:
                continue
            if b is not None and b.split("|", 1)[0] not in ref_names:
                name = b.split("|", 1)[0]
                why = f"rank {rank} has parameter '{name}' that rank {ref_rank} does not have"
            elif a is not None and a.split("|", 1)[0] not in mine_names:
                name = a.split("|", 1)[0]
                why = f"rank {rank} lacks parameter '{name}' that rank {ref_rank} has"
            else:
                name = (b or a or "|").split("|", 1)[0]
                why = (
                    f"parameter '{name}' differs: rank {ref_rank} has {a!r}, rank {rank} has {b!r}"
                )
            return (
                rank,
                name,
                (f"{why} (rank {ref_rank}: {len(ref)} parameters, rank {rank}: {len(mine)})"),
            )
    return 0, None, "fingerprints differ but the gathered descriptors are identical"


def check_consistent(
    descriptors: list[str],
    local_errors: list[tuple[str, str]],
    group: dist.ProcessGroup | None,
    timeout: timedelta,
    what: str,
) -> None:
    """Exchange a fingerprint of ``descriptors``; raise on every rank if any rank differs.

    One ``all_gather`` of three int64 values when all agree (the common case); a second,
    pickled exchange only on mismatch, to name the rank and parameter.

    Args:
        descriptors: this rank's ordered ``name|shape|dtype|layout`` strings.
        local_errors: ``(parameter, message)`` problems found on this rank; any makes every
            rank raise, so no rank enters a collective the others will not join.
        group: the process group every rank of which calls this (``None``: world).
        timeout: how long to wait for the other ranks' fingerprints.
        what: the calling function's name, for the message.

    Raises:
        LoraStateMismatchError: if the ranks' descriptors disagree, some rank reported a
            local problem, or the fingerprints did not arrive within ``timeout``.
    """
    fp = torch.tensor(
        [len(descriptors), digest(descriptors), len(local_errors)],
        dtype=torch.int64,
        device=collective_device(group),
    )
    gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, fp, group=group, async_op=True)
    try:
        work.wait(timeout=timeout)
    except RuntimeError as exc:
        cause = " ".join(str(exc).split())
        if any(
            w in cause.lower()
            for w in ("connection closed", "connection reset", "by peer", "broken pipe")
        ):
            # A peer died: say so first, rather than a timeout that did not happen.
            raise LoraStateMismatchError(
                f"{what}: rank {dist.get_rank(group)} lost its connection to another rank "
                f"during the LoRA fingerprint exchange ({cause[:300]}); that rank exited or "
                "crashed: look at its output for why",
                rank=dist.get_rank(group),
                parameter=None,
            ) from exc
        raise LoraStateMismatchError(
            f"{what}: rank {dist.get_rank(group)} waited {timeout} for the other ranks' LoRA "
            "fingerprint; some rank did not call this function (crashed, or took a different "
            "code path). Every rank must call it with the same parameters",
            rank=dist.get_rank(group),
            parameter=None,
        ) from exc
    rows = torch.stack(gathered).cpu()
    if bool((rows == rows[0]).all()) and int(rows[0, 2]) == 0:
        return
    # The rare failure path may afford a pickled exchange to say exactly what differs.
    objects: list[Any] = [None] * len(gathered)
    dist.all_gather_object(objects, (descriptors, local_errors), group=group)
    rank, name, why = first_difference([o[0] for o in objects], [o[1] for o in objects])
    if group is not None:
        # Ranks inside ``group`` differ from global ranks; say both where they differ.
        glob = dist.get_global_rank(group, rank)
        why = f"{why} [group rank {rank} is global rank {glob}]" if glob != rank else why
        rank = glob
    raise LoraStateMismatchError(
        f"{what}: LoRA state differs across ranks: {why}. Every rank must hold the same LoRA "
        "parameters (names, shapes, dtypes), prepared for the current world size "
        f"{len(gathered)}",
        rank=rank,
        parameter=name,
    )
