"""Worker for the multi-process FSDP tests: ``python _dist_worker.py --scenario S --out DIR``.

Run as a script (one process per rank, env ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``) so it works against an installed, non-editable ``lora_core``. Each rank
writes ``DIR/rank<r>.pt`` (tensors, lists and numbers only; the parent loads it with
``weights_only=True``) and the parent test compares ranks against hand-computed references.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lora_core import (
    AdaptationResult,
    ComponentVersion,
    LoraConfig,
    ParameterOwnership,
    enable_lora_training,
    rebind_parameters,
    remap_checkpoint_keys,
)
from lora_core.fsdp import (
    FsdpLayoutError,
    LoraStateMismatchError,
    SyncStats,
    replicate_lora_parameters,
    sync_replicated_lora_gradients,
)

PG_TIMEOUT = timedelta(seconds=60)
CHECK_TIMEOUT = timedelta(seconds=30)
VOCAB, DIM, FF, LAYERS, SEQ, BATCH = 32, 16, 24, 2, 6, 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
STEPS = 10
# Gradients are recorded at step 1: at step 0 every lora_A gradient is zero (B starts at 0).
RECORD_STEP = 1
# The LoRA layer one rank skips in its forward (its gradient there is None).
SKIPPED = "layers.1.mlp.up_proj"


class Attention(nn.Module):
    """Causal single-head self-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM)
        self.v_proj = nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D] -> [B, T, D]``."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return self.o_proj(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v)


class Mlp(nn.Module):
    """``down(gelu(up(x)))``; ``skip_up`` replaces ``up(x)`` by a fixed projection."""

    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(DIM, FF)
        self.down_proj = nn.Linear(FF, DIM)
        self.skip_up = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D] -> [B, T, D]``."""
        h = x.repeat(1, 1, FF // DIM + 1)[..., :FF] if self.skip_up else self.up_proj(x)
        return self.down_proj(F.gelu(h))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D] -> [B, T, D]``."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, blocks, norm, head: a transformer-like model small enough for CI."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T] -> logits [B, T, V]``."""
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def base_state_dict() -> dict[str, torch.Tensor]:
    """The 'checkpoint' every rank loads: the same values everywhere (seeded)."""
    torch.manual_seed(1234)
    return {k: v.detach().clone() for k, v in TinyLM().state_dict().items()}


def lora_config() -> LoraConfig:
    """The LoRA config shared by every scenario."""
    return LoraConfig(enable=True, rank=4, alpha=8, target_modules=TARGETS, init_seed=7)


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank- and step-specific token ids ``[B, T + 1]``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def shard(model: TinyLM, mesh: Any) -> None:
    """FSDP2 per block and at the root."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def post_load_model(mesh: Any) -> tuple[TinyLM, AdaptationResult, int]:
    """Replicate path: load, shard, add LoRA, replicate."""
    model = TinyLM()
    model.load_state_dict(base_state_dict())
    shard(model, mesh)
    result = enable_lora_training(model, lora_config())
    n = replicate_lora_parameters(model, check_timeout=CHECK_TIMEOUT)
    # Replication swaps the Parameter objects: the result must be re-read from the model.
    return model, rebind_parameters(result, model), n


def native_model(mesh: Any) -> tuple[TinyLM, AdaptationResult]:
    """FSDP-native path: meta build, LoRA in FSDP's groups, load with aliases, initialise."""
    with torch.device("meta"):
        model = TinyLM()
    result = enable_lora_training(model, lora_config(), prepare_for_fsdp=True)
    shard(model, mesh)
    model.to_empty(device="cpu")
    state = remap_checkpoint_keys(base_state_dict(), result)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for key, full in state.items():
            p = own[key]
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
    filled = result.missing_parameter_initializer(model)
    if filled != 2 * len(result.adapted_layers):
        raise RuntimeError(f"initializer filled {filled}")
    return model, rebind_parameters(result, model)


def lora_names(model: nn.Module) -> list[str]:
    """Sorted names of the trainable parameters."""
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached plain copy of the local value (``None`` stays ``None``)."""
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a (possibly sharded) tensor."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(
    model: nn.Module,
    rank: int,
    *,
    skip_rank: int | None,
    record: dict[str, Any],
    sync_target: nn.Module | AdaptationResult | None = None,
) -> list[float]:
    """``STEPS`` AdamW steps with sync + clip; pre/post-sync grads of one step -> ``record``."""
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.0)
    names = lora_names(model)
    losses = []
    for step in range(STEPS):
        skip = rank == skip_rank
        model.get_submodule(SKIPPED.rsplit(".", 1)[0]).skip_up = skip
        loss = loss_fn(model, batch(rank, step))
        loss.backward()
        named = dict(model.named_parameters())
        if step == RECORD_STEP:
            record["pre_grads"] = {n: local(named[n].grad) for n in names}
        stats = SyncStats()
        n = sync_replicated_lora_gradients(
            model if sync_target is None else sync_target,
            check_timeout=CHECK_TIMEOUT,
            stats=stats,
        )
        if step == RECORD_STEP:
            record["synced"] = n
            record["stats"] = [
                stats.parameters,
                stats.zero_filled,
                stats.skipped,
                stats.buckets,
                stats.collectives,
            ]
            record["post_grads"] = {nm: local(named[nm].grad) for nm in names}
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def check_plain_tensors(rank: int, world: int, out: dict[str, Any]) -> None:
    """moe-experts style buffers: plain tensors via an AdaptationResult and via pairs."""
    sizes = [(3, 5), (7,), (2, 2, 2), (11, 1)]
    tensors = [torch.zeros(s, requires_grad=True) for s in sizes]
    for i, t in enumerate(tensors):
        if not (rank == 1 and i == 2):  # rank 1 produced no gradient for buffer 2
            t.grad = torch.full(t.shape, float(rank + 1) * (i + 1)) + torch.arange(
                t.numel(), dtype=torch.float32
            ).view(t.shape)
    rank_local = torch.full((4,), float(rank), requires_grad=True)
    rank_local.grad = torch.full((4,), float(rank))
    named = [(f"experts.{i}.lora", t) for i, t in enumerate(tensors)]
    result = AdaptationResult.create(
        adapted_layers=["experts"],
        named_optimizer_parameters=[*named, ("experts.rank_local", rank_local)],
        ownership={
            **{n: ParameterOwnership.REPLICATED for n, _ in named},
            "experts.rank_local": ParameterOwnership.RANK_LOCAL,
        },
        producer=ComponentVersion("moe-experts", "0.1.0"),
    )
    out["plain_pre"] = [local(t.grad) for t in tensors]
    stats = SyncStats()
    out["plain_synced"] = sync_replicated_lora_gradients(result, stats=stats)
    out["plain_stats"] = [stats.buckets, stats.collectives, stats.zero_filled]
    out["plain_post"] = [local(t.grad) for t in tensors]
    out["rank_local_after"] = local(rank_local.grad)
    # Bucket size 1 byte: one bucket per tensor, same numbers.
    again = [torch.zeros(s, requires_grad=True) for s in sizes]
    for t, pre in zip(again, out["plain_pre"], strict=True):
        t.grad = None if pre is None else pre.clone()
    stats = SyncStats()
    sync_replicated_lora_gradients(
        [(f"experts.{i}.lora", t) for i, t in enumerate(again)], bucket_bytes=1, stats=stats
    )
    out["tiny_bucket_stats"] = [stats.buckets, stats.collectives]
    out["tiny_bucket_post"] = [local(t.grad) for t in again]
    # Mixed dtypes: one bucket per dtype, each dtype kept.
    mixed = [
        ("m.a", torch.zeros(3, requires_grad=True)),
        ("m.b", torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)),
    ]
    for _, t in mixed:
        t.grad = torch.full_like(t, float(rank + 1))
    stats = SyncStats()
    sync_replicated_lora_gradients(mixed, stats=stats)
    out["mixed_stats"] = [stats.buckets, stats.collectives]
    out["mixed_post"] = [local(t.grad) for _, t in mixed]
    # Hundreds of parameters still take a handful of collectives.
    many = [(f"p{i:03d}", torch.ones(i % 7 + 1, requires_grad=True)) for i in range(300)]
    for _, t in many:
        t.grad = torch.full_like(t, float(rank))
    stats = SyncStats()
    sync_replicated_lora_gradients(many, stats=stats)
    out["many_stats"] = [stats.parameters, stats.collectives]
    out["many_value"] = float(many[17][1].grad[0])


def scenario_fsdp(rank: int, world: int, out: dict[str, Any]) -> None:
    """Post-load replicate path with an uneven forward, 10 steps; native path; mismatch."""
    mesh = init_device_mesh("cpu", (world,))
    # No DTensor bases: nothing happens.
    plain = TinyLM()
    enable_lora_training(plain, lora_config())
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    out["plain_model_replicated"] = replicate_lora_parameters(plain)
    out["plain_model_unchanged"] = all(
        not isinstance(p, DTensor) and torch.equal(before[n], p)
        for n, p in plain.named_parameters()
    )

    model, result, n = post_load_model(mesh)
    out["replicated"] = n
    out["n_lora"] = len(result.named_optimizer_parameters)
    out["placements"] = sorted(
        {str(tuple(p.placements)) for p in model.parameters() if p.requires_grad}
    )
    out["mesh_reused"] = all(
        p.device_mesh == mesh for p in model.parameters() if isinstance(p, DTensor)
    )
    base0 = {n: full(p) for n, p in model.named_parameters() if not p.requires_grad}
    out["names"] = lora_names(model)
    named = dict(model.named_parameters())
    # A second call finds everything replicated already and changes no Parameter object.
    out["replicated_again"] = replicate_lora_parameters(model)
    out["same_objects_after_again"] = all(p is named[n] for n, p in model.named_parameters())
    out["rebound"] = all(
        named[n] is p and isinstance(p, DTensor) for n, p in result.named_optimizer_parameters
    )
    # 2 ranks sync through the module, 3 ranks through the AdaptationResult.
    target = model if world == 2 else result
    out["losses"] = train(model, rank, skip_rank=world - 1, record=out, sync_target=target)
    out["final"] = {n: local(p) for n, p in model.named_parameters() if p.requires_grad}
    out["bases_unchanged"] = all(
        torch.equal(full(p), base0[n]) for n, p in model.named_parameters() if n in base0
    )
    out["base_names_unchanged"] = sorted(base0)

    # A rank whose adapters differ before replication is warned and gets rank 0's values.
    odd = TinyLM()
    odd.load_state_dict(base_state_dict())
    shard(odd, mesh)
    enable_lora_training(odd, lora_config())
    target = odd.get_submodule("layers.0.attn.q_proj").lora_A.weight
    if rank == world - 1:
        with torch.no_grad():
            target.add_(1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replicate_lora_parameters(odd)
    out["odd_warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    out["odd_value"] = local(odd.get_submodule("layers.0.attn.q_proj").lora_A.weight)

    if world == 2:
        native, native_result = native_model(mesh)
        try:
            replicate_lora_parameters(native)
            out["native_replicate_error"] = None
        except FsdpLayoutError as exc:
            out["native_replicate_error"] = str(exc)
        # The last rank skips an adapter, so FSDP must reduce-scatter zeros for it.
        native.set_reduce_scatter_unused_params(True)
        out["native_placements"] = sorted(
            {str(tuple(p.placements)) for p in native.parameters() if p.requires_grad}
        )
        native_rec: dict[str, Any] = {}
        out["native_losses"] = train(
            native, rank, skip_rank=world - 1, record=native_rec, sync_target=native_result
        )
        out["native_synced"] = native_rec["synced"]
        out["native_final"] = {n: full(p) for n, p in native.named_parameters() if p.requires_grad}
        check_plain_tensors(rank, world, out)

    # Mismatch: the last rank carries one extra LoRA parameter.
    pairs = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if rank == world - 1:
        extra = torch.zeros(4, 4, requires_grad=True)
        pairs.append(("layers.0.attn.extra_proj.lora_A.weight", extra))
    try:
        sync_replicated_lora_gradients(pairs, check_timeout=CHECK_TIMEOUT)
        out["mismatch"] = None
    except LoraStateMismatchError as exc:
        out["mismatch"] = [str(exc), exc.rank, exc.parameter]
    # Mismatch: rank 0 lacks a parameter the others have (different shapes would be alike).
    pairs = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if rank == 0:
        pairs = [(n, p) for n, p in pairs if n != "layers.1.attn.v_proj.lora_B.weight"]
    try:
        sync_replicated_lora_gradients(pairs, check_timeout=CHECK_TIMEOUT)
        out["missing"] = None
    except LoraStateMismatchError as exc:
        out["missing"] = [str(exc), exc.rank, exc.parameter]


def scenario_hsdp(rank: int, world: int, out: dict[str, Any]) -> None:
    """2x2 HSDP mesh: LoRA averaged over both dims; a sub-group and a sharded param."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, _result, n = post_load_model(mesh)
    out["replicated"] = n
    out["base_placements"] = sorted(
        {str(tuple(p.placements)) for p in model.parameters() if not p.requires_grad}
    )
    out["placements"] = sorted(
        {str(tuple(p.placements)) for p in model.parameters() if p.requires_grad}
    )
    out["coordinate"] = list(mesh.get_coordinate())
    base0 = {n: full(p) for n, p in model.named_parameters() if not p.requires_grad}
    out["names"] = lora_names(model)
    out["losses"] = train(model, rank, skip_rank=3, record=out)
    out["final"] = {n: local(p) for n, p in model.named_parameters() if p.requires_grad}
    out["bases_unchanged"] = all(
        torch.equal(full(p), base0[n]) for n, p in model.named_parameters() if n in base0
    )
    # Plain tensors over the "replicate" dim only; a (Replicate, Shard) DTensor is skipped.
    t = torch.zeros(5, requires_grad=True)
    t.grad = torch.arange(5, dtype=torch.float32) * (rank + 1)
    sharded = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Replicate(), Shard(0)]))
    sharded.grad = distribute_tensor(torch.ones(4, 3), mesh, [Replicate(), Shard(0)])
    stats = SyncStats()
    out["sub_synced"] = sync_replicated_lora_gradients(
        [("t.lora", t), ("w.lora", sharded)], group=mesh.get_group("replicate"), stats=stats
    )
    out["sub_post"] = t.grad.clone()
    out["sub_skipped"] = stats.skipped
    out["sharded_grad_untouched"] = bool(torch.equal(sharded.grad.to_local(), torch.ones(2, 3)))


def scenario_stale(rank: int, world: int, out: dict[str, Any], port2: int) -> None:
    """Ranks 0 and 1 prepare a model for world size 2, then all 3 ranks meet in a new world."""
    if rank < 2:
        store = dist.TCPStore(
            "127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=PG_TIMEOUT
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=PG_TIMEOUT)
        model, _, n = post_load_model(init_device_mesh("cpu", (2,)))
        out["replicated"] = n
        loss_fn(model, batch(rank, 0)).backward()
        dist.destroy_process_group()
    else:
        model = TinyLM()
        enable_lora_training(model, lora_config())
        loss_fn(model, batch(rank, 0)).backward()
    store = dist.TCPStore("127.0.0.1", port2, world, rank == 0, timeout=PG_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
    try:
        sync_replicated_lora_gradients(model, check_timeout=CHECK_TIMEOUT)
        out["stale"] = None
    except LoraStateMismatchError as exc:
        out["stale"] = [str(exc), exc.rank, exc.parameter]
    # Rank 0 calls the sync alone: it must give up after check_timeout, not hang.
    t = torch.zeros(3, requires_grad=True)
    t.grad = torch.ones(3)
    if rank == 0:
        start = time.monotonic()
        try:
            sync_replicated_lora_gradients([("a.lora_A", t)], check_timeout=timedelta(seconds=3))
            out["absent"] = None
        except LoraStateMismatchError as exc:
            out["absent"] = [str(exc), time.monotonic() - start]
    else:
        time.sleep(6)


def main() -> int:
    """Parse args, run one scenario, write this rank's results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["fsdp", "hsdp", "stale"])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--port2", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    out: dict[str, Any] = {"rank": rank, "world": world}
    try:
        if args.scenario == "stale":
            scenario_stale(rank, world, out, args.port2)
        else:
            dist.init_process_group("gloo", timeout=PG_TIMEOUT)
            {"fsdp": scenario_fsdp, "hsdp": scenario_hsdp}[args.scenario](rank, world, out)
        torch.save(out, args.out / f"rank{rank}.pt")
        if args.scenario == "stale":
            # Rank 0's abandoned all_gather is still pending: skip the teardown collectives.
            sys.stdout.flush()
            os._exit(0)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # FSDP's device mesh stays referenced from torch's DTensor caches, so destroy_process_group
    # cannot join its gloo threads; one still releasing a collective's tensors during the
    # interpreter's finalisation ends in std::terminate ("terminate called without an active
    # exception", SIGABRT: a CI flake). Skip the finalisation, as the CLI does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
