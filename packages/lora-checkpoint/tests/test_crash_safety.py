"""SIGKILL the writer at random points: the root always loads a complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lora_checkpoint as lc
from lora_checkpoint._fs import CRASH_POINTS, KILL_AT_ENV

SCRIPT = Path(__file__).parent / "scripts" / "crash_writer.py"
ROUNDS = 25


def _expected(step: int, index: int) -> float:
    return float(step) + index / 8.0


@pytest.mark.timeout(120)
def test_sigkill_during_save_never_leaves_partial_checkpoint(tmp_path):
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(root), str(ROUNDS), "1234"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        last_published = 0
        last_loaded = 0
        newest_dir = 0
        mid_save_kills = 0
        loads = 0
        for r in range(ROUNDS):
            while True:
                line = proc.stdout.readline().strip()
                assert line, f"writer exited early (rc={proc.poll()})"
                kind, value = line.split()
                if kind == "K":
                    assert int(value) == r
                    break
                last_published = int(value)
            if any(p.name.startswith(".tmp-") for p in root.iterdir()):
                mid_save_kills += 1
            if last_published == 0 and not (root / "latest").exists():
                proc.stdin.write("next\n")  # killed before the very first publish
                continue
            loaded = lc.load(root)
            loads += 1
            step = loaded.training_state.step
            assert loaded.manifest.name == f"step-{step:08d}"
            # either the last save the writer reported or the one it was publishing
            assert step >= max(last_published, last_loaded), (step, last_published)
            # a writer killed between its rename and the `latest` update leaves a complete
            # step-N beside `latest` -> N-1; the next writer continues at N+1
            assert step <= max(last_published, last_loaded, newest_dir) + 1
            for i in range(4):
                t = loaded.tensors[f"p{i}"]
                assert torch.equal(t, torch.full_like(t, _expected(step, i))), (step, i)
            last_loaded = step
            newest_dir = max(int(p.name.split("-")[1]) for p in root.glob("step-*"))
            proc.stdin.write("next\n")
        assert loads >= ROUNDS - 2
        assert mid_save_kills >= 1, "no kill landed inside a save; the test proves nothing"
        assert last_loaded >= 5, "too few saves completed between kills"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    published = [p for p in root.iterdir() if p.name.startswith("step-")]
    assert len(published) <= 3 + 1  # keep_last=3, plus at most one not yet pruned


# Saves step 1 (keep_last=1) then step 2, which the hook kills at one point of its save.
_KILL_CHILD = r"""
import sys, torch
import lora_checkpoint as lc
from lora_core.contracts import AdaptationResult, ComponentVersion

p = torch.nn.Parameter(torch.zeros(4, 8))
result = AdaptationResult.create(
    adapted_layers=["x"], named_optimizer_parameters=[("p", p)], ownership={"p": "replicated"},
    producer=ComponentVersion("lora-core", "0.1.0"),
)
for step in (1, 2):
    p.data.fill_(step)
    lc.save(sys.argv[1], result, training_state=lc.TrainingState(step=step), keep_last=1)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_every_crash_point_is_reached_and_leaves_only_complete_checkpoints(tmp_path, point):
    root = tmp_path / "root"
    env = {**os.environ, KILL_AT_ENV: f"{point}:step-00000002"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_CHILD, str(root)], env=env, capture_output=True, timeout=100
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # Every checkpoint under its real name is complete; `latest` names one of them (it may
    # lag one behind: that is why resuming takes the newest that verifies).
    names = sorted(m.name for m in lc.list_checkpoints(root))
    assert names, point
    for name in names:
        lc.verify(root / name)
    assert lc.load(root).manifest.name in names
    published = CRASH_POINTS.index(point) >= CRASH_POINTS.index("renamed")
    assert ("step-00000002" in names) == published, (point, names)
