"""Two local ranks under torchrun: summed PSS of the expert storage, shared vs one copy per rank.

A Qwen3-30B-A3B-shaped model (H=2048, I=768, E=128, k=8, vocab 32000; ``--layers`` decoder
layers, 2 by default; ``--quick``: 1 layer, E=16) with random bf16 weights is saved once as
safetensors with per-expert keys, then loaded by ``moe_experts.load_pretrained`` in a
``torchrun --nproc-per-node 2`` job (gloo), twice:

* ``shared`` (the default): local rank 0 reads the experts into one anonymous shared memory
  file (memfd) per block, both ranks map it;
* ``per-rank`` (``MOE_EXPERTS_SHARE_EXPERTS=0``): each rank reads its own copy.

Each rank reads every byte of its expert storage (so every page is resident in both), waits
for the other, then reports the PSS of its kt-kernel storage mappings (``/proc/self/smaps``)
and the growth of its whole-process PSS over its post-import baseline
(``/proc/self/smaps_rollup``) less its dense weights. The sums over the ranks are compared with one copy of the
experts (the kernel's byte count). Target: shared summed PSS of the storage at most 1.15x one
copy. Writes ``bench_shared.json`` and ``bench_shared.md`` under ``--out``.

Usage: ``python bench_shared.py --out DIR [--quick] [--layers N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _common module
from _common import config, rollup_bytes, shape, write_results

VARIANTS = {"shared": "1", "per-rank": "0"}


def _segment_pss() -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and "/memfd:ktk-" in head[5]
            elif inside and line.startswith("Pss:"):
                total += int(head[1]) * 1024
    return total


def rank_main(path: Path, out: Path) -> None:
    """One rank: load, touch every expert byte, measure after both ranks did."""
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import moe_experts

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    dist.barrier()
    base = rollup_bytes("Pss")
    start = time.perf_counter()
    model = moe_experts.load_pretrained(path, weight_dtype="bf16", dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    dense = sum(
        p.nbytes
        for p in [*model.parameters(), *model.buffers()]
        if not moe_experts.is_placeholder(p)
    )
    kernel = 0
    for _, k in moe_experts.experts_sites(model):
        w = k.expert_weights
        kernel += w.nbytes
        for t in (*w.storage[0], *w.storage[1]):
            t.view(-1).view(torch.uint8)[::4096].sum()  # one read per page: all resident
    dist.barrier()
    row = {
        "rank": dist.get_rank(),
        "seconds": seconds,
        "kernel_bytes": kernel,
        "dense_bytes": dense,
        "segment_pss": _segment_pss(),
        "pss_growth": rollup_bytes("Pss") - base,
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def save(path: Path, quick: bool, layers: int) -> None:
    """Write the random checkpoint (per-expert keys, 1 GB shards)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = config(quick, layers)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(
        path, max_shard_size="1GB"
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, path: Path, work: Path) -> dict:
    """Launch the two-rank job for ``variant``; the sums over its ranks."""
    out = work / variant
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MOE_EXPERTS_SHARE_EXPERTS": VARIANTS[variant],
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_port()),
        __file__,
        "--rank-main",
        str(path),
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"{variant} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    one = ranks[0]["kernel_bytes"]
    seg = sum(r["segment_pss"] for r in ranks)
    # Whole-process growth less each rank's own dense weights: the experts plus overheads.
    growth = sum(r["pss_growth"] - r["dense_bytes"] for r in ranks)
    return {
        "variant": variant,
        "one_copy_mib": one / 2**20,
        "segment_pss_mib": seg / 2**20,
        "segment_pss_over_one_copy": seg / one,
        "pss_growth_mib": growth / 2**20,
        "pss_growth_over_one_copy": growth / one,
        "load_seconds": max(r["seconds"] for r in ranks),
    }


def main() -> None:
    """Save once, run both variants, write JSON and a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 2; 1 quick)")
    ap.add_argument("--keep", type=Path, default=None, help="reuse/keep the checkpoint here")
    ap.add_argument("--rank-main", nargs=2, metavar=("PATH", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(Path(args.rank_main[0]), Path(args.rank_main[1]))
        return
    if args.out is None:
        ap.error("--out is required")
    layers = args.layers or (1 if args.quick else 2)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp:
        path = args.keep or Path(tmp) / "model"
        if not (path / "config.json").is_file():
            save(path, args.quick, layers)
        rows = [run_variant(v, path, Path(tmp)) for v in VARIANTS]
    meta = {
        "layers": layers,
        "quick": args.quick,
        "ranks": 2,
        "shape": shape(args.quick),
        "targets": {"shared segment_pss_over_one_copy": 1.15},
    }
    write_results(
        args.out,
        "bench_shared",
        meta,
        rows,
        f"Qwen3-30B-A3B-shaped, {layers} layer(s), bf16 experts, 2 local ranks (torchrun, gloo)",
        [
            "variant",
            "one copy MiB",
            "summed PSS of the shared storage MiB (x one copy)",
            "summed PSS growth less dense MiB (x one copy)",
            "load s",
        ],
        lambda r: [
            r["variant"],
            f"{r['one_copy_mib']:.0f}",
            f"{r['segment_pss_mib']:.0f} ({r['segment_pss_over_one_copy']:.3f})",
            f"{r['pss_growth_mib']:.0f} ({r['pss_growth_over_one_copy']:.3f})",
            f"{r['load_seconds']:.1f}",
        ],
    )


if __name__ == "__main__":
    main()
