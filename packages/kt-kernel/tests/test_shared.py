"""Expert storage in anonymous shared memory: every format round-trips bitwise, across
processes, nothing is ever named or left behind, mismatches and a lack of room are clear errors."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kt_kernel as kk

FORMATS = list(kk.FORMATS)
E, H, I = 4, 128, 128  # noqa: E741 (I: the intermediate size); multiples of 128 for FP8 blocks


def _weights(fmt: str, bias: bool, seed: int = 0) -> kk.ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    spec = kk.ExpertSpec(E, H, I, activation=kk.ClampedSwiGLU(alpha=1.702, limit=7.0))
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    down = torch.randn(E, H, I, generator=gen) / I**0.5
    return kk.ExpertWeights.from_fused(
        spec,
        gate_up,
        down,
        dtype=kk.FORMATS[fmt].compute_dtypes[-1],  # bf16 where the format has it
        weight_dtype=fmt,
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


def _memfd_holders(label: str) -> list[int]:
    """Pids of live processes that map or hold a descriptor of the labelled storage."""
    needle = f"/memfd:ktk-{label} "
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held = needle in (proc / "maps").read_text() or any(
                os.readlink(fd).startswith(needle.rstrip()) for fd in (proc / "fd").iterdir()
            )
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if held:
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bitwise_and_computes_the_same(fmt: str, bias: bool) -> None:
    w = _weights(fmt, bias)
    made = kk.write_shared(w)
    try:
        mapped = kk.map_shared(made.fd, w.spec, w.format)
    finally:
        os.close(made.fd)  # the mappings keep the memory
    assert made.nbytes >= w.nbytes
    for other in (made.weights, mapped):
        assert other.format == w.format
        assert other.spec == w.spec
        assert other.nbytes == w.nbytes
        assert _digest(other) == _digest(w)
        assert other.storage[0][0].data_ptr() % 4096 == 0
    assert made.weights.is_quantized == w.is_quantized
    if w.is_quantized:  # the report travels with the storage
        assert mapped.quantization_report() == w.quantization_report()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=gen).to(w.dtype)
    ids = torch.rand(9, E, generator=gen).topk(2, dim=-1).indices
    tw = torch.rand(9, 2, generator=gen)
    ref = kk.moe_experts_forward(x, ids, tw, w)
    assert torch.equal(kk.moe_experts_forward(x, ids, tw, mapped), ref)


_CHILD = textwrap.dedent(f"""
    import ctypes, hashlib, sys, torch, kt_kernel as kk
    spec = kk.ExpertSpec({E}, {H}, {I}, activation=kk.ClampedSwiGLU(alpha=1.702, limit=7.0))
    src = sys.argv[1]
    w = kk.map_shared(int(src) if src.isdigit() else src, spec, kk.Int4Grouped(torch.bfloat16))
    h = hashlib.sha256()
    for t in (*w.storage[0], *w.storage[1], w.gate_up_bias, w.down_bias):
        t = t.contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
    print(h.hexdigest())
""")


@pytest.mark.parametrize("how", ["inherited-fd", "proc-path"])
def test_another_process_maps_the_same_bytes(how: str) -> None:
    w = _weights("int4", bias=True)
    made = kk.write_shared(w)
    try:
        if how == "inherited-fd":
            arg, fds = str(made.fd), (made.fd,)
        else:
            arg, fds = f"/proc/{os.getpid()}/fd/{made.fd}", ()
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, arg],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            pass_fds=fds,
        )
    finally:
        os.close(made.fd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _digest(w)


def test_nothing_is_ever_named_and_a_killed_writer_leaves_nothing() -> None:
    # The storage lives in an anonymous memory file: no name under /dev/shm at any time, and
    # a writer SIGKILLed while holding it (mapped and open) leaves no holder behind.
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    label = f"test{os.getpid()}"
    code = textwrap.dedent(f"""
        import signal, torch, kt_kernel as kk
        w = kk.ExpertWeights.from_fused(kk.ExpertSpec(2, 16, 8), torch.ones(2, 16, 16),
                                        torch.ones(2, 16, 8))
        made = kk.write_shared(w, label={label!r})
        print("ready", flush=True)
        signal.pause()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert _memfd_holders(label) == [proc.pid]  # it holds the storage ...
        if shm.is_dir():
            assert set(shm.iterdir()) <= before  # ... which has no name
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _memfd_holders(label) == []


def test_storage_is_mapped_private_read_only_so_kernels_before_6_7_map_it() -> None:
    # Linux before 6.7 refuses any MAP_SHARED mapping of a write-sealed memfd (EPERM), even
    # PROT_READ; a read-only MAP_PRIVATE mapping maps the same page-cache pages (one copy) on
    # every kernel. /proc/self/maps shows the kind: "r--p", never "r--s".
    w = _weights("int8", bias=False)
    label = f"priv{os.getpid()}"
    made = kk.write_shared(w, label=label)
    try:
        mapped = kk.map_shared(made.fd, w.spec, w.format)
        assert _digest(mapped) == _digest(w)
        perms = [
            line.split()[1]
            for line in Path("/proc/self/maps").read_text().splitlines()
            if f"/memfd:ktk-{label} " in line
        ]
    finally:
        os.close(made.fd)
    assert len(perms) == 2, perms  # the writer's own view and the second mapping
    assert set(perms) == {"r--p"}, perms


def test_mismatches_and_misuse_are_refused(tmp_path: Path) -> None:
    w = _weights("int8", bias=False)
    made = kk.write_shared(w)
    try:
        with pytest.raises(kk.SharedMemoryError, match="expected 'dense'"):
            kk.map_shared(made.fd, w.spec, kk.Dense(torch.bfloat16))
        with pytest.raises(kk.SharedMemoryError, match=r"\(4, 256, 128\)"):
            kk.map_shared(made.fd, kk.ExpertSpec(E, 2 * H, I), w.format)
        with pytest.raises(OSError):  # sealed: not even the writer's descriptor can change it
            os.write(made.fd, b"x")
    finally:
        os.close(made.fd)
    with pytest.raises(kk.SharedMemoryError, match="cannot open"):
        kk.map_shared(tmp_path / "missing", w.spec, w.format)
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 64)
    with pytest.raises(kk.SharedMemoryError, match="not sealed"):
        kk.map_shared(junk, w.spec, w.format)
    fd = os.memfd_create("ktk-junk", os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, b"x" * 64)
        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
        )
        with pytest.raises(kk.SharedMemoryError, match="bad magic"):
            kk.map_shared(fd, w.spec, w.format)
    finally:
        os.close(fd)


def _sealed(header: dict, size: int = 8192) -> int:
    """A sealed memfd with the right magic and ``header`` (not made by write_shared)."""
    body = json.dumps(header).encode()
    blob = b"KTKSHM01" + len(body).to_bytes(8, "little") + body
    fd = os.memfd_create("ktk-forged", os.MFD_ALLOW_SEALING)
    os.write(fd, blob + b"\0" * (size - len(blob)))
    fcntl.fcntl(
        fd,
        fcntl.F_ADD_SEALS,
        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
    )
    return fd


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ({"format": "int8", "shape": [E, H, I]}, "KeyError: 'tensors'"),
        ({"tensors": []}, "no 'format'"),
        (
            {
                "format": "int8",
                "shape": [E, H, I],
                "tensors": [{"name": "x", "dtype": "Tensor", "shape": [2], "offset": 0}],
            },
            "TypeError",
        ),
        (
            {
                "format": "int8",
                "shape": [E, H, I],
                "tensors": [{"name": "x", "dtype": "nosuch", "shape": [2], "offset": 0}],
            },
            "AttributeError",
        ),
        (
            {
                "format": "int8",
                "shape": [E, H, I],
                "tensors": [{"name": "x", "dtype": "float32", "shape": [2], "offset": -8192}],
            },
            "runs past the end",
        ),
    ],
)
def test_a_malformed_header_is_one_clear_error(header: dict, needle: str) -> None:
    """Storage with the right magic but a broken header never raises a raw KeyError."""
    w = _weights("int8", bias=False)
    fd = _sealed(header)
    try:
        with pytest.raises(kk.SharedMemoryError, match=re.escape(needle)):
            kk.map_shared(fd, w.spec, w.format)
    finally:
        os.close(fd)


def test_no_room_is_one_clear_error_at_creation() -> None:
    # RLIMIT_FSIZE caps the reservation (posix_fallocate) as a full machine would: the error
    # comes from write_shared, names the size and where it is charged, and nothing is left.
    code = textwrap.dedent("""
        import resource, torch, kt_kernel as kk
        w = kk.ExpertWeights.from_fused(kk.ExpertSpec(4, 256, 256), torch.ones(4, 512, 256),
                                        torch.ones(4, 256, 256))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            kk.write_shared(w)
        except kk.SharedMemoryError as exc:
            print("ERROR", exc)
            print("CAUSE", type(exc.__cause__).__name__)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "cannot reserve 3.0 MiB of anonymous shared memory (memfd)" in out.stdout, out.stdout
    assert "container's memory limit" in out.stdout
    assert "CAUSE OSError" in out.stdout


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
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "KT_KERNEL_THREADS": "5"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.stdout.strip() == "5", out.stderr


def test_without_memfd_kt_kernel_imports_and_write_shared_is_one_clear_error() -> None:
    # macOS and the BSDs have fcntl without the F_SEAL_* constants and no os.memfd_create:
    # kt_kernel must still import (sharing is optional), and write_shared says why it cannot.
    code = textwrap.dedent("""
        import fcntl, os
        for name in [n for n in dir(fcntl) if n.startswith("F_SEAL_") or n.endswith("_SEALS")]:
            delattr(fcntl, name)
        del os.memfd_create
        import torch, kt_kernel as kk
        w = kk.ExpertWeights.from_fused(kk.ExpertSpec(2, 16, 8), torch.ones(2, 16, 16),
                                        torch.ones(2, 16, 8))
        try:
            kk.write_shared(w)
        except kk.SharedMemoryError as exc:
            print("ERROR", exc)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "ERROR shared expert storage needs Linux" in out.stdout, out.stdout
