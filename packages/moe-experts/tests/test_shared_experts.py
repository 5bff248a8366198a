"""Real torchrun/gloo runs: one copy of the frozen experts per machine, shared by local ranks.

Two local ranks (and two "nodes" of two ranks on localhost): the ranks' expert storage is
the same bytes, lives in a shared segment whose summed PSS is one copy, training equals one
process on all ranks' batches, and no segment is left in /dev/shm after a normal exit or a
SIGKILLed rank.
"""

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

import kt_kernel
import moe_experts
from moe_experts.sharing import default_kernel_threads

WORKER = Path(__file__).with_name("shm_worker.py")
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux tmpfs)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE with 6 MiB of fp32 experts (16 x 128 x 128, 2 layers)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=128, intermediate_size=128,
                         moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=16,
                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("shm-model")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _segments() -> set[Path]:
    return {p for p in SHM.glob("ktk-*") if kt_kernel.SegmentName.parse(p) is not None}


def _torchrun(model_dir: Path, out: Path, mode: str, crash: str = "", *, nnodes: int = 1,
              timeout: float = 240) -> list[subprocess.CompletedProcess[str]]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("KT_KERNEL_THREADS", None)
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
               "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), str(WORKER), str(model_dir), str(out), mode, crash]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    done = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def _reference(model_dir: Path, world: int) -> tuple[str, list[float], dict[str, torch.Tensor]]:
    """One process: the storage digest, and training on every rank's batch (losses averaged)."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import shm_worker as w
    finally:
        sys.path.pop(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = w.build(model_dir, "load")
    digest, _ = w.storage_digest(model)
    torch.manual_seed(0)
    result = moe_experts.adapt(model, w.CFG)
    named = list(result.named_optimizer_parameters)
    w.init_b(named)
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    batches = [w.batch_for(r) for r in range(world)]
    losses = []
    for _ in range(w.STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(model(b, labels=b).loss for b in batches) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return digest, losses, {n: p.detach().clone() for n, p in named}


def _check_run(runs, out: Path, world: int, model_dir: Path) -> list[dict]:
    for run in runs:
        assert run.returncode == 0, run.stdout[-4000:]
    info = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    digest, losses, params = _reference(model_dir, world)
    for r, rank in enumerate(info):
        assert rank["digest"] == digest, f"rank {r}: its experts differ from one process's"
        assert rank["inside_shared"], f"rank {r}: its storage is not in a shared segment"
        # Every segment was unlinked while mapped: nothing can be left behind from here on.
        assert rank["maps"]
        assert all(m["path"].endswith("(deleted)") for m in rank["maps"]), rank["maps"]
        assert rank["kernel_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
        for step, (a, b) in enumerate(zip(rank["losses"], losses, strict=True)):
            assert abs(a - b) <= 1e-4, f"rank {r} step {step}: {a} vs one process {b}"
        got = torch.load(out / f"params{r}.pt")
        for n, p in params.items():
            torch.testing.assert_close(got[n], p, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: n + m)
    return info


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["load", "wrap"])
def test_two_local_ranks_map_one_copy_and_train_as_one_process(
    model_dir: Path, tmp_path: Path, mode: str
) -> None:
    before = _segments()
    info = _check_run(_torchrun(model_dir, tmp_path, mode), tmp_path, 2, model_dir)
    # Both ranks map the same segments (local rank 0 wrote them) ...
    paths = [sorted(m["path"] for m in rank["maps"]) for rank in info]
    assert paths[0] == paths[1]
    owner = kt_kernel.SegmentName.parse(Path(paths[0][0].split(" ")[0])).owner_pid
    assert owner == next(rank["pid"] for rank in info if rank["local_rank"] == 0)
    # ... and together hold one copy: PSS splits each shared page between its two mappers.
    one_copy = info[0]["kernel_bytes"]
    assert one_copy > 5 * 2**20
    pss = sum(m["pss"] for rank in info for m in rank["maps"])
    rss = [sum(m["rss"] for m in rank["maps"]) for rank in info]
    assert pss <= 1.15 * one_copy, (pss, one_copy)
    assert min(rss) >= one_copy  # each rank really reads all of it through the mapping
    assert _segments() <= before  # normal exit: no segment left


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash", ["train", "map"])
def test_a_sigkilled_rank_leaves_no_segment(model_dir: Path, tmp_path: Path, crash: str) -> None:
    """Local rank 1 SIGKILLs itself while training, or while mapping block 2 (named window)."""
    before = _segments()
    runs = _torchrun(model_dir, tmp_path, "wrap" if crash == "train" else "load", crash)
    assert runs[0].returncode != 0
    assert "SIGKILL" in runs[0].stdout, runs[0].stdout[-3000:]  # it died the intended way
    left = _segments() - before
    if crash == "train":
        assert not left, left  # the names were gone before training started
    else:
        # The writer unlinks in its error path; if torchrun's SIGTERM beat it, the next job's
        # start-up sweep removes what a dead writer left (never a live writer's segment).
        kt_kernel.remove_stale_segments()
        assert not (_segments() - before)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_nodes_of_two_ranks_one_copy_per_node(model_dir: Path, tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 2`` twice on localhost (static rendezvous)."""
    before = _segments()
    info = _check_run(_torchrun(model_dir, tmp_path, "load", nnodes=2), tmp_path, 4, model_dir)
    tokens = [{kt_kernel.SegmentName.parse(Path(m["path"].split(" ")[0])).token
               for m in rank["maps"]} for rank in info]
    # Ranks 0-1 are node 0 and share its copy; ranks 2-3 share node 1's, a different one.
    assert tokens[0] == tokens[1]
    assert tokens[2] == tokens[3]
    assert not tokens[0] & tokens[2]
    assert _segments() <= before


def test_kernel_threads_default_to_a_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun exports by default
        monkeypatch.delenv("KT_KERNEL_THREADS", raising=False)
        assert default_kernel_threads() == max(1, cores // 2) == kt_kernel.get_num_threads()
        kt_kernel.set_num_threads(None)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice: left alone
        assert default_kernel_threads() is None
        monkeypatch.setenv("KT_KERNEL_THREADS", "1")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert default_kernel_threads() is None
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.delenv("KT_KERNEL_THREADS")
        assert default_kernel_threads() is None
    finally:
        kt_kernel.set_num_threads(None)
