"""adapters_disabled: the adapted model computes exactly its untouched base, and skips LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_core import (
    AdapterStateError,
    LoraConfig,
    LoRALinear,
    LoRAParameter,
    adapters_disabled,
    enable_lora_training,
)

H, E, K = 12, 6, 2


class Router(nn.Module):
    """A transformers 5.x MoE router: a bare ``weight [E, H]`` and a top-k softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * 0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight), dim=-1)
        top, idx = torch.topk(probs, K, dim=-1)
        return top, idx


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Router()
        self.q_proj = nn.Linear(H, H)
        self.o_proj = nn.Linear(H, H)
        self.bank = nn.Parameter(torch.randn(E, H, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q_proj(x)
        w, idx = self.gate(h)
        out = torch.einsum("th,tkoh->tko", h, self.bank[idx])
        return self.o_proj((out * w.unsqueeze(-1)).sum(1))


CFG = LoraConfig(
    enable=True,
    rank=3,
    alpha=6,
    init_seed=4,
    target_modules=["q_proj", "o_proj"],
    target_parameters=["gate.weight"],
)


def _adapted(dropout: float = 0.0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    cfg = CFG.model_copy(update={"dropout": dropout}) if dropout else CFG
    if dropout:  # LoRAParameter takes no dropout: only the Linears here
        cfg = cfg.model_copy(update={"target_parameters": []})
    enable_lora_training(model, cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B: the adapted model really differs from its base
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return base, model


def test_disabled_model_is_its_base_bit_for_bit_and_comes_back() -> None:
    base, model = _adapted()
    x = torch.randn(7, H)
    adapted = model(x)
    assert not torch.allclose(adapted, base(x), atol=1e-3)
    with adapters_disabled(model):
        assert torch.equal(model(x), base(x))
        # A router read through the wrapper is the frozen weight while switched off.
        assert torch.equal(model.gate.weight, base.gate.weight)
    assert torch.equal(model(x), adapted)
    assert all(m.adapter_enabled for m in model.modules() if isinstance(m, LoRALinear))


def test_lora_factors_are_not_run_and_get_no_gradient() -> None:
    """Skipped, not multiplied by zero: no LoRA module runs, no gradient reaches a factor."""
    _, model = _adapted(dropout=0.5)
    model.train()  # dropout is live: the base path must not pass through it either
    calls: list[str] = []
    for name, m in model.named_modules():
        if name.endswith(("lora_A", "lora_B", "dropout")):
            m.register_forward_hook(lambda mod, i, o, name=name: calls.append(name))
    x = torch.randn(5, H, requires_grad=True)
    with adapters_disabled(model):
        model(x).sum().backward()
    assert calls == []
    assert x.grad is not None
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" in n)
    model(x).sum().backward()
    assert len(calls) == 6  # two layers: dropout, A, B each


def test_state_is_restored_after_an_exception_and_nesting() -> None:
    _, model = _adapted()
    router = model.gate
    assert isinstance(router, LoRAParameter)
    with pytest.raises(KeyError), adapters_disabled(model):
        raise KeyError("boom")
    assert router.adapter_enabled
    router.adapter_enabled = False  # switched off by hand before: stays off afterwards
    with adapters_disabled(model):
        with adapters_disabled(model):
            assert not model.q_proj.adapter_enabled
        assert not model.q_proj.adapter_enabled
    assert model.q_proj.adapter_enabled
    assert not router.adapter_enabled


def test_a_merged_adapter_is_refused_with_the_fix() -> None:
    _, model = _adapted()
    model.q_proj.merge()
    with (
        pytest.raises(AdapterStateError, match=r"q_proj.*unmerge\(\)"),
        adapters_disabled(model),
    ):
        pass
    assert model.o_proj.adapter_enabled  # nothing was switched off


def test_equals_peft_disable_adapter() -> None:
    """PEFT's own switch on the same LoRA values gives the same outputs on and off."""
    peft = pytest.importorskip("peft")
    base, model = _adapted()
    twin = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "o_proj"]),
    )
    named = dict(twin.named_parameters())
    with torch.no_grad():
        for leaf in ("q_proj", "o_proj"):
            ours = getattr(model, leaf)
            for f in ("lora_A", "lora_B"):
                named[f"base_model.model.{leaf}.{f}.default.weight"].copy_(getattr(ours, f).weight)
    model.gate.adapter_enabled = False  # PEFT's twin has no router LoRA here
    x = torch.randn(6, H)
    torch.testing.assert_close(model(x), twin(x), rtol=1e-6, atol=1e-6)
    with adapters_disabled(model), twin.disable_adapter():
        assert torch.equal(model(x), twin(x))
