"""Shared fixtures for the cross-package tests: isolated caches and a CLI runner."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-session cache for the built-in model, so tests never touch the user's cache."""
    return tmp_path_factory.mktemp("moe-experts-cache")


@pytest.fixture
def cli_env(model_cache: Path) -> dict[str, str]:
    """Environment for CLI subprocesses: offline, isolated cache, deterministic threads."""
    env = dict(os.environ)
    env.update(
        {
            "MOE_EXPERTS_CACHE": str(model_cache),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONHASHSEED": "0",
        }
    )
    return env


class Cli:
    """Runs the fine-tune CLI in a subprocess, single-process or under torchrun."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    @staticmethod
    def free_port() -> int:
        """A free loopback port (for a rendezvous several launches share)."""
        return free_port()

    @staticmethod
    def command(
        args: list[str],
        *,
        nproc: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        port: int | None = None,
    ) -> list[str]:
        """``python -m moe_experts.finetune ARGS``, under torchrun when nproc or nnodes > 1.

        Every "node" of a multi-node job is launched on localhost with the same ``port``
        (a static rendezvous at 127.0.0.1).
        """
        if nproc == 1 and nnodes == 1:
            return [sys.executable, "-m", "moe_experts.finetune", *args]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port or free_port()),
            "-m",
            "moe_experts.finetune",
            *args,
        ]

    def launch(
        self, args: list[str], *, merge: bool = False, **where: int
    ) -> subprocess.Popen[str]:
        """Start the CLI (see :meth:`command`) with pipes; ``merge``: stderr into stdout."""
        return subprocess.Popen(
            self.command(args, **where),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
            text=True,
        )

    def run(
        self, args: list[str], *, timeout: float = 240, nproc: int = 1
    ) -> subprocess.CompletedProcess[str]:
        """Run the CLI to completion (under torchrun when nproc > 1)."""
        return subprocess.run(
            self.command(args, nproc=nproc),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    @staticmethod
    def log(output: Path) -> list[dict]:
        """The JSON-lines training log of a run."""
        text = (output / "train_log.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cli(cli_env: dict[str, str]) -> Cli:
    """A runner for the fine-tune CLI with an isolated environment."""
    return Cli(cli_env)


def _assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit code 1, no traceback, one ``error:`` line holding every needle; returns the line."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def assert_clean_error():
    """The check that a CLI run failed with one clear error line (see above)."""
    return _assert_clean_error
