"""Benchmark: lora_checkpoint save+verify / load+verify against raw safetensors, same process.

Writes ``bench_checkpoint.json`` and ``bench_checkpoint.md`` to ``--out``. About 1 GB of
adapter tensors (``--quick``: about 100 MB). Each timing is the best of ``--repeats`` runs;
the files stay in the page cache between write and read for both sides alike.

Baselines:
    raw save: ``safetensors.torch.save_file`` (no fsync, no hashing);
    raw save+fsync: the same plus one ``fsync`` (the durability our save also pays);
    raw load: ``safetensors.torch.load_file`` then a clone of every tensor into owned memory
        (what ``lora_checkpoint.load`` returns; ``load_file`` alone only maps the file).
Ours: ``save`` (a BLAKE3 digest of every file and of every tensor, fsync of every file and
directory, atomic publish) and ``load(verify=True)`` (every file's BLAKE3 digest checked,
on the very bytes the returned tensors hold).

The report records the load average before and after (the machine may be shared) and
whether blake3's thread pool was used beside the I/O (only with more than 2 cores).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import torch
from safetensors.torch import load_file, save_file

import lora_checkpoint as lc
from lora_checkpoint._digest import pool_pays
from lora_core.contracts import AdaptationResult, ComponentVersion, PeftExport


def make_result(total_bytes: int) -> AdaptationResult:
    """Expert-LoRA-like tensors ``[E, r, H]`` (fp32 and bf16) totalling ``total_bytes``."""
    e, r, h = 8, 16, 4096  # 2 MiB per fp32 tensor
    params = []
    size = 0
    i = 0
    while size < total_bytes:
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        t = torch.randn(e, r, h).to(dtype)
        params.append((f"layers.{i}.experts.lora_A", torch.nn.Parameter(t)))
        size += t.numel() * t.element_size()
        i += 1
    exports = {
        n: PeftExport(f"base_model.model.{n}.weight")
        for j, (n, _) in enumerate(params)
        if j % 2 == 0
    }
    return AdaptationResult.create(
        adapted_layers=[n for n, _ in params],
        named_optimizer_parameters=params,
        ownership={n: "replicated" for n, _ in params},
        producer=ComponentVersion("lora-core", "0.1.0"),
        peft_exports=exports,
    )


def _malloc_trim() -> Callable[[int], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def best_interleaved(
    fns: dict, repeats: int, trim: bool, before: Callable[[], None] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """Best and median wall time per function over ``repeats`` rounds, alternating them.

    Each round starts with a different function (the order rotates), so no side always runs
    right after the others' writes: the shared VM disk throttles bursts, and a fixed order
    made whoever came third pay for the two before it. ``before`` (untimed) runs ahead of
    every call, e.g. to delete the previous round's files so the disk fills no further.
    ``os.sync()`` before every call (untimed) starts each from an empty dirty-page cache, so
    one side never pays the writeback the other side left behind; the machine is shared.
    With ``trim``, ``malloc_trim(0)`` before every call (untimed) hands the memory the last
    call freed back to the system, so no call finds it waiting in the heap: otherwise which
    side reuses freed memory and which page-faults fresh memory (about 1.5 us per 4 KiB page
    here, 0.4 s per GB) depends on the order of the calls, not on the code.
    """
    trimmer = _malloc_trim() if trim else None
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for k in range(repeats):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            if before is not None:
                before()
            os.sync()
            if trimmer is not None:
                trimmer(0)
            t0 = time.perf_counter()
            fns[name](k)
            times[name].append(time.perf_counter() - t0)
    best = {name: min(v) for name, v in times.items()}
    median = {name: statistics.median(v) for name, v in times.items()}
    return best, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quick", action="store_true", help="about 100 MB instead of 1 GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: tmp)")
    parser.add_argument(
        "--no-trim",
        action="store_true",
        help="skip malloc_trim(0) before each call (the method of lora-checkpoint 0.1.0)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = (100 if args.quick else 1024) * 1024 * 1024
    result = make_result(total)
    tensors = {n: p.detach() for n, p in result.named_optimizer_parameters}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.workdir))
    try:

        def raw_save(k: int) -> None:
            save_file(tensors, work / f"raw{k}.safetensors")

        def raw_save_fsync(k: int) -> None:
            path = work / f"rawf{k}.safetensors"
            save_file(tensors, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        def ours_save(k: int) -> None:
            lc.save(work / "ours", result, step=k)

        def raw_load(k: int) -> None:
            loaded = load_file(work / "raw0.safetensors")
            [t.clone() for t in loaded.values()]

        def raw_load_mapped(k: int) -> None:
            load_file(work / "raw0.safetensors")

        def ours_load(k: int) -> None:
            loaded = lc.load(work / "ours" / "step-00000000", verify=True)
            if len(loaded.tensors) != len(tensors):
                raise RuntimeError("benchmark load lost tensors")

        def drop_later_rounds() -> None:
            # Round 0's files are what the loads read; later rounds' only fill the disk.
            for path in work.glob("raw*.safetensors"):
                if path.stem not in ("raw0", "rawf0"):
                    path.unlink()
            for path in (work / "ours").glob("step-*"):
                if path.name != "step-00000000":
                    shutil.rmtree(path)

        timings, medians = best_interleaved(
            {"raw_save": raw_save, "raw_save_fsync": raw_save_fsync, "ours_save_verify": ours_save},
            args.repeats,
            trim=not args.no_trim,
            before=drop_later_rounds,
        )
        load_best, load_median = best_interleaved(
            {
                "raw_load": raw_load,
                "raw_load_mapped_only": raw_load_mapped,
                "ours_load_verify": ours_load,
            },
            args.repeats,
            trim=not args.no_trim,
        )
        timings.update(load_best)
        medians.update(load_median)
        check = lc.load(work / "ours" / "step-00000000")
        for n, t in tensors.items():
            if not torch.equal(check.tensors[n], t):
                raise RuntimeError(f"round trip changed {n}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gbps = {k: nbytes / v / 1e9 for k, v in timings.items()}
    pairs = {
        "save_vs_raw": ("raw_save", "ours_save_verify"),
        "save_vs_raw_fsync": ("raw_save_fsync", "ours_save_verify"),
        "load_vs_raw": ("raw_load", "ours_load_verify"),
    }
    ratios = {k: timings[raw] / timings[ours] for k, (raw, ours) in pairs.items()}
    median_ratios = {k: medians[raw] / medians[ours] for k, (raw, ours) in pairs.items()}
    load_after = os.getloadavg()
    pool = pool_pays(nbytes, beside_io=True)
    report = {
        "benchmark": "lora-checkpoint save/load vs raw safetensors",
        "digest_algorithm": "blake3",
        "blake3": blake3.__version__,
        "blake3_pool_beside_io": pool,
        "quick": args.quick,
        "bytes": nbytes,
        "tensors": len(tensors),
        "repeats": args.repeats,
        "malloc_trim_before_each_call": not args.no_trim,
        "seconds": timings,
        "median_seconds": medians,
        "GB_per_s": gbps,
        "throughput_ratio_ours_over_raw": ratios,
        "median_throughput_ratio_ours_over_raw": median_ratios,
        "target_ratio": 0.7,
        "torch": torch.__version__,
        "lora_checkpoint": lc.__version__,
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "machine": platform.machine(),
    }
    (args.out / "bench_checkpoint.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# lora-checkpoint benchmark ({nbytes / 2**20:.0f} MiB, {len(tensors)} tensors, "
        f"best of {args.repeats}, interleaved, os.sync()"
        f"{'' if args.no_trim else ' and malloc_trim(0)'} before each)",
        "",
        f"digests: BLAKE3 (blake3 {blake3.__version__}; thread pool beside the I/O: "
        f"{'yes' if pool else 'no'})",
        "",
        f"load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f} on "
        f"{os.cpu_count()} cores; workdir {args.workdir or tempfile.gettempdir()}",
        "",
        "| operation | best s | GB/s | median s |",
        "|---|---:|---:|---:|",
        *[f"| {k} | {v:.3f} | {gbps[k]:.2f} | {medians[k]:.3f} |" for k, v in timings.items()],
        "",
        "| ratio (throughput ours / raw; target >= 0.7) | best | median |",
        "|---|---:|---:|",
        *[f"| {k} | {v:.2f} | {median_ratios[k]:.2f} |" for k, v in ratios.items()],
        "",
    ]
    (args.out / "bench_checkpoint.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
