"""Expert storage in a shared-memory file: every format round-trips bitwise, across processes,
mismatches are refused, and segments of dead writers are found and removed."""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kt_kernel as kk
from kt_kernel.shared import SHARED_DIR

FORMATS = ["float32", "bfloat16", *sorted(kk.FORMATS)]
E, H, I = 4, 128, 128  # noqa: E741 (I: the intermediate size); multiples of 128 for FP8 blocks


def _weights(fmt: str, bias: bool, seed: int = 0) -> kk.ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    spec = kk.ExpertSpec(E, H, I, activation=kk.ClampedSwiGLU(alpha=1.702, limit=7.0))
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    down = torch.randn(E, H, I, generator=gen) / I**0.5
    dense = fmt in ("float32", "bfloat16")
    return kk.ExpertWeights.from_fused(
        spec, gate_up, down,
        dtype=getattr(torch, fmt) if dense else torch.bfloat16,
        weight_dtype=None if dense else fmt,
        gate_up_bias=torch.randn(E, 2 * I, generator=gen) if bias else None,
        down_bias=torch.randn(E, H, generator=gen) if bias else None,
    )


def _digest(w: kk.ExpertWeights) -> str:
    h = hashlib.sha256()
    for t in (*w.storage[0], *w.storage[1], w.gate_up_bias, w.down_bias):
        if t is not None:
            h.update(_raw(t))
    return h.hexdigest()


def _raw(t: torch.Tensor) -> bytes:
    # ctypes, not .numpy(): kt-kernel's test environment has no numpy.
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.nbytes)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    """A private segment directory on tmpfs when there is one (the real case), else tmp."""
    base = SHARED_DIR if SHARED_DIR.is_dir() else tmp_path
    d = Path(base) / f"kttest-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bitwise_and_computes_the_same(shm_dir: Path, fmt: str, bias: bool) -> None:
    w = _weights(fmt, bias)
    name = kk.SegmentName("b0", directory=shm_dir)
    shared = kk.write_shared(w, name)
    mapped = kk.map_shared(name, w.spec, w.format)
    kk.unlink_shared(name)
    assert not name.path.exists()  # the mappings keep the memory, the name is gone
    for other in (shared, mapped):
        assert other.format == w.format
        assert other.spec == w.spec
        assert other.nbytes == w.nbytes
        assert _digest(other) == _digest(w)
        assert other.storage[0][0].data_ptr() % 4096 == 0
    assert shared.is_quantized == w.is_quantized
    if w.is_quantized:  # the report travels with the storage
        assert mapped.quantization_report() == w.quantization_report()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=gen).to(w.dtype)
    ids = torch.rand(9, E, generator=gen).topk(2, dim=-1).indices
    tw = torch.rand(9, 2, generator=gen)
    ref = kk.moe_experts_forward(x, ids, tw, w)
    assert torch.equal(kk.moe_experts_forward(x, ids, tw, mapped), ref)


def test_another_process_maps_the_same_bytes(shm_dir: Path) -> None:
    w = _weights("int4", bias=True)
    name = kk.SegmentName("b1", directory=shm_dir)
    kk.write_shared(w, name)
    code = textwrap.dedent(f"""
        import ctypes, hashlib, torch, kt_kernel as kk
        from pathlib import Path
        spec = kk.ExpertSpec({E}, {H}, {I}, activation=kk.ClampedSwiGLU(alpha=1.702, limit=7.0))
        w = kk.map_shared(Path({str(name.path)!r}), spec, kk.Int4Grouped(torch.bfloat16))
        h = hashlib.sha256()
        for t in (*w.storage[0], *w.storage[1], w.gate_up_bias, w.down_bias):
            t = t.contiguous()
            h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
        print(h.hexdigest())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    kk.unlink_shared(name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _digest(w)


def test_mismatches_and_misuse_are_refused(shm_dir: Path) -> None:
    w = _weights("int8", bias=False)
    name = kk.SegmentName("b2", directory=shm_dir)
    kk.write_shared(w, name)
    with pytest.raises(kk.SharedMemoryError, match="File exists"):
        kk.write_shared(w, name)  # never overwrite a live segment
    with pytest.raises(kk.SharedMemoryError, match="expected 'dense'"):
        kk.map_shared(name, w.spec, kk.Dense(torch.bfloat16))
    with pytest.raises(kk.SharedMemoryError, match=r"\(4, 256, 128\)"):
        kk.map_shared(name, kk.ExpertSpec(E, 2 * H, I), w.format)
    kk.unlink_shared(name)
    with pytest.raises(kk.SharedMemoryError, match="cannot open"):
        kk.map_shared(name, w.spec, w.format)
    foreign = kk.SegmentName("b3", owner_pid=os.getppid(), directory=shm_dir)
    with pytest.raises(kk.SharedMemoryError, match="only that process"):
        kk.write_shared(w, foreign)
    (shm_dir / "junk").write_bytes(b"x" * 64)
    with pytest.raises(kk.SharedMemoryError, match="bad magic"):
        kk.map_shared(shm_dir / "junk", w.spec, w.format)
    with pytest.raises(kk.SharedMemoryError, match="key"):
        kk.SegmentName("a/b")


def test_a_killed_writer_leaves_a_segment_that_the_next_sweep_removes(shm_dir: Path) -> None:
    # A writer SIGKILLed between writing and unlinking: the only way a segment can outlive
    # its job. Its pid is dead, so the sweep removes it; a live writer's segment stays.
    code = textwrap.dedent(f"""
        import os, signal, torch, kt_kernel as kk
        from pathlib import Path
        w = kk.ExpertWeights.from_fused(kk.ExpertSpec(2, 16, 8), torch.ones(2, 16, 16),
                                        torch.ones(2, 16, 8))
        kk.write_shared(w, kk.SegmentName("b0", directory=Path({str(shm_dir)!r})))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = list(shm_dir.iterdir())
    assert len(left) == 1
    assert kk.SegmentName.parse(left[0]).owner_pid != os.getpid()
    mine = kk.SegmentName("b9", directory=shm_dir)
    kk.write_shared(_weights("float32", bias=False), mine)
    assert kk.remove_stale_segments(shm_dir) == left
    assert list(shm_dir.iterdir()) == [mine.path]
    kk.unlink_shared(mine)


def test_kernel_thread_count_is_its_own_and_does_not_change_results(kt) -> None:
    if not kk.backend_info().native_available:
        pytest.skip("the thread count is the native extension's")
    p = kt.make_problem(dtype=torch.bfloat16, seed=5)
    torch_threads = torch.get_num_threads()
    try:
        kk.set_num_threads(1)
        assert kk.get_num_threads() == 1 == kk.backend_info().num_threads
        one = kt.run(p, "native")
        kk.set_num_threads(3)
        assert kk.get_num_threads() == 3
        assert torch.get_num_threads() == torch_threads  # torch's own ops keep theirs
        three = kt.run(p, "native")
    finally:
        kk.set_num_threads(None)
    assert kk.get_num_threads() == torch.get_num_threads()
    for key in one:
        assert torch.equal(one[key], three[key]), key
    with pytest.raises(kk.KernelInputError, match="set_num_threads"):
        kk.set_num_threads(-1)
    probe = "import kt_kernel as kk; print(kk.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", probe],
                         env={**os.environ, "KT_KERNEL_THREADS": "5"}, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.stdout.strip() == "5", out.stderr
