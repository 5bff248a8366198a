"""Subprocess body for test_memory: clean-RSS accounting of wrap and load_pretrained.

Usage: ``python memory_worker.py save|wrap|stream DIR``; prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings

import torch
from transformers import AutoModelForCausalLM

from moe_experts import load_pretrained, wrap
from moe_experts.memory import trim_host_heap
from moe_experts.testing import tiny_config

# Large vocabulary so that the non-expert bytes (embeddings, lm_head) dwarf allocator noise.
SHAPE = {
    "hidden_size": 1024,
    "moe_intermediate_size": 256,
    "num_experts": 16,
    "num_hidden_layers": 2,
    "intermediate_size": 1024,
    "vocab_size": 32000,
    "head_dim": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def rss_mib() -> float:
    """Resident set size of this process from /proc/self/smaps_rollup, in MiB."""
    with open("/proc/self/smaps_rollup") as rollup:
        lines = rollup.readlines()
    for line in lines:
        if line.startswith("Rss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Rss line in /proc/self/smaps_rollup")


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    warnings.simplefilter("ignore")
    if mode == "save":
        torch.manual_seed(0)
        config = tiny_config("qwen3_moe", **SHAPE)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path, max_shard_size="40MB")
        # The warm-up model has the same layer shapes (one layer, small vocabulary): BLAS and
        # oneDNN keep a few MiB of per-shape state after the self-check's first forward.
        warm = {**SHAPE, "num_hidden_layers": 1, "vocab_size": 512}
        tiny = AutoModelForCausalLM.from_config(
            tiny_config("qwen3_moe", **warm), dtype=torch.bfloat16
        )
        tiny.save_pretrained(path + "-tiny")
        return
    # Warm-up on a small model of the same family and layer shapes: every lazy import and
    # one-off allocation happens before the baseline.
    warm = AutoModelForCausalLM.from_pretrained(path + "-tiny", dtype=torch.bfloat16)
    wrap(warm)
    load_pretrained(path + "-tiny")
    del warm
    gc.collect()
    trim_host_heap()
    base = rss_mib()
    if mode == "wrap":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        kernel = wrap(model, weight_dtype="bf16").kernel_bytes
    else:
        model = load_pretrained(path, weight_dtype="bf16", dtype=torch.bfloat16)
        kernel = sum(
            m.expert_weights.nbytes for m in model.modules() if hasattr(m, "expert_weights")
        )
    gc.collect()
    dense = sum(
        t.nbytes
        for t in [*model.parameters(), *model.buffers()]
        if type(t).__name__ != "ExpertPlaceholder"
    )
    print(json.dumps({"base": base, "rss": rss_mib(), "kernel": kernel, "dense": dense}))


if __name__ == "__main__":
    main()
