"""A tiny expert-LoRA fine-tune on an INT4 and on an FP8-block base tracks the bf16 base.

The same tiny Qwen3-MoE (built from a local config, saved and loaded back) is wrapped three
times, with ``weight_dtype="bf16"``, ``"int4"`` and ``"fp8"``; expert LoRA is trained with
AdamW (lr 3e-3) for 30 steps on one fixed 8x32 batch of random tokens (final loss ~0.8,
far from 0, so a relative comparison is meaningful). The quantised bases differ from the
bf16 one by their quantisation error only, so their final loss must be within 5% of bf16's
(and every run must really learn: final loss well below the initial one).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from lora_core import LoraConfig
from moe_experts import adapt, experts_sites, wrap
from moe_experts.testing import tiny_config

STEPS = 30
CFG = LoraConfig(enable=True, rank=8, alpha=16, init_seed=11)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory: pytest.TempPathFactory):
    """A Qwen3-MoE with H = I = 64 (one INT4 group per row of down), saved to a temp dir."""
    torch.manual_seed(4321)
    config = tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-64")
    model.save_pretrained(path)
    return path


def _finetune(path, weight_dtype: str) -> tuple[float, float, int]:
    """(first loss, final loss, expert kernel bytes) of a 30-step AdamW run on ``weight_dtype``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    report = wrap(model, weight_dtype=weight_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    result = adapt(model, CFG)
    opt = torch.optim.AdamW(list(result.parameters()), lr=3e-3)
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=gen)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    kernels = [k for _, k in experts_sites(model)]
    assert all(k.expert_weights.weight_dtype == weight_dtype for k in kernels)
    return losses[0], losses[-1], report.kernel_bytes


def test_int4_and_fp8_bases_reach_the_bf16_loss(saved_model) -> None:
    first16, final16, bytes16 = _finetune(saved_model, "bf16")
    assert final16 < 0.8 * first16  # the run learns, so the comparison means something
    for wd, max_ratio in (("int4", 0.30), ("fp8", 0.52)):
        first, final, nbytes = _finetune(saved_model, wd)
        assert final < 0.8 * first, wd
        assert abs(final - final16) <= 0.05 * final16, (wd, final, final16)
        assert nbytes <= max_ratio * bytes16, (wd, nbytes, bytes16)
