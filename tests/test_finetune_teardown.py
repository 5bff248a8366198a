"""Leaving a torchrun job: no gloo worker thread may meet the interpreter's finalisation.

A gloo group's worker threads release each finished collective's tensors after the caller
has its result; freeing a tensor whose Python object C++ then owns takes the GIL, and during
the interpreter's finalisation Python ends such a thread with ``pthread_exit``, whose unwinding
crosses a ``noexcept`` destructor: SIGABRT, "terminate called without an active exception".
``destroy_process_group`` joins the threads only when nothing else holds the group, so
``teardown_distributed`` must free it, and where torch itself still holds it the CLI's ranks
end without finalisation. (``benchmarks/stress_torchrun.py`` repeats the torchrun tests that
aborted, under CPU load, and counts aborts.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_TEARDOWN = """
import atexit, os, sys
from moe_experts.finetune.distributed import (
    exit_without_finalizing, init_distributed, teardown_distributed,
)
ranks = init_distributed()
import torch, torch.distributed as dist
# What loading a model imports: transformers imports torch.distributed.nn, whose functions
# take group=group.WORLD as a default argument, evaluated when it is first imported.
import transformers.modeling_utils  # noqa: F401
t = torch.full((4,), float(ranks.rank + 1))
dist.all_reduce(t)
held = dist.group.WORLD if sys.argv[1] == "held" else None

class Finalised:
    # Finalisation may already have cleared this module's globals (``ranks``, ``os``) when
    # __del__ runs, so the line and the writer are held by the object itself.
    def __init__(self, rank, write=os.write):
        self.line, self.write = f"rank {rank} finalised\\n".encode(), write

    def __del__(self):
        self.write(1, self.line)

sentinel = Finalised(ranks.rank)  # freed (and says so) only by the interpreter's finalisation
atexit.register(lambda: print(f"rank {ranks.rank} atexit", flush=True))
freed = teardown_distributed()
gloo = [n for n in os.listdir("/proc/self/task")
        if "gloo" in open(f"/proc/self/task/{n}/comm").read()]
print(f"rank {ranks.rank} sum {t.tolist()} freed {freed} gloo-threads {len(gloo)}")
del held
if not freed:
    exit_without_finalizing(0)
"""


def _torchrun(script: Path, arg: str, cli) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(cli.free_port()),
            str(script),
            arg,
        ],
        env=cli.env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_teardown_frees_the_world_group_and_joins_its_gloo_threads(tmp_path: Path, cli) -> None:
    script = tmp_path / "teardown.py"
    script.write_text(_TEARDOWN)
    run = _torchrun(script, "free", cli)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        # The collective was real (1 + 2 on both ranks), and nothing is left of the group.
        assert f"rank {rank} sum [3.0, 3.0, 3.0, 3.0] freed True gloo-threads 0" in run.stdout
        assert f"rank {rank} atexit" in run.stdout
        assert f"rank {rank} finalised" in run.stdout, run.stdout  # a normal exit
    assert "terminate called" not in run.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_group_still_held_ends_the_process_without_finalisation(tmp_path: Path, cli) -> None:
    """Something holds the world group: its threads live on, so finalisation is skipped."""
    script = tmp_path / "teardown.py"
    script.write_text(_TEARDOWN)
    run = _torchrun(script, "held", cli)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank} sum [3.0, 3.0, 3.0, 3.0] freed False gloo-threads 3" in run.stdout
        assert f"rank {rank} atexit" in run.stdout  # the atexit handlers still run ...
        assert f"rank {rank} finalised" not in run.stdout, run.stdout  # ... finalisation not
