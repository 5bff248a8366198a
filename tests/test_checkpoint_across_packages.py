"""moe-experts adapters (dense, router, expert) through lora-checkpoint: restore in place, and
PEFT reads them exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import lora_checkpoint
from lora_core import LoraConfig
from moe_experts import adapt_model

CONFIG = LoraConfig(
    enable=True,
    rank=4,
    alpha=8,
    init_seed=3,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    target_parameters=["mlp.gate.weight"],
)
# Our fp32 kernel and transformers' eager experts sum the same products in another order;
# across two decoder layers that stays within a few float32 ulps of logits of size ~1.
LOGITS_ATOL = 2e-5


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-moe")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _adapted(base_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return model, adapt_model(model, CONFIG, weight_dtype="fp32")


def _perturb(result) -> None:
    # B starts at zero; give every adapter a non-zero value so the comparison means something.
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in result.named_optimizer_parameters:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


IDS = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50]])


@pytest.mark.timeout(180)
def test_restore_reproduces_logits_and_keeps_parameter_objects(
    base_dir: Path, tmp_path: Path
) -> None:
    model, result = _adapted(base_dir)
    _perturb(result)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    manifest = lora_checkpoint.save(tmp_path, result, step=1)
    assert manifest.world_size == 1

    fresh, fresh_result = _adapted(base_dir)
    before = dict(fresh_result.named_optimizer_parameters)
    lora_checkpoint.restore(fresh_result, lora_checkpoint.load(tmp_path))
    for n, p in fresh_result.named_optimizer_parameters:
        assert p is before[n]
    with torch.no_grad():
        got = fresh(input_ids=IDS).logits
    assert torch.equal(got, expected)


@pytest.mark.timeout(180)
def test_peft_loads_dense_router_and_expert_adapters(base_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    model, result = _adapted(base_dir)
    _perturb(result)
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
    lora_checkpoint.save(tmp_path, result, step=1, base_model_name_or_path=str(base_dir))
    ckpt = lora_checkpoint.resolve_checkpoint(tmp_path)

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=IDS).logits
    peft_model = PeftModel.from_pretrained(base, ckpt)
    assert sorted(peft_model.peft_config["default"].target_parameters) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "mlp.gate.weight",
    ]
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS).logits
    assert not torch.allclose(plain, ours, atol=1e-3)  # the adapters matter
    torch.testing.assert_close(theirs, ours, atol=LOGITS_ATOL, rtol=0)
