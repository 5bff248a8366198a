"""Coverage report and gradient check, with one block's experts excluded on purpose."""

import pytest
import torch

from lora_core import LoraConfig
from moe_experts import (
    GradientCheckError,
    Packing,
    adapt_model,
    check_gradients,
    coverage_report,
    coverage_summary,
    router_targets,
)

from .conftest import token_batch


def _adapted(fresh, family: str, exclude: list[str]):
    model = fresh(family)
    dense = ["shared_expert_gate", "gate_proj"] if family == "qwen2_moe" else ["q_proj"]
    cfg = LoraConfig(
        enable=True,
        rank=2,
        init_seed=3,
        exclude_modules=exclude,
        target_modules=dense,
        target_parameters=list(router_targets(model)),
    )
    return model, adapt_model(model, cfg, weight_dtype="fp32")


def test_full_coverage_is_reported(fresh) -> None:
    model, result = _adapted(fresh, "qwen2_moe", [])
    report = coverage_report(model, result)
    assert report.family == "qwen2_moe"
    assert [b.block for b in report.blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for b in report.blocks:
        assert b.routed_experts == ("down_proj", "gate_up_proj")
        assert b.on_kernel
        assert b.router
        assert b.shared_expert_gate
        assert b.shared_experts == ("shared_expert.gate_proj",)
    assert report.untrained_experts == ()
    text = coverage_summary(model, result)
    assert "every block's routed experts are trained" in text
    assert len(text.splitlines()) <= 24
    assert report.packing is Packing.POSITIONS
    assert "packing: several examples per row: transformers builds block-diagonal" in text


def test_a_family_packed_one_example_per_row_says_why_and_what_it_costs(fresh) -> None:
    model, result = _adapted(fresh, "qwen3_next", [])
    report = coverage_report(model, result)
    assert report.packing is Packing.ONE_PER_ROW
    text = coverage_summary(model, result)
    line = next(t for t in text.splitlines() if "packing:" in t)
    assert "packing: one example per row: linear-attention (gated delta net)" in line
    assert "on the chat demo that is 39 rows at 40.1% padding instead of 30 at 22.1%" in line


def test_excluded_block_is_reported_and_summary_warns(fresh) -> None:
    model, result = _adapted(fresh, "qwen2_moe", ["layers.1.mlp.experts"])
    report = coverage_report(model, result)
    first, second = report.blocks
    assert first.routed_experts == ("down_proj", "gate_up_proj")
    assert second.routed_experts == ()
    assert second.on_kernel
    assert second.router
    assert report.untrained_experts == ("model.layers.1.mlp",)
    text = coverage_summary(model, result)
    assert "WARNING routed experts without LoRA: model.layers.1.mlp" in text
    # A family without shared experts or a shared gate shows "-" there.
    model, result = _adapted(fresh, "mixtral", [])
    assert coverage_report(model, result).blocks[0].shared_expert_gate is None


def test_check_gradients_passes_after_a_real_first_backward(fresh) -> None:
    model, result = _adapted(fresh, "qwen2_moe", ["layers.1.mlp.experts"])
    ids = token_batch()
    model(ids, labels=ids).loss.backward()
    # Every B got a gradient; A tensors with B still zero get an all-zero one by construction.
    assert check_gradients(result) == ()
    assert check_gradients(model) == ()


def test_check_gradients_lists_parameters_off_the_forward_path(fresh) -> None:
    model, result = _adapted(fresh, "qwen2_moe", [])
    model.model.layers = model.model.layers[:1]  # layer 1's adapters are never reached
    ids = token_batch()
    model(ids, labels=ids).loss.backward()
    with pytest.raises(GradientCheckError, match="not being trained") as info:
        check_gradients(result)
    msg = str(info.value)
    assert "model.layers.1.mlp.experts.lora.gate_up_lora_b: no gradient" in msg
    assert "model.layers.1.mlp.gate.lora_B.weight: no gradient" in msg
    assert "model.layers.0." not in msg
    with pytest.warns(RuntimeWarning, match="not being trained"):
        problems = check_gradients(result, warn_only=True)
    assert len(problems) == sum(n.startswith("model.layers.1.") for n in result.parameter_names)


def test_check_gradients_flags_non_finite_and_zero(fresh) -> None:
    model, result = _adapted(fresh, "mixtral", [])
    named = dict(result.named_optimizer_parameters)
    ids = token_batch()
    model(ids, labels=ids).loss.backward()
    nan_b = "model.layers.0.mlp.experts.lora.down_lora_b"
    zero_b = "model.layers.1.mlp.experts.lora.down_lora_b"
    named[nan_b].grad[0, 0, 0] = float("nan")
    named[zero_b].grad.zero_()
    with torch.no_grad():
        # A non-zero B makes an all-zero gradient of its A a real problem.
        named["model.layers.1.mlp.experts.lora.gate_up_lora_b"].fill_(0.1)
    with pytest.warns(RuntimeWarning, match="3 of"):
        problems = check_gradients(result, warn_only=True)
    assert f"{nan_b}: non-finite gradient" in problems
    assert f"{zero_b}: gradient is all zeros" in problems
    assert "model.layers.1.mlp.experts.lora.gate_up_lora_a: gradient is all zeros" in problems


def test_check_gradients_pairs_factors_by_owning_module_with_peft(fresh) -> None:
    """PEFT embedding LoRA and an adapter called ``lora_A``, right after initialisation."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        fresh("qwen3_moe"),
        peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]),
        adapter_name="lora_A",
    )
    named = dict(model.named_parameters())
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.lora_A.weight"
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.lora_A.weight"
    emb_a = "base_model.model.model.embed_tokens.lora_embedding_A.lora_A"
    emb_b = "base_model.model.model.embed_tokens.lora_embedding_B.lora_A"
    # PEFT's own initialisation: a linear layer's B and an embedding's A start at zero.
    assert not named[q_b].any()
    assert named[q_a].any()
    assert not named[emb_a].any()
    assert named[emb_b].any()
    ids = token_batch()
    model(ids, labels=ids).loss.backward()
    assert not named[q_a].grad.any()
    assert not named[emb_b].grad.any()
    assert check_gradients(model) == ()
    # Both factors of one adapter at zero can never move: both are reported.
    model.zero_grad()
    with torch.no_grad():
        named[q_a].zero_()
    model(ids, labels=ids).loss.backward()
    with pytest.warns(RuntimeWarning, match="2 of"):
        problems = check_gradients(model, warn_only=True)
    assert problems == (f"{q_a}: gradient is all zeros", f"{q_b}: gradient is all zeros")
