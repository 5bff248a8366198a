"""``--device``, ``--overlap``, ``--gradient-checkpointing``, ``--gpu-experts`` through the CLI.

On a CPU machine: the GPU settings are refused with one ``error:`` line before the model
loads; the overlapped and checkpointed runs train exactly like the plain run; the hot-expert
plumbing (counting, the checkpoint's record, a resumed run keeping the set) runs with the dense
device on the CPU through ``run_finetune``; the NCCL start failure names the rank and cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

FAST = ["--steps", "3", "--batch-size", "4", "--grad-accum", "2", "--seq-len", "24"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--device", "cuda"], ["--device cuda", "--device cpu"]),
        (["--gpu-experts", "2", "--device", "cpu"], ["--gpu-experts 2", "--device cuda"]),
        (["--gpu-experts", "2"], ["--gpu-experts 2", "found no CUDA"]),
        (["--gpu-experts", "9", "--device", "cpu"], ["--gpu-experts 9", "8 routed experts"]),
    ],
)
def test_gpu_settings_refused_before_the_model_loads(
    tmp_path: Path, cli, assert_clean_error, argv: list[str], words: list[str]
) -> None:
    proc = cli.run([*argv, "--steps", "1", "--output", str(tmp_path / "out")])
    assert_clean_error(proc, *words)
    assert "MoE coverage" not in proc.stderr  # nothing was loaded
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.timeout(300)
def test_overlap_and_checkpointing_train_like_the_plain_run(tmp_path: Path, cli) -> None:
    plain = cli.run([*FAST, "--no-progress", "--output", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stderr
    assert "overlap off; gradient checkpointing off" in plain.stderr
    hybrid = cli.run(
        [
            *FAST,
            "--no-progress",
            "--device",
            "cpu",
            "--overlap",
            "--gradient-checkpointing",
            "--output",
            str(tmp_path / "hybrid"),
        ]
    )
    assert hybrid.returncode == 0, hybrid.stderr
    assert "placement: dense weights cpu (float32)" in hybrid.stderr
    assert "overlap on; gradient checkpointing on" in hybrid.stderr
    want = [r["loss"] for r in cli.log(tmp_path / "plain")]
    got = [r["loss"] for r in cli.log(tmp_path / "hybrid")]
    assert len(want) == 3
    # The overlapped hand-over is exact; the recompute only reorders gradient sums.
    assert got == pytest.approx(want, rel=1e-6, abs=0)


@pytest.mark.timeout(300)
def test_hot_expert_sets_are_recorded_and_kept_on_resume(tmp_path: Path, model_cache, monkeypatch):
    monkeypatch.setenv("MOE_EXPERTS_CACHE", str(model_cache))
    from dataclasses import replace

    import lora_checkpoint
    from moe_experts.finetune.config import FinetuneArgs
    from moe_experts.finetune.run import run_finetune

    for name in ("run", "plain"):
        (tmp_path / name).mkdir()
    args = FinetuneArgs(
        steps=2,
        batch_size=4,
        grad_accum=2,
        seq_len=24,
        device="cpu",  # the dense device of the resident experts (CPU: exact, for tests)
        gpu_experts=3,
        overlap=True,
        output=tmp_path / "run",
        progress=False,
    )
    first = run_finetune(args)
    state = lora_checkpoint.load(first.checkpoint).training_state
    sets = state.data_position["gpu_experts"]
    assert len(sets) == 2
    assert all(len(v) == 3 for v in sets.values())
    again = run_finetune(replace(args, steps=3, resume=first.checkpoint))
    resumed = lora_checkpoint.load(again.checkpoint).training_state.data_position
    assert resumed["gpu_experts"] == sets  # kept, not counted again from other batches
    # The same steps without hot experts: the resident experts compute what the host did.
    plain = run_finetune(replace(args, gpu_experts=0, output=tmp_path / "plain"))
    assert first.losses == pytest.approx(plain.losses, rel=1e-5)


def test_nccl_start_failure_names_the_rank_and_cause(monkeypatch) -> None:
    import torch.distributed as dist

    from moe_experts.finetune import distributed
    from moe_experts.finetune.errors import FinetuneError

    def broken(*args, **kwargs):
        raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(dist, "init_process_group", broken)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(FinetuneError) as info:
        distributed.init_distributed("cpu:gloo,cuda:nccl", torch.device("cuda", 1))
    message = str(info.value)
    assert message.startswith("rank 1: NCCL could not start on cuda:1")
    assert "unhandled cuda error" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_placement_on_this_machine(monkeypatch) -> None:
    from moe_experts.finetune.devices import resolve_placement
    from moe_experts.finetune.errors import FinetuneError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = resolve_placement("auto")
    assert (cpu.dense, cpu.dense_dtype, cpu.lora_dtype, cpu.backend) == (
        torch.device("cpu"),
        torch.float32,
        torch.float32,
        "gloo",
    )
    with pytest.raises(FinetuneError, match=r"--device cuda: .*--device cpu"):
        resolve_placement("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpu = resolve_placement("auto", "bf16")
    assert (gpu.dense, gpu.dense_dtype, gpu.lora_dtype, gpu.backend) == (
        torch.device("cuda", 0),
        torch.bfloat16,
        torch.bfloat16,
        "cpu:gloo,cuda:nccl",
    )
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(FinetuneError, match=r"local rank 1 would use cuda:1.*1 GPU"):
        resolve_placement("cuda")


def test_kernel_cores_follow_the_gpus_numa_node(tmp_path: Path) -> None:
    from moe_experts.finetune.devices import parse_cpulist, plan_kernel_cores, read_numa_nodes

    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    for node, cpus in (("node0", "0-7"), ("node1", "8-15")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory
    nodes = read_numa_nodes(tmp_path)
    assert nodes == {0: list(range(8)), 1: list(range(8, 16))}
    allowed = list(range(16))
    # Four ranks, GPUs 0-1 on node 0 and 2-3 on node 1: each node split between its two.
    gpu_nodes = [0, 0, 1, 1]
    plans = [plan_kernel_cores(allowed, nodes, gpu_nodes, r) for r in range(4)]
    assert [p.cores for p in plans] == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        (12, 13, 14, 15),
    ]
    assert [p.node for p in plans] == [0, 0, 1, 1]
    assert plans[2].describe() == "4 threads on cores 8-11 (NUMA node 1)"
    # Unknown GPU nodes, or one node: an even share of the allowed cores.
    even = [plan_kernel_cores(allowed[:10], nodes, [None] * 3, r).cores for r in range(3)]
    assert even == [(0, 1, 2), (3, 4, 5), (6, 7, 8, 9)]
    assert plan_kernel_cores(allowed, {0: allowed}, [0, 0], 1).cores == tuple(range(8, 16))
    # A cpuset that leaves the GPU's node no core: fall back to the even share.
    assert plan_kernel_cores([0, 1], nodes, [1, 1], 0).cores == (0,)


def test_print_config_shows_the_device_settings(tmp_path: Path, cli) -> None:
    proc = cli.run(["--device", "cpu", "--gradient-checkpointing", "--print-config"])
    assert proc.returncode == 0, proc.stderr
    import yaml

    doc = yaml.safe_load(proc.stdout)
    assert doc["model"]["device"] == "cpu"
    assert doc["model"]["gpu_experts"] == 0
    assert doc["model"]["overlap"] is None
    assert doc["training"]["gradient_checkpointing"] is True
    assert doc["training"]["lora_dtype"] == "fp32"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"device": "gpu"}}))
    bad = cli.run(["--config", str(cfg), "--print-config"])
    assert bad.returncode == 1
    assert "model.device 'gpu'" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_generate_device_cuda_refused_before_loading(tmp_path: Path, cli_env) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from moe_experts.finetune.cli import main; sys.exit(main())",
            "generate",
            "--adapter",
            str(tmp_path / "none"),  # never looked at: the device is refused first
            "--prompt",
            "hi",
            "--device",
            "cuda",
        ],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --device cuda:")
    assert "Traceback" not in proc.stderr
