"""What the weight-format benchmarks share: problem set-up, one timed step, interleaved reps.

``bench_int8.py`` and ``bench_formats.py`` time several bases of the same weights in one
process; both go through :func:`interleaved` so a format never always runs right after
another and load on the shared cores hits every variant alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import kt_kernel as kk

# A sample: (wall seconds, process CPU seconds over all threads).
Sample = tuple[float, float]


def make_weights(
    h: int, i: int, e: int, seed: int = 0, distinct: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` ~ N(0, 1/fan_in).

    With ``distinct = d`` only experts ``[0, d)`` are drawn and expert ``x`` holds a copy of
    expert ``x % d``: every expert still has its own memory (the kernel streams E experts'
    bytes), at a fraction of the set-up time (drawing and quantising 128 real-size experts
    takes minutes on 2 shared cores; a kernel's speed does not depend on the values).
    """
    d = e if distinct is None else distinct
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.empty(e, 2 * i, h, dtype=torch.bfloat16)
    down = torch.empty(e, h, i, dtype=torch.bfloat16)
    for x in range(e):  # expert by expert: no whole-model fp32 temporary
        if x < d:
            gate_up[x].copy_(torch.randn(2 * i, h, generator=gen) / h**0.5)
            down[x].copy_(torch.randn(h, i, generator=gen) / i**0.5)
        else:
            gate_up[x].copy_(gate_up[x % d])
            down[x].copy_(down[x % d])
    return gate_up, down


def make_lora(spec: kk.ExpertSpec, rank: int, seed: int = 1) -> kk.LoraBuffers:
    """A fused bf16 adapter with random A and B (B non-zero, so every LoRA GEMM does work)."""
    gen = torch.Generator().manual_seed(seed)
    lora = kk.LoraBuffers(spec, rank, 2.0 * rank, "fused", dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return lora


def make_inputs(
    tokens: int, h: int, e: int, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]`` bf16, uniform random top-k ``ids [T, k]``, weights ``[T, k]``, ``dy``."""
    x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, e, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=gen)
    dy = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
    return x, ids, w, dy


def step(
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    weights: kk.ExpertWeights,
    lora: kk.LoraBuffers,
    backward: bool = True,
) -> Sample:
    """One native forward (and backward) with policy ``save``; returns a :data:`Sample`."""
    for p in lora.parameters():
        p.grad = None
    xg = x.detach().requires_grad_(backward)
    wg = w.detach().requires_grad_(backward)
    c0, t0 = time.process_time(), time.perf_counter()
    y = kk.moe_experts_forward(xg, ids, wg, weights, lora, policy="save", backend="native")
    if backward:
        y.backward(dy)
    return time.perf_counter() - t0, time.process_time() - c0


def interleaved(
    variants: dict[str, Callable[[], Sample]], reps: int, warmup: bool = True
) -> dict[str, list[Sample]]:
    """``reps`` samples of every variant, the order rotated each round (after one warm-up each).

    Rotation (a b c, b c a, c a b, ...) keeps any variant from always following another, so
    neither cache state nor a burst of load from other users favours one.
    """
    names = list(variants)
    if warmup:  # oneDNN primitives, the scratch pool, first-touch pages
        for n in names:
            variants[n]()
    samples: dict[str, list[Sample]] = {n: [] for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        for n in names[shift:] + names[:shift]:
            samples[n].append(variants[n]())
    return samples


def median_wall(samples: Sequence[Sample]) -> float:
    """Median wall seconds of ``samples``."""
    return statistics.median(s[0] for s in samples)


def median_cpu(samples: Sequence[Sample]) -> float:
    """Median process CPU seconds of ``samples`` (less sensitive to other load than wall time)."""
    return statistics.median(s[1] for s in samples)


def matmul_peak(dtype: torch.dtype, size: int) -> float:
    """GFLOP/s of a square ``torch.mm`` in ``dtype`` (best of 3 after a warm-up): the peak."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best / 1e9


def peak_1t(size: int = 2048, reps: int = 5) -> float:
    """Single-thread bf16 ``torch.mm`` GFLOP per thread CPU second (best of ``reps``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(size, size).to(torch.bfloat16)
        bm = torch.randn(size, size).to(torch.bfloat16)
        a @ bm
        best = float("inf")
        for _ in range(reps):
            c0 = time.thread_time()
            a @ bm
            best = min(best, time.thread_time() - c0)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * size**3 / best / 1e9


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (the machine's cores are shared)."""
    return [round(v, 2) for v in os.getloadavg()]


def machine() -> dict:
    """Threads, versions, ISA path and CPU of this run."""
    info = kk.backend_info()
    return {
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "kt_kernel": kk.__version__,
        "isa": info.isa,
        "cpu_features": list(info.cpu_features),
        "cpu": platform.processor() or platform.machine(),
    }


def run_meta(peak_start: float, peak_end: float, loadavg_start: list[float]) -> dict:
    """The machine and the peaks and loads around a run: what every results file records."""
    return {
        **machine(),
        "peak_gflops": max(peak_start, peak_end),
        "peak_gflops_start": peak_start,
        "peak_gflops_end": peak_end,
        "loadavg_start": loadavg_start,
        "loadavg_end": loadavg(),
    }


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every weight-format benchmark takes: ``--out``, ``--quick``, ``--reps``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--quick", action="store_true", help="a smaller shape and fewer reps")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions")
    return ap


def write_results(out: Path, stem: str, payload: dict, markdown: Callable[[Path], None]) -> None:
    """``out/stem.json`` from ``payload``, ``out/stem.md`` through ``markdown``; print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    markdown(out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())
