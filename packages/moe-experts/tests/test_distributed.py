"""Two real ranks (gloo): FSDP2 dense layers, placeholders ignored, expert LoRA synchronised."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moe_experts
from lora_core import enable_lora_training

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 2


def _named(name: str):
    return lambda message: f"{name}: {message}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model_dir: Path, out: Path, timeout: float = 150) -> None:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(model_dir), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"


def _single_process_reference(model_dir: Path) -> dict[str, torch.Tensor]:
    """The same 5 steps in one process on both ranks' batches (the average of their losses)."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import dist_worker as w
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    moe_experts.wrap(model, weight_dtype="fp32")
    dense = enable_lora_training(model, w.CFG)
    experts = moe_experts.adapt(model, w.CFG, **w.LORA_EXPERTS)
    result = dense.merge(experts)
    w.init_b(list(result.named_optimizer_parameters))
    opt = torch.optim.AdamW(result.parameters(), lr=1e-2)
    batches = [w.batch_for(r) for r in range(WORLD)]
    for _ in range(w.STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(model(b, labels=b).loss for b in batches) / WORLD
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in result.named_optimizer_parameters}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_fsdp2_identical_parameters(saved_models, tmp_path: Path) -> None:
    model_dir = saved_models["qwen3_moe"][1]
    _launch(model_dir, tmp_path)
    info = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    params = [torch.load(tmp_path / f"params_rank{r}.pt") for r in range(WORLD)]
    for r in range(WORLD):
        # Placeholders never became FSDP DTensors: FSDP did not allocate or shard them.
        assert info[r]["placeholders"]
        assert info[r]["dtensor_placeholders"] == []
        assert info[r]["placeholders_all_placeholders"]
        assert info[r]["n_dtensor_params"] > 0
        assert info[r]["n_replicated"] > 0
    # Ranks saw different data, so their unsynchronised expert gradients differed ...
    assert info[0]["pre_sync_norms"] != info[1]["pre_sync_norms"]
    assert info[0]["names"] == info[1]["names"]
    expert_names = [n for n in info[0]["names"] if ".experts.lora." in n]
    assert len(expert_names) == 8
    router_names = [n for n in info[0]["names"] if ".mlp.gate.lora_" in n]
    assert len(router_names) == 4
    assert len([n for n in info[0]["names"] if ".experts.lora_experts.le_" in n]) == 6
    # ... yet after 5 synchronised steps every rank holds identical parameters.
    for n in info[0]["names"]:
        torch.testing.assert_close(params[0][n], params[1][n], rtol=0, atol=0, msg=_named(n))
    # And they equal one process training on both batches (gradient averaging is right).
    ref = _single_process_reference(model_dir)
    for n in info[0]["names"]:
        torch.testing.assert_close(params[0][n], ref[n], rtol=1e-4, atol=1e-5, msg=_named(n))
