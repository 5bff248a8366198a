"""Tiny LoRA training loop for the resume test.

``resume_train.py resume ROOT N OUT`` loads the checkpoint under ROOT, restores adapter, optimizer
and RNG state, trains up to step N and writes the adapter tensors to OUT (safetensors).
The test process imports this file to run the uninterrupted and the first-half runs.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

import lora_checkpoint as lc
from lora_core import LoraConfig, enable_lora_training
from lora_core.contracts import AdaptationResult


def build() -> tuple[nn.Module, AdaptationResult, torch.optim.Optimizer]:
    """The same model, adapters and optimizer in every process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    cfg = LoraConfig(
        enable=True, rank=4, alpha=8, target_modules=("0", "2"), dropout=0.1, init_seed=3
    )
    result = enable_lora_training(model, cfg)
    opt = torch.optim.AdamW(result.parameters(), lr=1e-2, weight_decay=0.01)
    return model, result, opt


def seed_fresh_run() -> None:
    """Seeds of a run that starts from step 0."""
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """Steps ``start..stop-1``; data, dropout and noise all draw from the global RNGs."""
    model.train()
    for _ in range(start, stop):
        x = torch.randn(8, 16)
        noise = torch.from_numpy(np.random.standard_normal((8, 8)).astype(np.float32))
        scale = 1.0 + random.random()
        loss = ((model(x) - noise * scale) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def adapter_tensors(result: AdaptationResult) -> dict[str, torch.Tensor]:
    """Copies of the adapter parameters."""
    return {n: p.detach().clone() for n, p in result.named_optimizer_parameters}


def main() -> None:
    mode, root, stop, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if mode != "resume":
        raise SystemExit(f"unknown mode {mode!r}")
    model, result, opt = build()
    loaded = lc.load(root)
    lc.restore(result, loaded)
    loaded.training_state.apply(opt, result)
    train(model, opt, loaded.training_state.step, stop)
    save_file(adapter_tensors(result), out)


if __name__ == "__main__":
    main()
