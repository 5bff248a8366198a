"""SIGINT/SIGTERM save the current step, print the resume command and exit 130/143; the
printed command continues the run exactly, and the log holds each step once."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 200
COMMON = [
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--no-progress",
    "--steps",
    str(STEPS),
    "--keep-last",
    "3",
]


def _wait_for_steps(proc: subprocess.Popen, log: Path, n: int, limit_s: float = 120) -> None:
    """Poll until the run has logged ``n`` steps (a bound on waiting, not a pass criterion)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        if log.is_file() and len(log.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps logged within {limit_s} s")


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"]
)
def test_signal_saves_and_resume_command_continues(tmp_path: Path, cli, sig, code) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_experts.finetune", *COMMON, "--output", str(out)],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_steps(proc, out / "train_log.jsonl", 3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, (proc.returncode, stdout, stderr)
    assert "Traceback" not in stderr, stderr
    stopped = int(stderr.split("at step ")[1].split(";")[0])
    assert 3 <= stopped < STEPS, stderr
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{stopped:08d}"
    assert [r["step"] for r in cli.log(out)] == list(range(1, stopped + 1))
    assert (out / "loss.png").is_file()

    command = stderr.split("resume with:\n")[1].strip().splitlines()[0]
    argv = shlex.split(command)
    assert argv[:3] == [sys.executable, "-m", "moe_experts.finetune"]
    assert argv[-2:] == ["--resume", str(out / "checkpoints")]
    resumed = subprocess.run(
        argv, env=cli.env, capture_output=True, text=True, timeout=300, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    log = cli.log(out)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))

    # The interrupted-and-resumed run equals an uninterrupted one, loss for loss.
    ref = cli.run([*COMMON, "--output", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr
    assert [r["loss"] for r in log] == [r["loss"] for r in cli.log(tmp_path / "ref")]


def test_log_is_json_lines(tmp_path: Path) -> None:
    """The log reader the CLI uses skips a line cut short by a crash."""
    from moe_experts.finetune.reporting import TrainLog

    path = tmp_path / "train_log.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo')
    log = TrainLog(path)
    assert [r["step"] for r in log.records()] == [1]
    log.start_at(1)
    assert path.read_text() == json.dumps({"step": 1, "loss": 2.0}) + "\n"
