"""Real torchrun/gloo runs: one copy of the frozen experts per machine, shared by local ranks.

Two local ranks (and two "nodes" of two ranks on localhost): the ranks' expert storage is
the same bytes, lives in anonymous shared memory (memfd) whose summed PSS is one copy,
training equals one process on all ranks' batches, nothing is ever named under /dev/shm, and
no process holds the storage after a normal exit, after local rank 0 is SIGKILLed right after
creating a block's storage, or after another rank is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import kt_kernel
import moe_experts
from moe_experts.errors import WrapError
from moe_experts.sharing import (
    PAUSE_ENV,
    _accept,
    _address,
    _connect,
    _listen,
    default_kernel_threads,
)

WORKER = Path(__file__).with_name("shm_worker.py")
SHM = Path("/dev/shm")
MEMFD = "/memfd:ktk-moe-"  # how the storage shows in /proc/<pid>/maps and fd links
pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE with 6 MiB of fp32 experts (16 x 128 x 128, 2 layers)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("shm-model")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _names() -> set[Path]:
    """Everything under /dev/shm (sharing must never add anything there)."""
    return set(SHM.iterdir()) if SHM.is_dir() else set()


def _holders(needle: str = MEMFD) -> dict[int, list[str]]:
    """Live processes that map or hold a descriptor of expert storage: pid -> what they hold."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held = [
                line.split(None, 5)[-1]
                for line in (proc / "maps").read_text().splitlines()
                if needle in line
            ]
            held += [
                os.readlink(fd)
                for fd in (proc / "fd").iterdir()
                if os.readlink(fd).startswith(needle)
            ]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if held:
            found[int(proc.name)] = held
    return found


def _launch(
    model_dir: Path,
    out: Path,
    mode: str,
    crash: str = "",
    *,
    nnodes: int = 1,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[str]]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    env.pop("KT_KERNEL_THREADS", None)
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(WORKER),
            str(model_dir),
            str(out),
            mode,
            crash,
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _finish(
    procs: list[subprocess.Popen[str]], timeout: float = 240
) -> list[subprocess.CompletedProcess[str]]:
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


def _torchrun(
    model_dir: Path, out: Path, mode: str, crash: str = "", *, nnodes: int = 1, timeout: float = 240
) -> list[subprocess.CompletedProcess[str]]:
    return _finish(_launch(model_dir, out, mode, crash, nnodes=nnodes), timeout)


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
        # Anonymous memory: no name anywhere, freed with the last mapping.
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
    before = _names()
    info = _check_run(_torchrun(model_dir, tmp_path, mode), tmp_path, 2, model_dir)
    # Both ranks map the same storage (local rank 0 wrote it, one memory file per block) ...
    paths = [sorted(m["path"] for m in rank["maps"]) for rank in info]
    assert paths[0] == paths[1]
    assert len(set(paths[0])) == 2  # two MoE blocks
    # ... and together hold one copy: PSS splits each shared page between its two mappers.
    one_copy = info[0]["kernel_bytes"]
    assert one_copy > 5 * 2**20
    pss = sum(m["pss"] for rank in info for m in rank["maps"])
    rss = [sum(m["rss"] for m in rank["maps"]) for rank in info]
    assert pss <= 1.15 * one_copy, (pss, one_copy)
    assert min(rss) >= one_copy  # each rank really reads all of it through the mapping
    token = paths[0][0].split(MEMFD)[1].split("-")[0]
    assert not _holders(MEMFD + token)  # normal exit: nobody holds the storage any more
    assert _names() <= before  # and nothing was ever named under /dev/shm


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash", ["train", "map"])
def test_a_sigkilled_rank_leaves_nothing(model_dir: Path, tmp_path: Path, crash: str) -> None:
    """Local rank 1 SIGKILLs itself while training, or while mapping block 2."""
    before, held = _names(), _holders()
    runs = _torchrun(model_dir, tmp_path, "wrap" if crash == "train" else "load", crash)
    assert runs[0].returncode != 0
    assert "SIGKILL" in runs[0].stdout, runs[0].stdout[-3000:]  # it died the intended way
    assert _holders().keys() <= held.keys()
    assert _names() <= before


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_local_rank_0_sigkilled_right_after_creating_storage_leaves_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    """The worst moment: block 2's storage exists, no other rank has its descriptor yet."""
    before = _names()
    pause = tmp_path / "paused.json"
    procs = _launch(model_dir, tmp_path, "load", env={PAUSE_ENV: f"2:{pause}"})
    try:
        deadline = time.monotonic() + 200  # a wait for the run to get there, not a verdict
        while not pause.exists() and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pause.exists(), procs[0].communicate(timeout=60)[0][-3000:]
        paused = json.loads(pause.read_text())
        holders = _holders(MEMFD)
        block2 = f"/memfd:ktk-{paused['label']}"
        # Local rank 0 holds block 2's storage (rank 1 maps block 1 only) ...
        assert [p for p, held in holders.items() if any(h.startswith(block2) for h in held)] == [
            paused["pid"]
        ]
        assert len(holders) == 2  # ... both ranks map block 1 ...
        assert _names() <= before  # ... and it has no name anywhere
        os.kill(paused["pid"], signal.SIGKILL)
    finally:
        runs = _finish(procs)
    assert runs[0].returncode != 0
    token = paused["label"].split("-")[1]
    assert not _holders(MEMFD + token), "a process of the job still holds its storage"
    assert _names() <= before


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_no_memory_for_the_copy_is_one_clear_error_on_every_rank(
    model_dir: Path, tmp_path: Path
) -> None:
    """Local rank 0 cannot reserve a block (RLIMIT_FSIZE): every rank stops, none hangs."""
    before = _names()
    runs = _torchrun(model_dir, tmp_path, "load", "nomem")
    out = runs[0].stdout
    assert runs[0].returncode != 0
    assert (
        "WrapError: model.layers.0.mlp.experts: cannot reserve 3.0 MiB of anonymous shared "
        "memory (memfd)" in out
    ), out[-4000:]
    assert "--no-share-experts" in out
    assert "local rank 0 failed to build the shared expert storage" in out  # rank 1's error
    assert "SIGBUS" not in out
    assert _names() <= before


def _failure_run(model_dir: Path, out: Path, mode: str, crash: str) -> list[dict]:
    """Both ranks' recorded errors and leaked descriptors (the worker catches the error)."""
    runs = _torchrun(model_dir, out, mode, crash)
    for run in runs:
        assert run.returncode == 0, run.stdout[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_bad_checkpoint_tensor_is_one_clear_error_on_every_rank_and_leaks_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    """The second block's tensor has the wrong shape: local rank 0 names it, rank 1 says so."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad-model"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors[key] = tensors[key][:64].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    writer, reader = _failure_run(bad, tmp_path, "load", "fail")
    assert writer["error"]["type"] == "LoadError", writer
    assert (
        f"{key!r} has shape [64, 128], the model expects [128, 128]" in writer["error"]["message"]
    )
    assert reader["error"]["type"] == "WrapError", reader
    assert reader["error"]["message"] == (
        "model.layers.1.mlp.experts: local rank 0 failed to build the shared expert storage; "
        "its own output says why"
    )
    # The first block was handed over before the failure: its socket and memfd are closed.
    assert writer["leaked"] == [], writer
    assert reader["leaked"] == [], reader


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "crash", "raised", "label"),
    [
        # After its last block, when rank 0 has already left the loop.
        ("load", "fail-install", "LoadError", ""),
        # The first block's self-check, when rank 0 goes on to hand over the second.
        ("wrap", "fail-selfcheck", "SelfCheckError", "model.layers.1.mlp.experts: "),
    ],
)
def test_a_failure_on_one_rank_outside_the_hand_over_stops_every_rank(
    model_dir: Path, tmp_path: Path, mode: str, crash: str, raised: str, label: str
) -> None:
    """Local rank 1 alone fails between hand-overs: rank 0 raises instead of waiting for it."""
    writer, reader = _failure_run(model_dir, tmp_path, mode, crash)
    assert reader["error"]["type"] == raised, reader
    assert "injected" in reader["error"]["message"]
    assert writer["error"] == {
        "type": "WrapError",
        "message": f"{label}rank 1 failed while wrapping or loading the shared experts; its "
        "own output says why",
    }, writer
    assert writer["leaked"] == [], writer
    assert reader["leaked"] == [], reader


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_nodes_of_two_ranks_one_copy_per_node(model_dir: Path, tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 2`` twice on localhost (static rendezvous)."""
    before = _names()
    info = _check_run(_torchrun(model_dir, tmp_path, "load", nnodes=2), tmp_path, 4, model_dir)
    tokens = [{m["path"].split(MEMFD)[1].split("-")[0] for m in rank["maps"]} for rank in info]
    # Ranks 0-1 are node 0 and share its copy; ranks 2-3 share node 1's, a different one.
    assert tokens[0] == tokens[1]
    assert tokens[2] == tokens[3]
    assert not tokens[0] & tokens[2]
    assert _names() <= before


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


def test_a_reader_refuses_a_socket_its_local_rank_0_does_not_own(tmp_path: Path) -> None:
    # An abstract socket has no permissions and its name shows in /proc/net/unix: once local
    # rank 0 has stopped listening (it failed, or its accept timed out) any process may bind
    # the name. A reader must hand nothing over to, nor map anything from, another process.
    token = f"impostor{os.getpid()}"
    other = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
        squatter.bind(_address(token))
        squatter.listen(1)
        try:
            with pytest.raises(WrapError, match=f"pid {os.getpid()}.*not local rank 0"):
                _connect(token, other.pid)
        finally:
            other.kill()
            other.wait(timeout=60)
        _connect(token, os.getpid()).close()  # its real owner is accepted


_NO_MEMFD = """
import os, socket, sys
from datetime import timedelta
import torch.distributed as dist
from moe_experts.errors import WrapError
from moe_experts.sharing import ExpertSharing
del os.memfd_create  # as on macOS and the BSDs, which also lack SO_PEERCRED
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1,
                        timeout=timedelta(seconds=60))
print("default", ExpertSharing.detect(None))
try:
    ExpertSharing.detect(True)
except WrapError as exc:
    print("forced", exc)
dist.destroy_process_group()
"""


def test_without_memfd_sharing_falls_back_to_a_copy_per_rank_or_one_clear_error(
    tmp_path: Path,
) -> None:
    # A one-rank gloo world that reports LOCAL_WORLD_SIZE=2, on a platform without memfd:
    # by default every rank keeps its own copy; share_experts=True is one clear error.
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _NO_MEMFD, f"file://{tmp_path / 'rdzv'}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "default None" in out.stdout, out.stdout
    assert "forced share_experts=True needs Linux" in out.stdout, out.stdout
    assert "share_experts=False" in out.stdout


_ONE_GLOO_GROUP = """
import gc, os, sys, weakref
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from moe_experts.sharing import destroy_sharing_groups, expert_sharing
backend = dist.get_backend
# The code path of a NCCL default group (which cannot reduce CPU tensors), on gloo: every
# collective is real, only the reported backend name differs.
dist.get_backend = lambda group=None: "nccl" if group is None else backend(group)
for world in ("first", "second"):
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}-{world}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    before = len(c10d._world.pg_map)
    groups = []
    for _ in range(3):
        with expert_sharing(None) as sharing:
            groups.append(sharing.group)
    t = torch.ones(1)
    dist.all_reduce(t, group=groups[0])
    print(world, len({id(g) for g in groups}), len(c10d._world.pg_map) - before,
          backend(groups[0]), groups[0] is not c10d._get_default_group(), id(groups[0]))
    made, default = weakref.ref(groups[0]), weakref.ref(c10d._get_default_group())
    del groups, sharing
    destroy_sharing_groups()  # the cached gloo group first, then the world
    dist.destroy_process_group()
    gc.collect()
    # Nothing holds either group any more: both are freed and their gloo threads joined.
    threads = [t for t in os.listdir("/proc/self/task")
               if "gloo" in open(f"/proc/self/task/{t}/comm").read()]
    print("freed", made() is None, default() is None, len(threads))
"""


def test_a_nccl_world_gets_one_gloo_group_for_every_call(tmp_path: Path) -> None:
    # dist.new_group is a collective of the whole world and torch never frees a group, so
    # detect() must not make one per wrap/load_pretrained call; a new world gets a new one.
    # The cache must not keep a destroyed group alive: its gloo threads would then meet the
    # interpreter's exit, where one still releasing a collective's tensors aborts the process.
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _ONE_GLOO_GROUP, str(tmp_path / "rdzv")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [line[:5] for line in lines] == [
        ["first", "1", "1", "gloo", "True"],
        ["freed", "True", "True", "0"],
        ["second", "1", "1", "gloo", "True"],
        ["freed", "True", "True", "0"],
    ], out.stdout


@pytest.mark.timeout(60)  # SOCKET_TIMEOUT is 300 s: a wait not tied to the death would hang
def test_local_rank_0_stops_waiting_for_a_rank_that_died_before_connecting() -> None:
    token = f"dead{os.getpid()}"
    listener, why = _listen(token, 2)
    assert listener is not None, why
    alive = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({_address(token)!r})
s.recv(1)
""",
        ]
    )
    dead = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    dead.wait(timeout=60)
    try:
        with pytest.raises(WrapError, match=f"pid \\[{dead.pid}\\] exited before connecting"):
            _accept(listener, {alive.pid, dead.pid})
    finally:
        listener.close()
        alive.kill()
        alive.wait(timeout=60)


def test_a_socket_that_cannot_be_opened_says_why() -> None:
    """The reason travels to every rank's error (here: the abstract name is already taken)."""
    token = f"taken{os.getpid()}"
    first, why = _listen(token, 2)
    assert first is not None, why
    try:
        second, why = _listen(token, 2)
        assert second is None
        assert "Address already in use" in why, why
    finally:
        first.close()
