"""Subprocess body for test_loading_fp8's memory test: peak and final RSS of a FP8 load.

Usage: ``python fp8_memory_worker.py save DIR`` or ``python fp8_memory_worker.py load DIR
WEIGHT_DTYPE``; ``load`` prints one JSON line (MiB and bytes).
"""

from __future__ import annotations

import gc
import json
import sys
import warnings

import torch
from transformers import AutoModelForCausalLM

from moe_experts import load_pretrained
from moe_experts.memory import trim_host_heap
from moe_experts.testing import save_fp8_checkpoint, tiny_config

# Expert-dominated (small vocabulary): 4 layers x 32 experts x 3 x 1024 x 256 = 100.7 MB of
# FP8 experts, 201 MB as a bf16 copy, against about 30 MB of dense weights.
SHAPE = {
    "hidden_size": 1024,
    "moe_intermediate_size": 256,
    "num_experts": 32,
    "num_hidden_layers": 4,
    "intermediate_size": 1024,
    "vocab_size": 512,
    "head_dim": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    warnings.simplefilter("ignore")
    if mode == "save":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", **SHAPE))
        save_fp8_checkpoint(model.to(torch.bfloat16), path, max_shard_size="20MB")
        warm = {**SHAPE, "num_hidden_layers": 1}
        tiny = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", **warm))
        save_fp8_checkpoint(tiny, path + "-tiny")
        return
    weight_dtype = sys.argv[3]
    # Same layer shapes first: lazy imports and one-off allocations happen before the baseline.
    load_pretrained(path + "-tiny", weight_dtype=weight_dtype)  # type: ignore[arg-type]
    gc.collect()
    trim_host_heap()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM (the peak) to the current RSS
    base = _status("VmRSS")
    model = load_pretrained(path, weight_dtype=weight_dtype)  # type: ignore[arg-type]
    peak = _status("VmHWM")
    gc.collect()
    kernels = [m.expert_weights for m in model.modules() if hasattr(m, "expert_weights")]
    dense = sum(
        t.nbytes
        for t in [*model.parameters(), *model.buffers()]
        if type(t).__name__ != "ExpertPlaceholder"
    )
    print(
        json.dumps(
            {
                "base": base,
                "peak": peak,
                "rss": _status("VmRSS"),
                "kernel": sum(k.nbytes for k in kernels),
                "layer_bf16": 2 * sum(p.numel() for p in kernels[0].storage[0][:1])
                + 2 * sum(p.numel() for p in kernels[0].storage[1][:1]),
                "dense": dense,
                "weight_dtype": kernels[0].weight_dtype,
            }
        )
    )


if __name__ == "__main__":
    main()
