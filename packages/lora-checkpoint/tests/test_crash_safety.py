"""SIGKILL the writer at random points: the root always loads a complete checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lora_checkpoint as lc

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
