"""One timed child of ``bench_upstream.py`` for KTransformers' own kernel (PyPI ``kt-kernel``).

Runs in upstream's virtual environment, never in ours: both packages are imported as
``kt_kernel``. It imports only torch, safetensors and upstream's ``kt_kernel.sft`` (nothing
of ours, not even ``_timing``), and only calls upstream's public wrapper.

Usage: ``python _upstream_child.py INPUTS.safetensors RESULT.json --reps N [--save OUT]``.
Loads the shared inputs, hands the bf16 weights and the rank-16 LoRA to
``AMXSFTMoEWrapper(method="AMXBF16_SFT")`` (on a CPU without AMX upstream's loader picks its
AVX-512-BF16 build, ``kt_kernel.__cpu_variant__``), runs one warm-up forward+backward
(saved to ``OUT`` when given), then ``N`` timed ones; writes wall ms, process CPU seconds and
peak RSS as JSON to ``RESULT.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from kt_kernel.sft.amx import AMXSFTMoEWrapper
from safetensors.torch import load_file, save_file

import kt_kernel

THREADS = 2
LORA_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def build(inp: dict[str, torch.Tensor], meta: dict) -> tuple[AMXSFTMoEWrapper, dict]:
    """Upstream's SFT wrapper holding the inputs' weights and LoRA; returns it and its grads."""
    e, h, i, k, r = (meta[n] for n in ("E", "H", "I", "k", "r"))
    tokens = inp["x"].shape[0]
    moe = AMXSFTMoEWrapper(
        layer_idx=0,
        num_experts=e,
        num_experts_per_tok=k,
        hidden_size=h,
        moe_intermediate_size=i,
        num_gpu_experts=0,
        cpuinfer_threads=THREADS,
        threadpool_count=1,  # one NUMA node: one subpool of THREADS workers
        weight_path="",
        chunked_prefill_size=tokens,
        lora_rank=r,
        lora_alpha=float(meta["alpha"]),  # scaling alpha / r, as ours
        method="AMXBF16_SFT",
    )
    # Our fused gate_up [E, 2I, H] holds gate rows first; upstream takes gate and up apart.
    gate_up = inp.pop("gate_up")
    moe.load_weights_from_tensors(
        gate_up[:, :i].contiguous(),
        gate_up[:, i:].contiguous(),
        inp.pop("down"),
        torch.arange(e, dtype=torch.int64),
    )
    del gate_up
    lora = {n: inp.pop(n).contiguous() for n in LORA_NAMES}
    grads = {n: torch.zeros_like(t) for n, t in lora.items()}
    moe.init_lora_weights(**lora, **{"grad_" + n: g for n, g in grads.items()})
    moe._bench_keep = lora  # the C++ side keeps raw pointers to these tensors
    return moe, grads


def step(moe: AMXSFTMoEWrapper, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One forward (saving for backward) and backward; returns y, dx and the routing grads."""
    y = moe.forward(inp["x"], inp["ids"], inp["w"], save_for_backward=True)
    dx, dw = moe.backward(inp["dy"])
    return {"y": y, "dx": dx, "dw": dw}


def main() -> None:
    """Load, warm up, time; write the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)  # the input/output copies around upstream's tasks
    # Own copies: a tensor of load_file's keeps the whole file's mapping (and its touched
    # pages, counted in RSS) alive; the copies of the weights are freed once loaded.
    inp = {n: t.clone() for n, t in load_file(str(args.inputs)).items()}
    meta = json.loads((args.inputs.with_suffix(".json")).read_text())
    moe, grads = build(inp, meta)
    gc.collect()
    rss_setup = status_bytes("VmRSS")
    # Reset the high-water mark so peak RSS covers the steps (weights are already held).
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    out = step(moe, inp)  # warm-up: thread pool, scratch buffers, first-touch pages
    if args.save is not None:
        out.update({"d_" + n: g.clone() for n, g in grads.items()})
        save_file({n: t.contiguous() for n, t in out.items()}, str(args.save))
    walls, cpus = [], []
    for _ in range(args.reps):
        c0, t0 = time.process_time(), time.perf_counter()
        step(moe, inp)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    result = {
        "impl": "upstream",
        "version": kt_kernel.__version__,
        "module": kt_kernel.__file__,  # upstream's package, not ours
        "cpu_variant": kt_kernel.__cpu_variant__,
        "method": moe.method,
        "threads": THREADS,
        "reps": args.reps,
        "wall_ms": statistics.median(walls) * 1e3,
        "wall_ms_all": [w * 1e3 for w in walls],
        "cpu_s": statistics.median(cpus),
        "cpu_s_all": cpus,
        "rss_setup_bytes": rss_setup,
        "peak_rss_bytes": status_bytes("VmHWM"),
    }
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
