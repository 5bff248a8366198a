"""adapters_disabled: every family computes its untouched transformers base, with no LoRA work."""

from __future__ import annotations

import pytest
import torch

import kt_kernel
import moe_experts
from lora_core import LoraConfig, LoRALinear, LoRAParameter
from moe_experts import adapt_model, adapters_disabled, router_targets
from moe_experts.finetune.targets import attention_targets

from .conftest import FAMILIES, token_batch


def _adapted(fresh, family: str):
    model = fresh(family)
    dense = LoraConfig(
        enable=True,
        rank=2,
        alpha=4,
        init_seed=3,
        target_modules=list(attention_targets(model)),
        target_parameters=list(router_targets(model)),
    )
    expert = LoraConfig(enable=True, rank=2, alpha=4, init_seed=3)
    result = adapt_model(
        model,
        expert,
        dense_config=dense,
        weight_dtype="fp32",
        lora_experts=2,
        lora_expert_intermediate=4,
        kernel_attention=False,
    )
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # every B (and le_down) non-zero: the adapters change the output
        for name, p in result.named_optimizer_parameters:
            if name.endswith(("_b", "lora_B.weight", "le_down")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, result


class _Spy:
    """Records the ``lora`` argument of every kernel call (None: the no-LoRA path)."""

    def __init__(self) -> None:
        self.real = kt_kernel.moe_experts_forward
        self.lora: list[object] = []

    def __call__(self, *args, **kwargs):
        self.lora.append(args[4] if len(args) > 4 else kwargs.get("lora"))
        return self.real(*args, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_disabled_model_is_the_transformers_base_without_lora_work(
    fresh, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = fresh(family)
    model, _ = _adapted(fresh, family)
    ids = token_batch()
    spy = _Spy()
    monkeypatch.setattr(kt_kernel, "moe_experts_forward", spy)
    with torch.no_grad():
        want = base(ids).logits
        adapted = model(ids).logits
    assert spy.lora
    assert all(isinstance(b, kt_kernel.LoraBuffers) for b in spy.lora)
    assert (adapted - want).abs().max() > 1e-3  # the adapters really act
    spy.lora.clear()
    calls: list[str] = []
    hooks = [
        m.register_forward_hook(lambda *a, n=n: calls.append(n))
        for n, m in model.named_modules()
        if n.endswith(("lora_A", "lora_B", "lora_experts"))
    ]
    with adapters_disabled(model):
        got = model(ids).logits
    for h in hooks:
        h.remove()
    # The kernel ran without LoRA buffers, no LoRA module ran, and no trainable tensor is in
    # the graph (grad mode is on; only the frozen base was used).
    assert spy.lora
    assert all(b is None for b in spy.lora)
    assert calls == []
    assert not got.requires_grad
    # The same numbers as transformers' own model: kt-kernel's experts within the wrap
    # self-check's tolerance, its attention and RMSNorms within a few fp32 ulp of
    # transformers' (which these tiny random models amplify to about 1.3e-5 in a few logits).
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=5e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, adapted, rtol=0, atol=0)
    switches = [
        m
        for m in model.modules()
        if isinstance(m, (LoRALinear, LoRAParameter, moe_experts.KernelExperts))
    ]
    assert switches
    assert all(m.adapter_enabled for m in switches)


def test_adopted_peft_experts_and_dense_layers_are_switched_off_too(fresh) -> None:
    """A PEFT model adopted by adapt: PEFT's dense layers and the adopted expert LoRA."""
    peft = pytest.importorskip("peft")
    base = fresh("qwen3_moe")
    pm = peft.get_peft_model(
        fresh("qwen3_moe"),
        peft.LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False,  # random B: the adapter changes the output
        ),
    )
    moe_experts.wrap(pm, weight_dtype="fp32")
    moe_experts.adapt(pm, LoraConfig(enable=True, rank=2, alpha=4))
    ids = token_batch()
    with torch.no_grad():
        want = base(ids).logits
        adapted = pm(ids).logits
        assert (adapted - want).abs().max() > 1e-3
        with adapters_disabled(pm):
            torch.testing.assert_close(pm(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pm(ids).logits, adapted, rtol=0, atol=0)
