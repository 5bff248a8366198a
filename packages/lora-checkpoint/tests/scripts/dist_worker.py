"""Two gloo ranks save one checkpoint together, load it back and restore DTensors in place.

Usage: ``dist_worker.py ROOT PORT``. Exits non-zero if any rank's check fails.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import lora_checkpoint as lc
from lora_core.contracts import (
    AdaptationResult,
    ComponentVersion,
    PeftExport,
    PeftTensorLayout,
)


def full_values() -> dict[str, torch.Tensor]:
    """The global values of the shared parameters (same on every rank)."""
    g = torch.Generator().manual_seed(0)
    return {
        "dense.lora_A.weight": torch.randn(4, 8, generator=g),
        "dense.lora_B.weight": torch.randn(7, 4, generator=g),  # uneven: 4 + 3 rows
        "experts.lora_A": torch.randn(3, 4, 8, generator=g),
    }


def rank_bias(rank: int) -> torch.Tensor:
    """The rank-local parameter's value on ``rank``."""
    return torch.arange(5.0) + 100 * rank


def build(mesh, rank: int, bad_dtype: bool = False) -> AdaptationResult:
    full = full_values()
    params = [
        (
            "dense.lora_A.weight",
            nn.Parameter(distribute_tensor(full["dense.lora_A.weight"], mesh, [Replicate()])),
        ),
        (
            "dense.lora_B.weight",
            nn.Parameter(distribute_tensor(full["dense.lora_B.weight"], mesh, [Shard(0)])),
        ),
        ("experts.lora_A", nn.Parameter(full["experts.lora_A"].clone())),
        (
            "router.bias",
            nn.Parameter(rank_bias(rank).to(torch.complex64) if bad_dtype else rank_bias(rank)),
        ),
    ]
    return AdaptationResult.create(
        adapted_layers=["dense", "experts"],
        named_optimizer_parameters=params,
        ownership={
            "dense.lora_A.weight": "replicated",
            "dense.lora_B.weight": "sharded",
            "experts.lora_A": "replicated",
            "router.bias": "rank_local",
        },
        producer=ComponentVersion("lora-core", "0.1.0"),
        rank_local_names=["router.bias"],
        peft_exports={
            "dense.lora_A.weight": PeftExport("base_model.model.dense.lora_A.weight"),
            "dense.lora_B.weight": PeftExport("base_model.model.dense.lora_B.weight"),
            "experts.lora_A": PeftExport(
                "base_model.model.experts.lora_A.weight", PeftTensorLayout.EXPERT_STACKED_A
            ),
        },
        peft_target_modules=["dense"],
    )


def worker(rank: int, root: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        result = build(mesh, rank)
        opt = torch.optim.AdamW(result.parameters(), lr=0.1, foreach=False)
        state = lc.TrainingState.capture(opt, result, step=0)  # before any step: empty state
        assert state.optimizer is not None
        assert not state.optimizer.state
        # One AdamW step on DTensor (replicated and sharded) and plain parameters.
        for n, p in result.named_optimizer_parameters:
            # replicated/sharded grads agree across ranks; the rank-local one differs
            p.grad = torch.ones_like(p) * (1.0 + rank if n == "router.bias" else 1.0)
        opt.step()
        opt.zero_grad()
        full = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in result.named_optimizer_parameters
        }
        torch.manual_seed(10 + rank)  # per-rank RNG, must come back per rank
        state = lc.TrainingState.capture(opt, result, step=3, data_position={"rank": rank})
        m = lc.save(root, result, training_state=state)
        assert m.world_size == 2, m
        assert m.name == "step-00000003", m
        assert {s.rank for s in m.shards} == {0, 1}

        loaded = lc.load(root)  # this rank's shards
        for n, v in full.items():
            assert torch.equal(loaded.tensors[n], v), n
        opt2 = torch.optim.AdamW(result.parameters(), lr=0.5, foreach=False)
        loaded.training_state.apply(opt2, result)
        s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
        assert s1.keys() == s2.keys()
        assert len(s1) == 4
        for i in s1:
            for k, v in s1[i].items():
                w = s2[i][k]
                assert type(w) is type(v), (i, k, type(v), type(w))
                if hasattr(v, "to_local"):
                    assert w.placements == v.placements, (i, k)
                    v, w = v.to_local(), w.to_local()
                assert torch.equal(v, w), (i, k)
        assert opt2.param_groups[0]["lr"] == 0.1
        assert loaded.training_state.data_position == {"rank": rank}

        params = dict(result.named_optimizer_parameters)
        ids = {n: id(p) for n, p in params.items()}
        with torch.no_grad():
            for p in result.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).zero_()
        lc.restore(result, loaded)
        assert {n: id(p) for n, p in result.named_optimizer_parameters} == ids
        assert torch.equal(params["dense.lora_A.weight"].to_local(), full["dense.lora_A.weight"])
        shard = full["dense.lora_B.weight"].chunk(2, dim=0)[rank]
        assert torch.equal(params["dense.lora_B.weight"].to_local(), shard)
        assert torch.equal(params["dense.lora_B.weight"].full_tensor(), full["dense.lora_B.weight"])
        assert torch.equal(params["router.bias"].detach(), full["router.bias"])
        torch.rand(1)
        loaded.training_state.apply(None, result)
        torch.manual_seed(10 + rank)
        expected = torch.rand(4)
        loaded.training_state.apply(None, result)
        assert torch.equal(torch.rand(4), expected)

        # A rank that fails to write stops the publish on every rank.
        bad = build(mesh, rank, bad_dtype=(rank == 1))
        error = ""
        try:
            lc.save(root, bad, step=4)
        except lc.CheckpointError as exc:
            error = str(exc)
        if "rank 1" not in error or "complex64" not in error:
            raise AssertionError(f"a failing rank did not stop the publish: {error!r}")
        assert lc.load(root).manifest.name == "step-00000003"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The mesh stays referenced from torch's DTensor caches, so its gloo threads outlive
    # destroy_process_group; one still running in the interpreter's finalisation aborts the
    # process (SIGABRT). A rank that got here passed: end it without the finalisation.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
