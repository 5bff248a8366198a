"""The fine-tune loop's chunked loss against the full-logits loss.

For every supported family the chunked path (hidden state and head weight, a chunk of rows at
a time) must give the loss and the gradients of ``cross_entropy(model(...).logits)``; on
adapted models (a few families: adapting is the slow part) every LoRA gradient, attention,
router, expert and ``lm_head`` LoRA alike. Families that transform their logits after the head
must be refused by ``full_logits_reason`` (then both modes run the same code).
"""

from __future__ import annotations

import pytest
import torch

import moe_experts
from moe_experts.finetune.config import FinetuneArgs, lora_config
from moe_experts.finetune.data import IGNORE_INDEX, Batch
from moe_experts.finetune.loss import full_logits_reason, head_weight, token_loss_sum
from moe_experts.testing import TINY_FAMILIES, tiny_model

# Families whose logits are not lm_head(hidden): Granite divides by logits_scaling (chunked
# when it is 1.0), Cohere2 multiplies by logit_scale, Mistral Large 4 soft-caps them.
TRANSFORMED = {"cohere2_moe": "logit_scale", "mistral_large4": "final_logit_softcapping"}


def _batch(vocab: int, rows: int = 2, length: int = 12, shares_rows: bool = True) -> Batch:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, min(vocab, 200), (rows, length), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :4] = IGNORE_INDEX  # a masked prompt
    # Two packed examples in row 1 (where the family shares rows): positions restart, no
    # target across the boundary.
    positions = torch.arange(length).repeat(rows, 1)
    if shares_rows:
        positions[1, 6:] = torch.arange(length - 6)
        labels[1, 5] = IGNORE_INDEX
    return Batch(ids, labels, positions)


def _close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    # fp32 sums in another order: off by ~1e-7 of the tensor's largest entry (gated-delta
    # linear attention amplifies that to a few 1e-7), far below any real disagreement.
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-6 * max(scale, 1.0), msg=name)


def _adapted(family: str) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    model = tiny_model(family)
    model.train()
    lora = lora_config(FinetuneArgs())
    lora = lora.model_copy(update={"target_parameters": moe_experts.router_targets(model)})
    result = moe_experts.adapt_model(model, lora, weight_dtype="fp32")
    # Non-zero B everywhere, so every A gets a gradient too.
    with torch.no_grad():
        for _, p in result.named_optimizer_parameters:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model, result


def _loss_and_grads(
    model: torch.nn.Module, result: object, batch: Batch, mode: str
) -> tuple[float, dict[str, torch.Tensor]]:
    for p in result.parameters():
        p.grad = None
    loss = token_loss_sum(model, batch, mode)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in result.named_optimizer_parameters}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_chunked_loss_and_gradients_equal_full_logits(family: str) -> None:
    torch.manual_seed(0)
    model = tiny_model(family)
    model.eval()  # deterministic routing (PhiMoE's sparsemixer samples in training mode)
    reason = full_logits_reason(model)
    if family in TRANSFORMED:
        assert reason is not None
        assert TRANSFORMED[family] in reason
    else:
        assert reason is None, reason
    shares = moe_experts.find_architecture(model).packing.shares_rows
    batch = _batch(model.config.get_text_config().vocab_size, shares_rows=shares)
    grads = {}
    losses = {}
    for mode in ("full", "chunked"):
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, batch, mode)
        loss.backward()
        losses[mode] = float(loss.detach())
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert losses["chunked"] == pytest.approx(losses["full"], rel=1e-5)
    assert grads["chunked"].keys() == grads["full"].keys()
    assert any("lm_head" in n for n in grads["full"])
    for name, g in grads["full"].items():
        _close(grads["chunked"][name], g, name)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "granitemoe"])
def test_chunked_loss_and_lora_gradients_equal_full_logits(family: str) -> None:
    model, result = _adapted(family)
    assert full_logits_reason(model) is None
    assert any(n.startswith("lm_head.lora_B") for n in result.parameter_names)
    batch = _batch(model.config.get_text_config().vocab_size)
    full_loss, full_grads = _loss_and_grads(model, result, batch, "full")
    chunked_loss, chunked_grads = _loss_and_grads(model, result, batch, "chunked")
    assert chunked_loss == pytest.approx(full_loss, rel=1e-5)
    assert full_grads.keys() == chunked_grads.keys()
    for name, g in full_grads.items():
        assert g.abs().max() > 0, f"{name}: no gradient reached it"
        _close(chunked_grads[name], g, name)


def test_chunked_eval_loss_without_grad_equals_full() -> None:
    model, _ = _adapted("qwen3_moe")
    batch = _batch(model.config.vocab_size)
    model.eval()
    with torch.no_grad():
        full = token_loss_sum(model, batch, "full")
        chunked = token_loss_sum(model, batch, "chunked")
    assert float(chunked) == pytest.approx(float(full), rel=1e-5)
    # the head is back in place after the call (it is only taken out during the forward)
    assert type(model.lm_head).__name__ == "LoRALinear"


def test_head_weight_is_the_adapted_lm_head() -> None:
    model, _ = _adapted("qwen3_moe")
    h = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(
        h @ head_weight(model.lm_head).t(), model.lm_head(h), rtol=1e-5, atol=1e-6
    )


def test_logit_transforms_and_odd_heads_fall_back() -> None:
    model, _ = _adapted("qwen3_moe")
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0" in full_logits_reason(model)
    model.config.final_logit_softcapping = None
    model.lm_head.dropout = torch.nn.Dropout(0.1)
    assert "dropout" in full_logits_reason(model)
    model.eval()  # dropout is off in eval: the head is foldable again
    assert full_logits_reason(model) is None
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)
    assert "bias" in full_logits_reason(model)
    with pytest.raises(ValueError, match="'chunky'"):
        token_loss_sum(model, _batch(model.config.vocab_size), "chunky")
