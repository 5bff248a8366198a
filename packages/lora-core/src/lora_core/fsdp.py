"""The FSDP sync layer: LoRA adapters next to FSDP2-sharded base weights.

There are two ways to train LoRA under FSDP2 (``torch.distributed.fsdp.fully_shard``). Pick
one per model; never both, or the LoRA gradients would be averaged twice.

**Replicate path (post-load).** The base model is loaded and ``fully_shard``-ed first, and
LoRA is added afterwards (``enable_lora_training(model, config)``, the eager default). FSDP
does not manage the adapters. :func:`replicate_lora_parameters` turns every ``lora_A`` /
``lora_B`` weight into a *replicated* DTensor on the mesh FSDP already built (broadcast from
the first rank, then checked), and installs input/output hooks so the adapter matmuls run on
replicated DTensors while the FSDP-unsharded base runs on plain tensors. After
``loss.backward()`` and before clipping, :func:`sync_replicated_lora_gradients` averages the
adapter gradients over the replicated mesh dims in a few coalesced all-reduces. Replication
swaps the adapter ``Parameter`` objects, so re-read an earlier ``AdaptationResult`` with
``lora_core.rebind_parameters(result, model)`` before building the optimizer. Use it when
the adapters are small (the usual LoRA case), when LoRA is attached to an already sharded or
already loaded model, or when some ranks may skip an adapter in their forward (the sync
zero-fills a missing gradient, so every rank still joins every collective).

**FSDP-native path.** ``enable_lora_training(model, config, prepare_for_fsdp=True)`` builds
the adapters on the meta device *before* ``fully_shard``, so FSDP puts them into its own
parameter groups and shards them like any other parameter (``Shard(0)``, or
``(Replicate(), Shard(0))`` for HSDP). Materialise with ``model.to_empty(...)``, load the base
checkpoint through ``lora_core.remap_checkpoint_keys(state_dict, result)`` (the
``checkpoint_key_aliases`` map ``x.weight`` to ``x.base_layer.weight``), then call
``result.missing_parameter_initializer(model)`` to fill the adapter shards with the same
values the eager path builds, and ``rebind_parameters(result, model)``. FSDP itself
reduce-scatters the adapter gradients; do not call :func:`replicate_lora_parameters`, and
:func:`sync_replicated_lora_gradients` skips such sharded parameters (it only touches fully
replicated DTensors and plain tensors). Use it for
large adapters or many of them, when the whole model is built on meta and loaded shard by
shard, or when the adapters' optimizer state should be sharded too. If ranks may skip an
adapter in their forward, enable ``FSDPModule.set_reduce_scatter_unused_params(True)``.

The sync assumes nothing else averages the tensors it touches: do not combine it with DDP or
with FSDP's pure-replication mode for the same parameters.

Plain tensors passed to :func:`sync_replicated_lora_gradients` (for example the expert LoRA
buffers of ``moe_experts``, replicated by construction) are averaged over ``group``.

Every collective here is preceded by a small fingerprint exchange (count and hash of the
ordered names, shapes, dtypes and layouts) bounded by ``check_timeout``; ranks that disagree
raise :class:`LoraStateMismatchError` naming the rank and the parameter instead of hanging.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lora_core.contracts import AdaptationResult, ParameterOwnership
from lora_core.fsdp_consistency import (
    DEFAULT_CHECK_TIMEOUT,
    FsdpLayoutError,
    LoraStateMismatchError,
    check_consistent,
)
from lora_core.fsdp_replicate import replicate_lora_parameters

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHECK_TIMEOUT",
    "FsdpLayoutError",
    "LoraStateMismatchError",
    "SyncStats",
    "replicate_lora_parameters",
    "sync_replicated_lora_gradients",
]


# 25 MiB, DDP's default bucket cap: large enough that a typical LoRA model needs one bucket.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class SyncStats:
    """Counters filled by :func:`sync_replicated_lora_gradients` when passed as ``stats``.

    Attributes:
        parameters: parameters whose gradients were averaged.
        zero_filled: of those, how many had no gradient on this rank and contributed zeros.
        skipped: parameters left alone (sharded DTensors owned by FSDP, non-replicated ones).
        buckets: flat buffers reduced.
        collectives: collective calls issued (fingerprint exchange included).
        bytes: bytes of gradient data reduced on this rank.
    """

    parameters: int = 0
    zero_filled: int = 0
    skipped: int = 0
    buckets: int = 0
    collectives: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class _Entry:
    """One tensor to reduce: its name, parameter, and the groups to average it over."""

    name: str
    param: torch.Tensor
    groups: tuple[dist.ProcessGroup, ...]
    descriptor: str


def _is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class _MeshStatus:
    """What one mesh offers this call: its per-dim groups, or why it is unusable."""

    groups: tuple[dist.ProcessGroup, ...]
    layout: str
    problem: str | None


def _mesh_status(mesh: DeviceMesh, placements: tuple[Any, ...]) -> _MeshStatus:
    """Resolve the groups of ``mesh`` once per call and say why it is unusable, if it is."""
    world = dist.get_world_size()
    layout = (
        f"DTensor(mesh={tuple(mesh.shape)}, dims={mesh.mesh_dim_names}, "
        f"placements={tuple(str(p) for p in placements)})"
    )
    groups = []
    for dim in range(mesh.ndim):
        try:
            g = mesh.get_group(dim)
            size = dist.get_world_size(g)
        except Exception as exc:  # a destroyed or foreign group raises several types
            return _MeshStatus(
                (),
                layout,
                (
                    f"lives on a device mesh {tuple(mesh.shape)} whose dim {dim} process group is "
                    f"unusable in this process group of {world} ranks ({exc}); re-run fully_shard "
                    "and replicate_lora_parameters after init_process_group"
                ),
            )
        if size != mesh.size(dim):
            return _MeshStatus(
                (),
                layout,
                (
                    f"was prepared for a device mesh {tuple(mesh.shape)} (world size "
                    f"{mesh.size()}) but its dim {dim} group now has {size} ranks (current world "
                    f"size {world}); rebuild the model in this process group"
                ),
            )
        groups.append(g)
    if mesh.get_coordinate() is None:
        return _MeshStatus((), layout, "lives on a device mesh that does not include this rank")
    return _MeshStatus(tuple(groups), layout, None)


def _named_inputs(
    model_or_params: nn.Module | AdaptationResult | NamedTensors,
) -> list[tuple[str, torch.Tensor]]:
    pairs: list[tuple[str, torch.Tensor]]
    if isinstance(model_or_params, nn.Module):
        pairs = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
    elif isinstance(model_or_params, AdaptationResult):
        pairs = [
            (n, p)
            for n, p in model_or_params.named_optimizer_parameters
            if model_or_params.ownership[n] is ParameterOwnership.REPLICATED
        ]
    elif isinstance(model_or_params, Iterable) and not isinstance(model_or_params, str | bytes):
        pairs = []
        for item in model_or_params:
            if (
                not isinstance(item, tuple)
                or len(item) != 2
                or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)
            ):
                raise FsdpLayoutError(
                    "sync_replicated_lora_gradients expects (name, tensor) pairs, got an item "
                    f"of type {type(item).__name__}; pass model.named_parameters() or an "
                    "AdaptationResult"
                )
            pairs.append(item)
    else:
        raise FsdpLayoutError(
            "sync_replicated_lora_gradients model_or_params must be an nn.Module, an "
            f"AdaptationResult or an iterable of (name, tensor), got "
            f"{type(model_or_params).__name__}"
        )
    names = [n for n, _ in pairs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise FsdpLayoutError(f"sync_replicated_lora_gradients got duplicate names {dupes[:8]}")
    # Sorted by name: the order never depends on how each rank built or wrapped its model.
    return sorted(pairs, key=lambda item: item[0])


def _collect(
    pairs: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> tuple[list[_Entry], list[tuple[str, str]], int]:
    """Entries to reduce, rank-local problems (exchanged before any reduction), skip count."""
    entries: list[_Entry] = []
    errors: list[tuple[str, str]] = []
    skipped = 0
    meshes: dict[tuple[int, tuple[Any, ...]], _MeshStatus] = {}
    plain_group = group if group is not None else dist.group.WORLD
    if plain_group is None:  # unreachable: the caller returns before this without a group
        raise FsdpLayoutError("sync_replicated_lora_gradients needs an initialised process group")
    plain_groups = (plain_group,)
    for name, p in pairs:
        if p.is_meta:
            errors.append(
                (
                    name,
                    (
                        f"parameter '{name}' is on the meta device; materialise and initialise it "
                        "(result.missing_parameter_initializer) before training"
                    ),
                )
            )
            continue
        dtype = str(p.dtype).removeprefix("torch.")
        if isinstance(p, DTensor):
            placements = tuple(p.placements)
            if not all(pl.is_replicate() for pl in placements):
                # Sharded (FSDP/HSDP-managed) or partial: its owner reduces it, never us.
                skipped += 1
                continue
            key = (id(p.device_mesh), placements)
            if key not in meshes:
                meshes[key] = _mesh_status(p.device_mesh, placements)
            status = meshes[key]
            if status.problem is not None:
                errors.append((name, f"parameter '{name}' {status.problem}"))
                continue
            grad = p.grad
            if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
                errors.append(
                    (
                        name,
                        (
                            f"parameter '{name}' has a gradient with placements {grad.placements}, "
                            f"expected {p.placements} like the parameter"
                        ),
                    )
                )
                continue
            groups, layout = status.groups, status.layout
        else:
            groups, layout = plain_groups, "Tensor"
        entries.append(_Entry(name, p, groups, f"{name}|{list(p.shape)}|{dtype}|{layout}"))
    return entries, errors, skipped


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _reduce_bucket(
    bucket: list[_Entry],
    groups: tuple[dist.ProcessGroup, ...],
    dtype: torch.dtype,
    stats: SyncStats,
) -> None:
    """Average the gradients of ``bucket`` over ``groups`` through one flat buffer."""
    flats: list[torch.Tensor] = []
    for e in bucket:
        local_param = _local(e.param)
        if e.param.grad is None:
            stats.zero_filled += 1
            flats.append(torch.zeros(local_param.numel(), dtype=dtype, device=local_param.device))
        else:
            flats.append(_local(e.param.grad).reshape(-1).to(dtype))
    flat = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
    divisor = 1
    for g in groups:
        # SUM then one division: gloo has no AVG, and one rounding step keeps ranks identical.
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g)
        divisor *= dist.get_world_size(g)
        stats.collectives += 1
    flat.div_(divisor)
    stats.buckets += 1
    stats.bytes += flat.numel() * flat.element_size()
    offset = 0
    for e in bucket:
        local_param = _local(e.param)
        n = local_param.numel()
        value = flat[offset : offset + n].view(local_param.shape)
        offset += n
        grad = e.param.grad
        if grad is not None:
            # In place keeps the gradient tensor (and any view of it held elsewhere) alive.
            _local(grad).copy_(value)
        elif isinstance(e.param, DTensor):
            e.param.grad = DTensor.from_local(
                value.to(e.param.dtype).clone(),
                e.param.device_mesh,
                e.param.placements,
                run_check=False,
                shape=e.param.shape,
                stride=e.param.stride(),
            )
        else:
            e.param.grad = value.to(e.param.dtype).clone()
        stats.parameters += 1


@torch.no_grad()
def sync_replicated_lora_gradients(
    model_or_params: nn.Module | AdaptationResult | NamedTensors,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    check_timeout: timedelta = DEFAULT_CHECK_TIMEOUT,
    stats: SyncStats | None = None,
) -> int:
    """Average replicated LoRA gradients across ranks; call after backward, before clipping.

    Parameters are walked sorted by name. Fully replicated DTensors are averaged over every
    dim of their mesh (the mesh FSDP built); plain tensors over ``group``. DTensors with a
    ``Shard``/``Partial`` placement belong to FSDP (the FSDP-native path) and are skipped.
    A rank without a gradient for a parameter contributes zeros and receives the average, so
    every rank joins every collective and ends with identical gradients. Gradients are
    packed into flat buckets per (process groups, dtype) of at most ``bucket_bytes``.

    Args:
        model_or_params: a module (its ``requires_grad`` parameters), an
            :class:`AdaptationResult` (its ``REPLICATED`` optimizer parameters) or an
            iterable of ``(name, tensor)``.
        group: process group for plain tensors (default: the world group); it also carries
            the fingerprint exchange, so every rank of it must call this function.
        bucket_bytes: maximum bytes per flat bucket (positive); a larger tensor gets its own.
        check_timeout: how long to wait for the other ranks' fingerprint.
        stats: if given, filled with counters (collectives issued, buckets, ...).

    Returns:
        The number of parameters whose gradients were averaged (0 without a process group).

    Raises:
        FsdpLayoutError: for malformed inputs or a non-positive ``bucket_bytes``.
        LoraStateMismatchError: if ranks hold different LoRA parameters or a parameter was
            prepared for another world size (raised on every rank, naming rank and parameter).
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise FsdpLayoutError(
            f"sync_replicated_lora_gradients bucket_bytes must be a positive int, got "
            f"{bucket_bytes!r}"
        )
    stats = stats if stats is not None else SyncStats()
    pairs = _named_inputs(model_or_params)
    if not _is_initialized():
        return 0
    entries, errors, skipped = _collect(pairs, group)
    stats.skipped += skipped
    check_consistent(
        [e.descriptor for e in entries],
        errors,
        group,
        check_timeout,
        "sync_replicated_lora_gradients",
    )
    stats.collectives += 1
    open_buckets: dict[tuple[tuple[str, ...], torch.dtype], tuple[list[_Entry], int]] = {}
    for e in entries:
        key = (tuple(g.group_name for g in e.groups), e.param.dtype)
        nbytes = _local(e.param).numel() * e.param.element_size()
        bucket, size = open_buckets.get(key, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            _reduce_bucket(bucket, e.groups, e.param.dtype, stats)
            bucket, size = [], 0
        bucket.append(e)
        open_buckets[key] = (bucket, size + nbytes)
    # Insertion order of the dict is the same on every rank, so the flush order is too.
    for bucket, _ in open_buckets.values():
        if bucket:
            _reduce_bucket(bucket, bucket[0].groups, bucket[0].param.dtype, stats)
    return len(entries)
