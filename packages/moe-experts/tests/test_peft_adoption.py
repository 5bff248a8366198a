"""PEFT target_parameters LoRA applied first is adopted: same outputs, shared memory."""

import os

import peft
import pytest
import torch
from safetensors.torch import load_file

from lora_core import LoraConfig
from lora_core.contracts import PeftTensorLayout
from moe_experts import adapt, experts_sites, wrap

from .conftest import token_batch

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _peft_model(fresh, family: str, targets=TARGETS):
    pm = peft.get_peft_model(
        fresh(family),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=targets),
    )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pm


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.timeout(60)
# gpt_oss: transposed, interleaved experts with biases (PEFT's B rows follow the stored order).
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_adopted_peft_matches_peft_and_shares_memory(fresh, family: str) -> None:
    pm = _peft_model(fresh, family)
    ids = token_batch()
    ref = pm(ids, labels=ids)
    ref.loss.backward()
    ref_grads = _grads(pm)
    pm.zero_grad(set_to_none=True)
    trainable_before = {n: p for n, p in pm.named_parameters() if p.requires_grad}

    report = wrap(pm, weight_dtype="fp32")
    assert report.adopted_peft == report.wrapped_blocks
    assert report.wrapped_blocks
    out = pm(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    for n, g in _grads(pm).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)

    result = adapt(pm, LoraConfig(enable=True, rank=2, alpha=4))
    # PEFT's own Parameter objects are the optimizer parameters (no second copy).
    assert dict(result.named_optimizer_parameters) == trainable_before
    assert all(e.layout is PeftTensorLayout.IDENTITY for e in result.peft_exports.values())
    assert result.peft_target_parameters == tuple(sorted(TARGETS))

    # The kernel's buffers are views of PEFT's storage: a step on PEFT's params moves them.
    site, kernel = experts_sites(pm)[0]
    lora = kernel.kernel_lora
    name_a = f"{site.experts_name}.base_layer.lora_A.default.weight"
    peft_a = trainable_before[name_a]
    assert lora.gate_up_lora_a.data_ptr() == peft_a.data_ptr()
    peft_b = trainable_before[f"{site.experts_name}.lora_B.default.weight"]
    assert lora.down_lora_b.data_ptr() == peft_b.data_ptr()
    before = lora.gate_up_lora_a.detach().clone()
    torch.optim.SGD(list(trainable_before.values()), lr=0.1).step()
    assert (lora.gate_up_lora_a - before).abs().max() > 0
    torch.testing.assert_close(lora.gate_up_lora_a.reshape(peft_a.shape), peft_a, rtol=0, atol=0)
    # The PEFT model keeps working: disabling the adapter gives the base model.
    with pm.disable_adapter(), torch.no_grad():
        base_logits = pm(ids).logits
    plain = fresh(family)
    with torch.no_grad():
        torch.testing.assert_close(base_logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
def test_adopted_peft_saves_its_own_keys(fresh, tmp_path) -> None:
    pm = _peft_model(fresh, "mixtral", targets=["mlp.experts.down_proj"])
    ids = token_batch()
    with torch.no_grad():
        ref = pm(ids).logits
    wrap(pm, weight_dtype="fp32")
    with torch.no_grad():
        torch.testing.assert_close(pm(ids).logits, ref, rtol=1e-5, atol=1e-5)
    result = adapt(pm, LoraConfig(enable=True, rank=2, alpha=4))
    pm.save_pretrained(tmp_path)
    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(e.key for e in result.peft_exports.values())
    for fqn, p in result.named_optimizer_parameters:
        torch.testing.assert_close(saved[result.peft_exports[fqn].key], p.detach())


def test_adoption_refuses_mixed_ranks(fresh) -> None:
    from moe_experts import WrapError

    pm = peft.get_peft_model(
        fresh("olmoe"),
        peft.LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=[],
            target_parameters=TARGETS,
            rank_pattern={"down_proj": 4},
        ),
    )
    ids = token_batch()
    with torch.no_grad():
        before = pm(ids).logits
    with pytest.raises(WrapError, match="one rank and alpha"):
        wrap(pm, weight_dtype="fp32")
    with torch.no_grad():  # the refused block was left exactly as PEFT built it
        torch.testing.assert_close(pm(ids).logits, before, rtol=0, atol=0)
