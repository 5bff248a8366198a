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
    env.update({"MOE_EXPERTS_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    return env


class Cli:
    """Runs the fine-tune CLI in a subprocess, single-process or under torchrun."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, args: list[str], *, timeout: float = 240,
            nproc: int = 1) -> subprocess.CompletedProcess[str]:
        """Run ``python -m moe_experts.finetune ARGS`` (under torchrun when nproc > 1)."""
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "-m", "moe_experts.finetune"]
        else:
            cmd = [sys.executable, "-m", "moe_experts.finetune"]
        return subprocess.run([*cmd, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)

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
