"""The native op's profiling counters (``profile``, ``profile_regions``), read by bench_profile."""

from __future__ import annotations

import math
import time

import pytest
import torch

import kt_kernel as kk

REGIONS = ("forward_tasks", "backward_tasks", "lora_weight_grad")
FIELDS = ("calls", "threads", "wall", "slots", "busy", "max_busy", "tail")

pytestmark = pytest.mark.skipif(
    kk.backend_info().active != "native", reason="the counters live in the native extension"
)


def _read(op: str) -> dict[str, float]:
    names, vals = getattr(torch.ops.kt_kernel, op)(True)
    return dict(zip(names, vals, strict=True))


@pytest.mark.timeout(120)
def test_counters_cover_every_thread_once(kt) -> None:
    # Several 256-row tiles of one expert plus many experts: both threads get tasks.
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 12, (600, 4), generator=gen)
    ids[:, 0] = 3
    p = kt.make_problem(
        tokens=600, hidden=96, inter=80, experts=12, k=4, rank=8, layout="fused", ids=ids
    )
    counts = torch.bincount(ids.reshape(-1), minlength=12).tolist()
    tasks = sum(math.ceil(c / p.weights.format.tile_rows) for c in counts)
    before = kk.get_num_threads()
    kk.set_num_threads(2)
    try:
        kt.run(p, "native")  # warm-up
        _read("profile")
        _read("profile_regions")
        c0 = time.process_time()
        kt.run(p, "native")
        cpu = time.process_time() - c0
        phases = _read("profile")
        regions = _read("profile_regions")
        again = _read("profile_regions")
    finally:
        kk.set_num_threads(None if before == torch.get_num_threads() else before)
    assert set(regions) == {f"{r}.{f}" for r in REGIONS for f in FIELDS}
    want_threads = {"forward_tasks": min(2, tasks), "backward_tasks": min(2, tasks)}
    want_threads["lora_weight_grad"] = 2  # one task per expert, 12 experts
    for r in REGIONS:
        g = {f: regions[f"{r}.{f}"] for f in FIELDS}
        assert g["calls"] == 1, r
        assert g["threads"] == want_threads[r], r
        assert g["slots"] == pytest.approx(g["threads"] * g["wall"], rel=1e-6), r
        # A thread's CPU time within the region cannot exceed the region's wall time.
        assert 0 < g["max_busy"] <= g["busy"] <= g["threads"] * g["max_busy"] + 1e-9, r
        assert g["busy"] <= g["slots"] * 1.01 + 2e-4, r
        assert 0 <= g["tail"] <= g["wall"], r
    # Summed over threads: the weight-gradient phase sees the work of every thread of its
    # region (a timer on the calling thread alone saw about half of it on 2 threads).
    assert phases["lora_weight_grad"] >= 0.9 * regions["lora_weight_grad.busy"] - 1e-4
    for name in ("scatter", "bwd_scatter", "setup"):
        assert phases[name] > 0, name
    # No thread's time is counted twice: the phases fit in the process's CPU time.
    kernel = sum(v for n, v in phases.items() if n != "dequantize")
    assert kernel <= cpu * 1.02 + 1e-3
    assert all(v == 0 for v in again.values())
