"""Extra LoRA experts: zero change at init, exact gradients, deterministic, saved and restored."""

import pytest
import torch
import torch.nn.functional as F

from lora_core import LoraConfig, init_lora_tensor
from lora_core.contracts import ParameterOwnership
from moe_experts import AdaptError, adapt, coverage_report, wrap

from .conftest import token_batch

CFG = LoraConfig(enable=True, rank=2, alpha=4, init_seed=5)
N, J = 3, 6


def _model(fresh, family: str = "qwen3_moe", **kw):
    model = fresh(family)
    wrap(model, weight_dtype="fp32")
    return model, adapt(model, CFG, lora_experts=N, lora_expert_intermediate=J, **kw)


def test_published_replicated_not_peft_and_deterministic(fresh) -> None:
    model, result = _model(fresh)
    names = [n for n in result.parameter_names if ".lora_experts." in n]
    assert names == [
        f"model.layers.{i}.mlp.experts.lora_experts.{t}"
        for i in (0, 1)
        for t in ("le_gate", "le_up", "le_down")
    ]
    named = dict(model.named_parameters())
    for n in names:
        assert result.ownership[n] is ParameterOwnership.REPLICATED
        assert n not in result.peft_exports  # not PEFT-loadable
        assert named[n] is dict(result.named_optimizer_parameters)[n]
    gate = named[names[0]]
    assert tuple(gate.shape) == (N, J, 32)
    want = init_lora_tensor(
        "model.layers.0.mlp.experts.lora_experts.le_gate.lora_A",
        (N, J, 32),
        torch.float32,
        seed=CFG.init_seed,
    )
    torch.testing.assert_close(gate, want, rtol=0, atol=0)
    assert gate.abs().sum() > 0
    assert named[names[2]].abs().sum() == 0  # le_down starts at zero
    assert [b.lora_experts for b in coverage_report(model, result).blocks] == [N, N]
    again = adapt(model, CFG, lora_experts=N, lora_expert_intermediate=J)
    assert all(a is b for a, b in zip(again.parameters(), result.parameters(), strict=True))
    with pytest.raises(AdaptError, match="lora_experts=2"):
        adapt(model, CFG, lora_experts=2, lora_expert_intermediate=J)
    with pytest.raises(AdaptError, match="lora_experts must be"):
        adapt(model, CFG, lora_experts=-1)


def test_zero_change_at_init(fresh) -> None:
    ids = token_batch()
    plain = fresh("deepseek_v3")
    wrap(plain, weight_dtype="fp32")
    adapt(plain, CFG)
    model, _ = _model(fresh, "deepseek_v3")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_output_and_gradients_equal_plain_pytorch(fresh) -> None:
    model, _ = _model(fresh)
    kernel = model.model.layers[0].mlp.experts
    le = kernel.lora_experts
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        le.le_down.copy_(torch.randn(le.le_down.shape, generator=gen) * 0.3)
    x = torch.randn(7, 32, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=gen)
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in le.named_parameters()}
    y = kernel(x, ids, w)
    base = kernel._run(x, ids, w, use_lora=False).detach()
    # The plain formula: mean over n of down_n(silu(gate_n x) * up_n x).
    terms = [
        F.linear(
            F.silu(F.linear(x, ref["le_gate"][n])) * F.linear(x, ref["le_up"][n]), ref["le_down"][n]
        )
        for n in range(N)
    ]
    want = base + torch.stack(terms).mean(0)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(y.shape, generator=gen)
    (y * g).sum().backward()
    (want * g).sum().backward()
    for n, p in le.named_parameters():
        assert p.grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_save_and_restore_round_trip(fresh, tmp_path) -> None:
    model, result = _model(fresh)
    with torch.no_grad():
        for n, p in result.named_optimizer_parameters:
            p.add_(torch.full_like(p, 0.01) * (1 + hash(n) % 5))
    import lora_checkpoint  # the train extra, which the package's test session installs

    manifest = lora_checkpoint.save(tmp_path, result, step=1)
    entries = {p.name: p for p in manifest.parameters}
    extra = [n for n in result.parameter_names if ".lora_experts." in n]
    assert len(extra) == 6
    for n in extra:
        assert entries[n].peft_key is None  # the manifest says: not PEFT-loadable
    assert entries["model.layers.0.mlp.experts.lora.down_lora_b"].peft_key is not None
    other, result2 = _model(fresh)
    ckpt = lora_checkpoint.load(tmp_path / manifest.name, verify=True)
    lora_checkpoint.restore(result2, ckpt)
    for (n, a), (m, b) in zip(
        result.named_optimizer_parameters, result2.named_optimizer_parameters, strict=True
    ):
        assert n == m
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, model(ids).logits, rtol=0, atol=0)
