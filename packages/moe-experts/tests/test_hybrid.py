"""The host hand-over in every family, on the CPU: overlapped == synchronous bit for bit, hot
experts == all-host within the self-check tolerance, checkpointed layers == plain layers.

The dense device here is the CPU (``dense_device="cpu"``), so the asynchronous path runs with
the host worker thread in place of CUDA streams; the CUDA variants are in ``test_hybrid_cuda``
and in ``tests/gpu/device_check.sh``.
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel
from lora_core import LoraConfig, enable_lora_training
from moe_experts import adapt, router_targets, wrap
from moe_experts.checkpointing import enable_gradient_checkpointing
from moe_experts.finetune.targets import attention_targets
from moe_experts.hot_experts import GpuExpertsError, enable_gpu_experts
from moe_experts.hybrid import enable_overlap
from moe_experts.wrapping import experts_sites

from .conftest import FAMILIES, token_batch


def _adapted(fresh, family: str):
    """Wrapped model with router + attention LoRA (lora-core) and expert LoRA, B non-zero."""
    model = fresh(family)
    wrap(model, weight_dtype="fp32")
    cfg = LoraConfig(
        enable=True,
        rank=2,
        alpha=4,
        init_seed=11,
        target_modules=list(attention_targets(model)),
        target_parameters=list(router_targets(model)),
    )
    dense = enable_lora_training(model, cfg)
    result = dense.merge(adapt(model, cfg))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in result.named_optimizer_parameters:
            if name.endswith(("_b", "lora_B.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.train()
    return model, result


def _step(model, result, ids) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    for p in result.parameters():
        p.grad = None
    torch.manual_seed(1)  # PhiMoE's training-mode router samples: same draws in every step
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in result.named_optimizer_parameters if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_overlapped_equals_synchronous_bitwise(fresh, family: str) -> None:
    ids = token_batch()
    sync_model, sync_result = _adapted(fresh, family)
    loss_a, logits_a, grads_a = _step(sync_model, sync_result, ids)
    model, result = _adapted(fresh, family)
    assert enable_overlap(model) == len(experts_sites(model)) > 0
    loss_b, logits_b, grads_b = _step(model, result, ids)
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(logits_a, logits_b)
    assert grads_a.keys() == grads_b.keys()
    assert any(".experts." in n for n in grads_b)  # the host kernel's LoRA got gradients
    for name, g in grads_a.items():
        assert torch.equal(g, grads_b[name]), name
    # A second step with the same model: the worker and the pinned-buffer path are reusable.
    loss_c, _, grads_c = _step(model, result, ids)
    assert torch.equal(loss_a, loss_c)
    for name, g in grads_a.items():
        assert torch.equal(g, grads_c[name]), name


def test_shared_experts_run_while_the_host_computes(fresh) -> None:
    # DeepSeek-V3 calls its shared experts after the routed ones: with overlap they run
    # between the hand-over and the wait, once per block call (served to the block).
    model, result = _adapted(fresh, "deepseek_v3")
    enable_overlap(model)
    calls = []
    sites = experts_sites(model)
    for site, _ in sites:
        # A submodule: the served call runs no layer of the shared experts.
        site.block.shared_experts.down_proj.register_forward_hook(lambda *_: calls.append(1))
    _step(model, result, token_batch())
    assert [e.shared_cache.hits for _, e in sites] == [1] * len(sites)
    assert len(calls) == len(sites)  # computed once each, not twice
    enable_overlap(model, enabled=False)
    assert all(e.shared_cache is None and not e.overlap for _, e in sites)
    assert "forward" not in sites[0][0].block.shared_experts.__dict__


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_hot_experts_equal_all_host(fresh, family: str) -> None:
    ids = token_batch(seq=12)
    host_model, host_result = _adapted(fresh, family)
    loss_a, logits_a, grads_a = _step(host_model, host_result, ids)
    model, result = _adapted(fresh, family)
    enable_overlap(model)
    e = experts_sites(model)[0][1].spec.num_experts
    gpu = enable_gpu_experts(model, max(1, e // 2), count_calls=1)
    _step(model, result, ids)  # counted
    assert not gpu.fixed
    loss_b, logits_b, grads_b = _step(model, result, ids)  # fixed at this call's start
    assert gpu.fixed
    sets = gpu.sets()
    assert all(len(v) == max(1, e // 2) for v in sets.values())
    tol = kt_kernel.FORMATS["fp32"]().self_check_tolerance
    torch.testing.assert_close(loss_b, loss_a, rtol=tol, atol=tol)
    scale = logits_a.abs().max()
    assert (logits_b - logits_a).abs().max() <= tol * scale
    for name, g in grads_a.items():
        err = (grads_b[name] - g).abs().max()
        assert err <= tol * g.abs().max().clamp_min(1e-6), (name, float(err))


def test_hot_experts_counts_choose_the_most_routed(fresh) -> None:
    model, result = _adapted(fresh, "qwen3_moe")
    gpu = enable_gpu_experts(model, 2, count_calls=1)
    ids = token_batch(seq=16)
    counted = {}

    def record(module, args):
        counted[id(module)] = args[1].reshape(-1)

    for _, experts in experts_sites(model):
        experts.register_forward_pre_hook(record)
    _step(model, result, ids)
    gpu.fix()
    for name, hot in gpu.layers.items():
        routed = torch.bincount(counted[id(hot.experts_ref)], minlength=hot.counts.numel())
        assert torch.equal(hot.counts, routed)
        want = sorted(torch.sort(-routed, stable=True).indices[:2].tolist())
        assert gpu.sets()[name] == want
    # A resumed run restores the recorded set without counting.
    again, _ = _adapted(fresh, "qwen3_moe")
    restored = enable_gpu_experts(again, 2)
    restored.restore(gpu.sets())
    assert restored.fixed
    assert restored.sets() == gpu.sets()
    with pytest.raises(GpuExpertsError, match="--gpu-experts 2"):
        enable_gpu_experts(again, 3).restore(gpu.sets())


def test_hot_experts_refuse_bad_counts(fresh) -> None:
    model, _ = _adapted(fresh, "mixtral")
    e = experts_sites(model)[0][1].spec.num_experts
    with pytest.raises(GpuExpertsError, match=f"at most {e}"):
        enable_gpu_experts(model, e + 1)
    with pytest.raises(GpuExpertsError, match="positive int"):
        enable_gpu_experts(model, 0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_layers_equal_plain(fresh, family: str) -> None:
    ids = token_batch()
    plain, plain_result = _adapted(fresh, family)
    loss_a, _, grads_a = _step(plain, plain_result, ids)
    model, result = _adapted(fresh, family)
    assert enable_gradient_checkpointing(model) > 0
    enable_overlap(model)
    kernel_calls = []
    from moe_experts import hybrid

    original = hybrid._HostCall.start_forward

    def counting(self, *args, **kwargs):
        kernel_calls.append(1)
        return original(self, *args, **kwargs)

    hybrid._HostCall.start_forward = counting
    try:
        loss_b, _, grads_b = _step(model, result, ids)
    finally:
        hybrid._HostCall.start_forward = original
    # The recompute replays the host output: the kernel ran once per MoE layer, not twice.
    assert len(kernel_calls) == len(experts_sites(model))
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.timeout(120)
# gpt_oss: interleaved gate/up, so the adopted B rows are reordered on their way to the kernel.
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_overlap_and_hot_experts_with_adopted_peft_lora(fresh, family: str) -> None:
    import peft

    def peft_model():
        torch.manual_seed(0)  # PEFT draws lora_A from the global generator
        pm = peft.get_peft_model(
            fresh(family),
            peft.LoraConfig(
                r=2,
                lora_alpha=4,
                target_modules=[],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
        )
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        wrap(pm, weight_dtype="fp32")
        return pm.train()

    def step(pm):
        pm.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = pm(token_batch(), labels=token_batch())
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads

    loss_a, grads_a = step(peft_model())
    assert grads_a  # PEFT's own parameters got gradients through the kernel
    overlapped = peft_model()
    enable_overlap(overlapped)
    loss_b, grads_b = step(overlapped)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        assert torch.equal(g, grads_b[name]), name
    hot_model = peft_model()
    gpu = enable_gpu_experts(hot_model, 3, count_calls=1)
    step(hot_model)
    gpu.fix()
    loss_c, grads_c = step(hot_model)
    tol = kt_kernel.FORMATS["fp32"]().self_check_tolerance
    torch.testing.assert_close(loss_c, loss_a, rtol=tol, atol=tol)
    for name, g in grads_a.items():
        err = (grads_c[name] - g).abs().max()
        assert err <= tol * g.abs().max().clamp_min(1e-6), (name, float(err))


@pytest.mark.timeout(240)
# Families whose tiny models route every token alike in both runs: in others (deepseek_v3,
# olmoe) bf16 rounding flips one token's top-k, which moves the gradients by far more than the
# rounding itself. The cast is family-independent (the optimizer's parameter list).
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_lora_tracks_fp32_lora_with_the_same_factors(fresh, family: str) -> None:
    # --lora-dtype bf16: every LoRA factor, its gradient and its AdamW state in bf16, the host
    # kernel's expert LoRA included. Reference: the fp32 run whose factors hold the same
    # (bf16-representable) values; the two differ only by bf16 rounding in the LoRA math
    # (measured: gradients within 1.1% in norm).
    from types import SimpleNamespace

    from moe_experts.finetune.devices import prepare_hybrid, resolve_placement

    ids = token_batch()
    ref_model, ref_result = _adapted(fresh, family)
    with torch.no_grad():
        for _, p in ref_result.named_optimizer_parameters:
            p.copy_(p.to(torch.bfloat16))
    model, result = _adapted(fresh, family)
    params = list(result.parameters())
    # What the CLI does with --device cpu --lora-dtype bf16, between adapting and the optimizer.
    placement = resolve_placement("cpu", "bf16")
    args = SimpleNamespace(overlap=None, gradient_checkpointing=False, gpu_experts=0, grad_accum=1)
    setup = prepare_hybrid(model, result, args, placement)
    assert not setup.overlap  # off on the CPU unless asked: the sync path is what is tested
    assert {p.dtype for p in result.parameters()} == {torch.bfloat16}
    losses = []
    for r, m in ((ref_result, ref_model), (result, model)):
        optimizer = torch.optim.AdamW(r.parameters(), lr=2e-2, weight_decay=0.0)
        first, logits, grads = _step(m, r, ids)
        optimizer.step()
        second, _, _ = _step(m, r, ids)  # the step's update reached every LoRA, kernel's too
        losses.append((first, second, logits, grads, optimizer))
    (ref_first, ref_second, ref_logits, ref_grads, _), (first, second, logits, grads, opt) = losses
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.bfloat16}
    assert len(opt.state) == len(params)
    assert grads.keys() == ref_grads.keys()
    assert any(".experts." in n for n in grads)
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.bfloat16, name
        err = torch.linalg.vector_norm(grads[name].float() - g) / torch.linalg.vector_norm(g)
        assert err <= 0.03, (name, float(err))
    assert (logits - ref_logits).abs().max() <= 0.02 * ref_logits.abs().max()
    torch.testing.assert_close(first, ref_first, rtol=2e-3, atol=0)
    # The update moves the loss far more than bf16 rounding does, so a LoRA that missed the
    # step (a stale fp32 copy in the kernel) shows here.
    moved = (ref_first - ref_second).abs()
    assert moved > 0.01 * ref_first
    assert (second - ref_second).abs() <= 0.1 * moved, (float(second), float(ref_second))
