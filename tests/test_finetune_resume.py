"""``--resume`` continues exactly: a resumed run equals the uninterrupted one, bitwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_checkpoint import load
from lora_checkpoint._fs import CRASH_POINTS, KILL_AT_ENV


@pytest.mark.timeout(400)
def test_resume_equals_uninterrupted(tmp_path: Path, cli) -> None:
    common = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--keep-last", "5"]
    full = cli.run([*common, "--steps", "6", "--save-every", "3", "--output", str(tmp_path / "a")])
    assert full.returncode == 0, full.stderr
    # Stop after 3 steps, then continue in a new process from that checkpoint.
    part = cli.run([*common, "--steps", "3", "--output", str(tmp_path / "b")])
    assert part.returncode == 0, part.stderr
    ckpt_b = Path(part.stdout.split("checkpoint:")[1].split()[0])
    resumed = cli.run(
        [*common, "--steps", "6", "--output", str(tmp_path / "b"), "--resume", str(ckpt_b)]
    )
    assert resumed.returncode == 0, resumed.stderr

    losses_a = [r["loss"] for r in cli.log(tmp_path / "a")]
    losses_b = [r["loss"] for r in cli.log(tmp_path / "b")]
    assert losses_b == losses_a  # bitwise: same floats, same order
    final_a = Path(full.stdout.split("checkpoint:")[1].split()[0])
    final_b = Path(resumed.stdout.split("checkpoint:")[1].split()[0])
    _assert_same_checkpoint(final_a, final_b)


def _assert_same_checkpoint(final_a: Path, final_b: Path) -> None:
    """Same tensors, optimizer state and step, and byte-identical tensor files."""
    a, b = load(final_a), load(final_b)
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype, k
        assert a.tensors[k].equal(b.tensors[k]), k
    # The optimizer state (AdamW moments, step counts) continues exactly too.
    opt_a, opt_b = a.training_state.optimizer, b.training_state.optimizer
    assert opt_a.state.keys() == opt_b.state.keys()
    for name, state in opt_a.state.items():
        for key, value in state.items():
            other = opt_b.state[name][key]
            if isinstance(value, torch.Tensor):
                assert value.equal(other), (name, key)
            else:
                assert value == other, (name, key)
    assert a.training_state.step == b.training_state.step
    # And the files themselves: every tensor file is byte-identical (only the manifest's
    # creation time differs).
    files = sorted(p.name for p in final_a.glob("*.safetensors"))
    assert files == sorted(p.name for p in final_b.glob("*.safetensors"))
    for name in files:
        assert (final_a / name).read_bytes() == (final_b / name).read_bytes(), name


# -- a kill at any instant of a save -------------------------------------------------------

# Saves every step and keeps one checkpoint, so the save of step 2 passes every point
# (including pruning step 1); the kill comes during that save.
KILL_RUN = [
    "--batch-size", "4", "--seq-len", "32", "--no-progress", "--steps", "3",
    "--save-every", "1", "--keep-last", "1",
]  # fmt: skip


def _killed_at(cli, point: str, out: Path) -> None:
    """Run KILL_RUN into ``out`` and SIGKILL it at ``point`` of the save of step 2."""
    env = {**cli.env, KILL_AT_ENV: f"{point}:step-00000002"}
    proc = subprocess.run(
        cli.command([*KILL_RUN, "--output", str(out)]),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """The run every killed-and-resumed run must equal, bitwise."""
    out = tmp_path_factory.mktemp("uninterrupted")
    env = dict(os.environ, MOE_EXPERTS_CACHE=str(model_cache), HF_HUB_OFFLINE="1")
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_experts.finetune", *KILL_RUN, "--output", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _resume_equals_uninterrupted(cli, out: Path, uninterrupted: Path) -> None:
    # Resumed from the root, the form the tool prints: the newest checkpoint that verifies,
    # whatever `latest` says.
    resumed = cli.run([*KILL_RUN, "--output", str(out), "--resume", str(out / "checkpoints")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in cli.log(out)] == [r["loss"] for r in cli.log(uninterrupted)]
    _assert_same_checkpoint(
        uninterrupted / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000003"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        ".lock",
        "latest",
        "step-00000003",
    ]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_kill_at_any_point_of_a_save_then_resume_from_the_root(
    tmp_path: Path, cli, uninterrupted: Path, point: str
) -> None:
    out = tmp_path / "run"
    _killed_at(cli, point, out)
    _resume_equals_uninterrupted(cli, out, uninterrupted)


@pytest.mark.timeout(400)
def test_resume_skips_a_newer_checkpoint_that_fails_verification_but_never_rewrites_it(
    tmp_path: Path, cli, uninterrupted: Path, assert_clean_error
) -> None:
    out = tmp_path / "run"
    _killed_at(cli, "renamed", out)  # step-00000002 published, step-00000001 not yet pruned
    newest = out / "checkpoints" / "step-00000002"
    adapter = newest / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-1] ^= 0xFF
    adapter.write_bytes(bytes(data))
    proc = cli.run([*KILL_RUN, "--output", str(out), "--resume", str(out / "checkpoints")])
    # step 1 verifies and is taken; step 2 would be trained again over the damaged one.
    assert "skipped step-00000002" in proc.stderr, proc.stderr
    assert_clean_error(proc, str(newest), "move it out of the way")
    newest.rename(tmp_path / "damaged")
    _resume_equals_uninterrupted(cli, out, uninterrupted)
