"""kt-kernel's causal attention inside a model: same loss and LoRA gradients as SDPA.

A tiny Qwen3-MoE is adapted twice from the same weights, once switched to ``"kt_causal"`` (the
default of ``adapt_model`` on the CPU) and once kept on SDPA; the kernel path must actually
run (counted), and calls that are not plain causal (a padding mask) must fall back to SDPA.
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel
import moe_experts
from lora_core import LoraConfig
from moe_experts.testing import tiny_model

from .conftest import FAMILIES

CFG = LoraConfig(
    enable=True,
    rank=4,
    alpha=8,
    init_seed=5,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of kt_kernel.causal_attention (the op still runs)."""
    calls: list[int] = []
    real = kt_kernel.causal_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kt_kernel, "causal_attention", counted)
    return calls


def _adapted(dtype: torch.dtype, kernel: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = (
        tiny_model(
            "qwen3_moe", num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=64
        )
        .to(torch.bfloat16)
        .to(dtype)
    )
    model.config._attn_implementation = "sdpa"
    moe_experts.adapt_model(
        model,
        CFG,
        weight_dtype="fp32" if dtype == torch.float32 else "bf16",
        kernel_attention=kernel,
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-zero B (bf16 values in both dtypes) so A's gradients are not 0
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_b" in name.lower():
                p.copy_((0.1 * torch.randn(p.shape, generator=g)).bfloat16())
    return model


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict]:
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


def test_loss_and_lora_gradients_match_sdpa(kernel_calls: list[int]) -> None:
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in (True, False):
            model = _adapted(dtype, kernel)
            want = moe_experts.KERNEL_ATTENTION if kernel else "sdpa"
            assert model.config._attn_implementation == want
            calls = len(kernel_calls)
            runs[dtype, kernel] = _loss_and_grads(model, ids)
            assert len(kernel_calls) - calls == (model.config.num_hidden_layers if kernel else 0)
    truth_loss, truth = runs[torch.float32, False]
    assert any("q_proj.lora_A" in n for n in truth)

    def errors(key: tuple) -> tuple[float, dict[str, float]]:
        loss, grads = runs[key]
        assert grads.keys() == truth.keys()
        return abs(loss - truth_loss) / abs(truth_loss), {
            n: float((grads[n] - t).norm() / t.norm()) for n, t in truth.items()
        }

    for name, g in truth.items():
        assert g.norm() > 0, name
    loss_err, grad_err = errors((torch.float32, True))
    assert loss_err < 1e-5
    assert max(grad_err.values()) < 1e-4, grad_err
    # bf16: against the fp32 run, the kernel's error is of the size of SDPA's own bf16 error.
    loss_k, grad_k = errors((torch.bfloat16, True))
    loss_s, grad_s = errors((torch.bfloat16, False))
    assert loss_k < 1.5 * loss_s + 1e-3
    for name in truth:
        assert grad_k[name] < 1.5 * grad_s[name] + 2e-2, (name, grad_k[name], grad_s[name])


def test_padding_mask_falls_back_to_sdpa(kernel_calls: list[int]) -> None:
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: not plain causal
    ours, sdpa = _adapted(torch.float32, True), _adapted(torch.float32, False)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = sdpa(ids, attention_mask=mask).logits
    assert not kernel_calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_cpu_sdpa_models_are_switched() -> None:
    model = tiny_model("qwen3_moe")
    model.config._attn_implementation = "eager"
    assert not moe_experts.use_kernel_attention(model)
    assert model.config._attn_implementation == "eager"
    model.config._attn_implementation = "sdpa"
    assert moe_experts.use_kernel_attention(model)
    assert moe_experts.use_kernel_attention(model)  # idempotent
    assert not moe_experts.use_kernel_attention(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_sdpa_logits_on_kernel_attention(fresh, family: str) -> None:
    """ "kt_causal" (the CLI's default on the CPU) changes no family's logits: calls it cannot
    run go to SDPA whole, DSA's top-k ``indices`` included (16 of up to 24 keys in the tiny
    configs)."""
    model = fresh(family)
    ids = torch.randint(2, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        moe_experts.use_kernel_attention(model)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
