"""Host memory after wrap / load_pretrained: only the kernel's experts and the dense weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("memory_worker.py")
pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc accounting"
)


def _run(*args: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("memory") / "qwen3-moe")
    _run("save", path)
    return path


@pytest.mark.parametrize("mode", ["wrap", "stream"])
def test_no_residue_beyond_kernel_and_dense_bytes(checkpoint: str, mode: str) -> None:
    m = _run(mode, checkpoint)
    mib = 2**20
    dense = m["dense"] / mib
    residue = m["rss"] - m["base"] - m["kernel"] / mib
    # The bound: RSS growth minus the kernel's expert bytes within 5% of dense bytes.
    assert dense > 100  # the shape really is dominated by dense bytes, not noise
    assert abs(residue - dense) <= 0.05 * dense, (
        f"{mode}: RSS grew {m['rss'] - m['base']:.1f} MiB for {m['kernel'] / mib:.1f} MiB of "
        f"kernel experts and {dense:.1f} MiB of dense weights"
    )


_FAULTS_FN = """
import resource, sys, torch
from moe_experts.memory import reuse_freed_host_memory

def faults(steps):
    # Three large tensors made, written and freed per step, as a step's activations are.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        tensors = [torch.empty(n << 20, dtype=torch.uint8) for n in (48, 64, 40)]
        for t in tensors:
            t.fill_(1)
        del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""
# Pages the faults(4) above touch: each step's tensors, 4 steps.
_PAGES = 4 * (48 + 64 + 40) * (1 << 20) // 4096

_FAULTS = (
    _FAULTS_FN
    + """
plain = faults(4)
if not reuse_freed_host_memory():
    sys.exit(3)
faults(8)  # the heap grows until the steps' blocks fit in what earlier steps freed
# It may still grow once or twice after that, by where other allocations landed (16384 and
# 10240 faults in two consecutive windows, seen in 1 run of 12 here, then 0): the steady
# state is the smallest of three windows.
print(plain, min(faults(4), faults(4), faults(4)))
"""
)


def test_reuse_freed_host_memory_ends_the_page_faults_of_repeated_large_tensors() -> None:
    # Its own process: mallopt is process-wide and stays set.
    done = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip("no glibc mallopt here")
    assert done.returncode == 0, done.stderr
    plain, reused = (int(x) for x in done.stdout.split())
    assert plain >= _PAGES // 2  # fresh mappings: every page faulted in again each step
    assert reused < plain // 20  # the heap's pages are reused


# The fine-tune CLI in this process, then the same tensors: does the heap setting it left
# make their pages be reused?
_AFTER_CLI = (
    _FAULTS_FN
    + """
from moe_experts.finetune.cli import main
code = main(sys.argv[1:])
faults(8)
print(code, min(faults(4), faults(4), faults(4)))  # the steady state, as above
"""
)


def _faults_after_cli(tmp_path: Path, flag: str) -> tuple[int, str]:
    """Page faults of the tensors above after a one-step CLI run with ``flag``, and its stderr."""
    argv = ["finetune", "--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    argv += ["--no-progress", "--output", str(tmp_path / flag), flag]
    env = dict(os.environ, MOE_EXPERTS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_CLI, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    code, after = (int(x) for x in done.stdout.split()[-2:])
    assert code == 0, done.stderr[-3000:]
    return after, done.stderr


@pytest.mark.timeout(600)
def test_finetune_heap_reuse_flag_sets_the_process_heap(tmp_path: Path) -> None:
    reused, on = _faults_after_cli(tmp_path, "--heap-reuse")
    plain, off = _faults_after_cli(tmp_path, "--no-heap-reuse")
    assert "host heap: freed memory reused by the next step" in on
    assert "host heap: not switched to reuse by this run (--no-heap-reuse)" in off
    # Fresh mappings fault once per page (4 KiB, or 2 MiB where transparent huge pages are
    # on for every mapping); the reused heap almost never.
    assert plain >= _PAGES // 512
    assert reused < plain // 20
