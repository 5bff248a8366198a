"""Two real gloo processes write one checkpoint: per-rank shards, rank 0 publishes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lora_checkpoint as lc
from lora_core.contracts import AdaptationResult, ComponentVersion

SCRIPT = Path(__file__).parent / "scripts" / "dist_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_gloo_ranks_save_load_restore(tmp_path):
    root = tmp_path / "root"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), str(_free_port())],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    published = sorted(p.name for p in root.iterdir())
    # the failed save left nothing behind (.lock is the root's writer lock)
    assert published == [".lock", "latest", "step-00000003"]
    ckpt = root / "step-00000003"
    files = sorted(os.listdir(ckpt))
    assert "rank_local-rank00000.safetensors" in files
    assert "rank_local-rank00001.safetensors" in files
    assert "training_state-rank00001.json" in files
    m = lc.verify(root)
    assert m.world_size == 2
    assert {s.rank: sorted(s.files) for s in m.shards} == {
        r: sorted(
            [
                f"rank_local-rank{r:05d}.safetensors",
                f"training_state-rank{r:05d}.json",
                f"training_state-rank{r:05d}.safetensors",
            ]
        )
        for r in (0, 1)
    }
    one = lc.load(root, rank=1)
    # rank 1's bias after the worker's single AdamW step with gradient 2
    bias = torch.nn.Parameter(torch.arange(5.0) + 100)
    bias.grad = torch.full((5,), 2.0)
    torch.optim.AdamW([bias], lr=0.1, foreach=False).step()
    assert torch.equal(one.tensors["router.bias"], bias.detach())
    zero = lc.load(root, rank=0)
    assert not torch.equal(zero.tensors["router.bias"], one.tensors["router.bias"])
    exp_avg = one.training_state.optimizer.state["router.bias"]["exp_avg"]
    assert torch.allclose(exp_avg, torch.full((5,), 0.2))  # (1 - beta1) * 2
    assert one.training_state.data_position == {"rank": 1}
    ownership = {p.name: p.ownership.value for p in m.parameters}
    assert ownership["dense.lora_B.weight"] == "sharded"
    assert next(p for p in m.parameters if p.name == "dense.lora_B.weight").shape == (7, 4)
    with pytest.raises(lc.CheckpointError, match=r"world_size 2"):
        lc.load(root, rank=2)
    # AdamW state is stored whole on every rank (the sharded parameter's too, gathered), so
    # a run saved by two ranks continues in one process from rank 0's files.
    for r in (0, 1):
        state = lc.load(root, rank=r).training_state.optimizer.state
        assert state["dense.lora_B.weight"]["exp_avg"].shape == (7, 4)
    params = [(n, torch.nn.Parameter(t.clone())) for n, t in zero.tensors.items()]
    single = AdaptationResult.create(
        adapted_layers=["dense", "experts"],
        named_optimizer_parameters=params,
        ownership={n: "replicated" for n, _ in params},
        producer=ComponentVersion("lora-core", "0.1.0"),
    )
    opt = torch.optim.AdamW(single.parameters(), lr=0.1, foreach=False)
    zero.training_state.apply(opt, single)
    sharded = dict(params)["dense.lora_B.weight"]
    # one step with gradient 1 on every element: exp_avg = (1 - beta1) * 1 everywhere
    assert torch.allclose(opt.state[sharded]["exp_avg"], torch.full((7, 4), 0.1))
    for p in single.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the shapes agree (shard state raised a size mismatch here)
