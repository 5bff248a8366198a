"""Bitwise identical results run to run and for 1 vs 2 threads."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_bitwise_across_threads_and_runs(kt, dtype: torch.dtype, policy: str) -> None:
    # Enough rows that an expert spans several 256-row tiles, and many experts, so the
    # task pool really runs work on both threads.
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 12, (600, 4), generator=gen)
    ids[:, 0] = 3
    p = kt.make_problem(
        tokens=600,
        hidden=96,
        inter=80,
        experts=12,
        k=4,
        rank=8,
        dtype=dtype,
        lora_dtype=torch.float32,
        ids=ids,
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kt.run(p, "native", policy)
        torch.set_num_threads(2)
        two_a = kt.run(p, "native", policy)
        two_b = kt.run(p, "native", policy)
    finally:
        torch.set_num_threads(before)
    for name in one:
        assert torch.equal(one[name], two_a[name]), f"1 vs 2 threads differ in {name}"
        assert torch.equal(two_a[name], two_b[name]), f"run to run differs in {name}"


@pytest.mark.timeout(120)
def test_saved_activations_stay_whole_while_other_calls_run(kt) -> None:
    """Policy save keeps gate_up's pre-activations in a pooled buffer that returns to the pool
    only when the graph lets go of it. Three forwards in flight, a graph dropped unused, the
    pool released and another whole step in between: each backward still gives exactly what
    it gives alone."""
    problems = [
        kt.make_problem(
            tokens=300, hidden=96, inter=80, experts=6, k=2, rank=4, dtype=torch.bfloat16, seed=s
        )
        for s in range(3)
    ]
    want = [kt.run(p, "native", "save") for p in problems]
    in_flight = [kt.forward(p, "native", "save") for p in problems]
    unused = kt.forward(problems[0], "native", "save")
    del unused  # its buffer goes back to the pool while the others are still held
    torch.ops.kt_kernel.release_scratch()
    assert all(torch.equal(kt.run(problems[1], "native", "save")[n], want[1][n]) for n in want[1])
    for p in problems:
        for _, t in p.lora.named_parameters():
            t.grad = None
    for graph, p, ref in reversed(list(zip(in_flight, problems, want, strict=True))):
        got = kt.backward(p, *graph)
        for name in ref:
            assert torch.equal(got[name], ref[name]), name
