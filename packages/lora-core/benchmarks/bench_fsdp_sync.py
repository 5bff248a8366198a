"""Bucketed LoRA gradient sync against one all-reduce per parameter, 2 gloo ranks on CPU.

``python bench_fsdp_sync.py --out DIR [--quick]`` starts two ranks of itself (127.0.0.1
only), builds 200 LoRA parameters of mixed sizes as replicated DTensors on a 1-D mesh, and
times, in the same processes and interleaved, (a) the baseline: one ``all_reduce`` per
parameter gradient plus a division, and (b) ``lora_core.fsdp.sync_replicated_lora_gradients``.
Both must give the same gradients. Writes ``DIR/bench_fsdp_sync.json`` and
``DIR/bench_fsdp_sync.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

N_PARAMS = 200
RANK = 16
WORLD = 2


def _sizes(quick: bool) -> list[tuple[int, int]]:
    """200 LoRA shapes: A ``[r, in]`` and B ``[out, r]`` for 100 layers of mixed widths."""
    widths = [128, 256, 512, 1024] if quick else [256, 512, 1024, 2048, 4096]
    shapes: list[tuple[int, int]] = []
    for i in range(N_PARAMS // 2):
        d_in = widths[i % len(widths)]
        d_out = widths[(i * 3 + 1) % len(widths)]
        shapes += [(RANK, d_in), (d_out, RANK)]
    return shapes


def _worker(out: Path, quick: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from lora_core.fsdp import SyncStats, sync_replicated_lora_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(rank)
    params = []
    grads = []
    for i, shape in enumerate(_sizes(quick)):
        p = nn.Parameter(
            DTensor.from_local(torch.zeros(shape), mesh, [Replicate()], run_check=False)
        )
        params.append((f"layers.{i // 2:03d}.proj.lora_{'AB'[i % 2]}.weight", p))
        grads.append(torch.randn(shape, generator=gen))

    def set_grads() -> None:
        for (_, p), g in zip(params, grads, strict=True):
            p.grad = DTensor.from_local(g.clone(), mesh, [Replicate()], run_check=False)

    def baseline() -> int:
        n = 0
        for _, p in sorted(params, key=lambda item: item[0]):
            local = p.grad.to_local()
            dist.all_reduce(local, group=mesh.get_group(0))
            local.div_(WORLD)
            n += 1
        return n

    last: list[SyncStats] = []

    def bucketed() -> int:
        stats = SyncStats()
        sync_replicated_lora_gradients(params, stats=stats)
        last[:] = [stats]
        return stats.collectives

    # Correctness first: both give the same averaged gradients.
    set_grads()
    baseline()
    ref = [p.grad.to_local().clone() for _, p in params]
    set_grads()
    bucketed()
    for (name, p), r in zip(params, ref, strict=True):
        if not torch.allclose(p.grad.to_local(), r, rtol=1e-6, atol=1e-7):
            raise RuntimeError(f"bucketed and baseline gradients differ for {name}")

    iters, warmup = (8, 2) if quick else (30, 5)
    times: dict[str, list[float]] = {"baseline": [], "bucketed": []}
    collectives: dict[str, int] = {}
    for it in range(warmup + iters):
        for kind, fn in (("baseline", baseline), ("bucketed", bucketed)):
            set_grads()
            dist.barrier()
            t0 = time.perf_counter()
            collectives[kind] = fn()
            elapsed = time.perf_counter() - t0
            if it >= warmup:
                times[kind].append(elapsed)
    # Rank 0 reports the slower rank's view of each iteration: a collective ends for all.
    mine = torch.tensor([times["baseline"], times["bucketed"]], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        base_ms = statistics.median(mine[0].tolist()) * 1e3
        buck_ms = statistics.median(mine[1].tolist()) * 1e3
        total_bytes = sum(g.numel() * g.element_size() for g in grads)
        result: dict[str, Any] = {
            "benchmark": "bench_fsdp_sync",
            "quick": quick,
            "world_size": WORLD,
            "backend": "gloo",
            "parameters": len(params),
            "gradient_bytes": total_bytes,
            "iterations": iters,
            "baseline": {"collectives": collectives["baseline"], "median_ms": base_ms},
            "bucketed": {
                "collectives": collectives["bucketed"],
                "buckets": last[0].buckets,
                "median_ms": buck_ms,
            },
            "collective_ratio": collectives["baseline"] / collectives["bucketed"],
            "speedup": base_ms / buck_ms,
            "torch": torch.__version__,
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_fsdp_sync.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "bench_fsdp_sync.md").write_text(_table(result))
        print(_table(result))
    dist.destroy_process_group()


def _table(r: dict[str, Any]) -> str:
    mib = r["gradient_bytes"] / 2**20
    return (
        f"### LoRA gradient sync: {r['parameters']} parameters ({mib:.1f} MiB fp32), "
        f"{r['world_size']} {r['backend']} ranks{' (quick)' if r['quick'] else ''}\n\n"
        "| method | collectives | median ms | ratio vs baseline |\n"
        "|---|---:|---:|---:|\n"
        f"| per-parameter all_reduce (baseline) | {r['baseline']['collectives']} | "
        f"{r['baseline']['median_ms']:.2f} | 1.00x |\n"
        f"| sync_replicated_lora_gradients ({r['bucketed']['buckets']} bucket(s) + "
        f"fingerprint) | {r['bucketed']['collectives']} | {r['bucketed']['median_ms']:.2f} | "
        f"{r['speedup']:.2f}x faster |\n\n"
        f"{r['collective_ratio']:.0f}x fewer collectives.\n"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    """Start the two ranks (or be one of them with ``--rank-worker``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        _worker(args.out, args.quick)
        return 0
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        if sys.platform.startswith("linux"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        cmd = [sys.executable, __file__, "--out", str(args.out), "--rank-worker"]
        procs.append(subprocess.Popen(cmd + (["--quick"] if args.quick else []), env=env))
    deadline = time.monotonic() + (300 if args.quick else 900)
    rc = 0
    for p in procs:
        try:
            rc |= p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = 1
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return rc


if __name__ == "__main__":
    sys.exit(main())
