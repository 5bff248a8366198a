"""The replicate path: LoRA adapters as replicated DTensors on the mesh FSDP built.

See :mod:`lora_core.fsdp` for when to use this path rather than the FSDP-native one.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module

from lora_core.fsdp_consistency import (
    DEFAULT_CHECK_TIMEOUT,
    FsdpLayoutError,
    LoraStateMismatchError,
    check_consistent,
    collective_device,
)
from lora_core.layers import _LoRAFactors

__all__ = ["replicate_lora_parameters"]

logger = logging.getLogger(__name__)


def _descriptor(name: str, t: torch.Tensor) -> str:
    """``name|shape|dtype|layout`` of a plain tensor, as the fingerprint hashes it."""
    return f"{name}|{list(t.shape)}|{str(t.dtype).removeprefix('torch.')}|Tensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated_input(_module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    """Forward pre-hook: plain tensors enter the adapter as replicated DTensors."""
    placements = [Replicate()] * mesh.ndim
    return tuple(
        DTensor.from_local(x, mesh, placements, run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_output(_module: nn.Module, outputs: Any, _mesh: DeviceMesh) -> Any:
    """Forward hook: hand a plain tensor back to ``LoRALinear`` (its base output is plain)."""
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _bytes_digest(t: torch.Tensor) -> int:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _lora_layers(model: nn.Module) -> list[tuple[str, _LoRAFactors]]:
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, _LoRAFactors)]
    return sorted(layers, key=lambda item: item[0])


@torch.no_grad()
def replicate_lora_parameters(
    model: nn.Module, *, check_timeout: timedelta = DEFAULT_CHECK_TIMEOUT
) -> int:
    """Make every LoRA A/B of an FSDP2-sharded model a replicated DTensor on FSDP's mesh.

    The replicate path: call after ``fully_shard`` and ``enable_lora_training`` (which adds
    the adapters as plain parameters FSDP does not manage), and before the first forward,
    while FSDP holds the sharded base parameters. Values are broadcast from the
    first rank of the mesh along each mesh dim in flat buckets and then checked bitwise
    (a rank whose adapters differed before the broadcast gets a warning naming it). Each
    adapter ``nn.Linear`` gets hooks (``distribute_module``) so it consumes and returns plain
    tensors, and its weight is trainable while the base stays frozen. The adapter
    ``Parameter`` objects are replaced: rebuild optimizers, and refresh an
    ``AdaptationResult`` with ``lora_core.rebind_parameters(result, model)``. A second call
    leaves already replicated adapters as they are.

    Args:
        model: the model, already ``fully_shard``-ed, carrying :class:`LoRALinear` and
            :class:`LoRAParameter` layers.
        check_timeout: how long to wait for the other ranks' fingerprint.

    Returns:
        The number of LoRA parameters that are now replicated DTensors; 0 (and nothing is
        changed) without a process group or when no LoRA base weight is a DTensor.

    Raises:
        FsdpLayoutError: if some LoRA bases are sharded and others are not, they sit on
            different meshes, the mesh does not span the world, an adapter is still on meta,
            or an adapter is already FSDP-sharded (the FSDP-native path).
        LoraStateMismatchError: if ranks hold different LoRA layers, or the values still
            differ after the broadcast.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    layers = _lora_layers(model)
    # Each sharded layer with its base weight, narrowed to DTensor once.
    sharded: list[tuple[str, _LoRAFactors, DTensor]] = []
    plain: list[str] = []
    for n, m in layers:
        base = m.base_weight
        if isinstance(base, DTensor):
            sharded.append((n, m, base))
        else:
            plain.append(n)
    if not sharded:
        return 0
    if plain:
        raise FsdpLayoutError(
            f"LoRA layer {plain[0]!r} has a plain base weight while {sharded[0][0]!r} is "
            "FSDP-sharded; apply fully_shard so that every adapted layer is covered "
            "(e.g. fully_shard(model) on the root) before replicate_lora_parameters"
        )
    mesh = sharded[0][2].device_mesh
    for n, _m, base in sharded:
        if base.device_mesh != mesh:
            raise FsdpLayoutError(
                f"LoRA layer {n!r} is sharded on mesh {base.device_mesh} but "
                f"{sharded[0][0]!r} on {mesh}; replicate_lora_parameters reuses one FSDP mesh"
            )
    if mesh.size() != dist.get_world_size():
        raise FsdpLayoutError(
            f"the FSDP mesh {tuple(mesh.shape)} covers {mesh.size()} of "
            f"{dist.get_world_size()} ranks; replicate_lora_parameters needs a mesh that "
            "spans the whole world"
        )
    placements = [Replicate()] * mesh.ndim
    todo: list[tuple[str, nn.Linear]] = []
    descriptors: list[str] = []
    errors: list[tuple[str, str]] = []
    for n, m, _base in sharded:
        for leaf in ("lora_A", "lora_B"):
            lin: nn.Linear = getattr(m, leaf)
            w = lin.weight
            name = f"{n}.{leaf}.weight"
            if isinstance(w, DTensor):
                if not (w.device_mesh == mesh and all(p.is_replicate() for p in w.placements)):
                    raise FsdpLayoutError(
                        f"{name} is already a DTensor with placements {w.placements}: it is "
                        "managed by FSDP (the FSDP-native path, prepare_for_fsdp=True), whose "
                        "reduce-scatter already averages it; do not call "
                        "replicate_lora_parameters on such a model"
                    )
            elif w.is_meta:
                raise FsdpLayoutError(
                    f"{name} is on the meta device; call result.missing_parameter_initializer"
                    "(model) (or build the adapters eagerly) before replicate_lora_parameters"
                )
            todo.append((name, lin))
            descriptors.append(_descriptor(name, _local(w)))
    check_consistent(descriptors, errors, None, check_timeout, "replicate_lora_parameters")
    locals_ = [_local(lin.weight).detach() for _, lin in todo]
    _broadcast_and_verify([name for name, _ in todo], locals_, mesh)
    for (_name, lin), value in zip(todo, locals_, strict=True):
        if not isinstance(lin.weight, DTensor):
            lin.weight = nn.Parameter(
                DTensor.from_local(value, mesh, placements, run_check=False),
                requires_grad=True,
            )
            distribute_module(lin, mesh, input_fn=_replicated_input, output_fn=_local_output)
        lin.weight.requires_grad_(True)
    for _n, m, _base in sharded:
        for p in m.base_layer.parameters():
            p.requires_grad_(False)
    logger.info("replicated %d LoRA parameters on mesh %s", len(todo), tuple(mesh.shape))
    return len(todo)


def _broadcast_from_mesh_origin(tensors: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Overwrite ``tensors`` in place with mesh coordinate ``(0, ..., 0)``'s values."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        for dim in range(mesh.ndim):
            dist.broadcast(flat, group=mesh.get_group(dim), group_src=0)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()


def _broadcast_and_verify(names: list[str], tensors: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Broadcast ``tensors`` from the mesh origin, then prove every rank holds the same bytes.

    Raises:
        LoraStateMismatchError: if some rank still differs after the broadcast.
    """
    before = torch.tensor([_bytes_digest(t) for t in tensors], dtype=torch.int64)
    _broadcast_from_mesh_origin(tensors, mesh)
    after = torch.tensor([_bytes_digest(t) for t in tensors], dtype=torch.int64)
    both = torch.stack([before, after]).reshape(-1).to(collective_device(None))
    gathered = [torch.empty_like(both) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, both, group=None)
    rows = [g.cpu().view(2, -1) for g in gathered]
    src = int(mesh.mesh.reshape(-1)[0])
    for rank, row in enumerate(rows):
        bad_after = (row[1] != rows[src][1]).nonzero()
        if bad_after.numel():
            name = names[int(bad_after[0])]
            raise LoraStateMismatchError(
                f"replicate_lora_parameters: after the broadcast rank {rank} still holds a "
                f"different value of '{name}' than rank {src}",
                rank=rank,
                parameter=name,
            )
        bad_before = (row[0] != rows[src][0]).nonzero()
        if bad_before.numel() and rank == dist.get_rank():
            name = names[int(bad_before[0])]
            warnings.warn(
                f"rank {rank}: LoRA parameter '{name}' (and {bad_before.numel() - 1} more) "
                f"differed from rank {src} before replication; rank {src}'s values were "
                "broadcast. Initialise adapters identically on every rank (same "
                "LoraConfig.init_seed) to avoid this",
                RuntimeWarning,
                stacklevel=3,
            )
