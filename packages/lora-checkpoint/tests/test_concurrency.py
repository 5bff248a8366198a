"""Several processes on one root: concurrent writers, a held lock, pruning under a reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lora_checkpoint as lc

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from concurrent_writer import value  # noqa: E402

SAVES = 20


def _start(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    return proc


def _expect_values(loaded: lc.LoadedCheckpoint, name: str) -> None:
    prefix, i = name.rsplit("-", 1)
    for index in range(2):
        t = loaded.tensors[f"p{index}"]
        assert torch.equal(t, torch.full_like(t, value(prefix, int(i), index))), (name, index)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_writers_never_lose_a_returned_save(tmp_path):
    root = tmp_path / "root"
    writers = [
        _start(str(SCRIPTS / "concurrent_writer.py"), str(root), f"w{k}", str(SAVES), "0")
        for k in range(2)
    ]
    for w in writers:  # both start saving at once
        w.stdin.write("go\n")
        w.stdin.flush()
    saved: list[str] = []
    for w in writers:
        out, err = w.communicate(timeout=280)
        assert w.returncode == 0, err[-3000:]
        saved += [line.split()[1] for line in out.splitlines() if line.startswith("S ")]
    assert len(saved) == 2 * SAVES
    for name in saved:
        _expect_values(lc.load(root / name), name)
        assert lc.verify(root / name).name == name
    entries = sorted(p.name for p in root.iterdir())
    assert entries == sorted([*saved, "latest", ".lock"])  # no temp, trash or empty dirs
    assert not [p for p in root.iterdir() if p.is_dir() and not any(p.iterdir())]
    assert lc.load(root).manifest.name in saved


def test_second_writer_times_out_naming_the_lock_holder(tmp_path, result):
    root = tmp_path / "root"
    lc.save(root, result, step=1)
    holder = _start(
        "-c",
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); "
        "os.write(fd, f'{os.getpid()}\\n'.encode()); print('READY', flush=True); "
        "sys.stdin.readline()",
        str(root / ".lock"),
    )
    try:
        with pytest.raises(lc.CheckpointLockedError) as info:
            lc.save(root, result, step=2, lock_timeout=0.2)
        assert f"pid {holder.pid}" in str(info.value)
        assert str(root / ".lock") in str(info.value)
        with pytest.raises(lc.CheckpointLockedError, match=f"pid {holder.pid}"):
            lc.save(root, result, step=2, lock_timeout=0)
    finally:
        holder.communicate("release\n", timeout=30)
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert lc.load(root).manifest.name == "step-00000001"  # the refused save left no trace
    lc.save(root, result, step=2, lock_timeout=5)  # the lock is free again
    assert lc.load(root).manifest.name == "step-00000002"


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "5", True])
def test_bad_lock_timeout_refused(tmp_path, result, bad):
    with pytest.raises(lc.CheckpointError, match="lock_timeout"):
        lc.save(tmp_path, result, step=1, lock_timeout=bad)
    assert not tmp_path.joinpath("step-00000001").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pruning_never_fails_a_concurrent_load(tmp_path):
    root = tmp_path / "root"
    stop = tmp_path / "stop"
    reader = _start(str(SCRIPTS / "looping_reader.py"), str(root), str(stop))
    # 4 MiB checkpoints: a load takes long enough that pruning lands inside many of them.
    writer = _start(str(SCRIPTS / "concurrent_writer.py"), str(root), "k", "40", "1", str(1 << 20))
    try:
        writer.stdin.write("go\n")
        writer.stdin.flush()
        _, err = writer.communicate(timeout=280)
        assert writer.returncode == 0, err[-3000:]
    finally:
        stop.touch()
    rout, rerr = reader.communicate(timeout=60)
    assert reader.returncode == 0, rerr[-3000:]
    lines = rout.splitlines()
    assert lines[-1] == "DONE"
    failures = [line for line in lines if line.startswith("FAIL")]
    loads = [line for line in lines if line.startswith("OK")]
    assert not failures, failures[:5]
    assert len(loads) >= 5, "the reader hardly ran; the test proves nothing"
    assert sorted(p.name for p in root.glob("k-*")) == ["k-039"]  # keep_last=1 pruned
