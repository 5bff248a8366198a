"""The host hand-over with the dense layers on a CUDA device (skipped without one).

fp32 with TF32 off, so the GPU and the CPU differ only in summation order: the overlapped and
the synchronous hybrid step, and the hot experts on the GPU, against the all-CPU step.
"""

from __future__ import annotations

import pytest
import torch

from lora_core import LoraConfig
from moe_experts import adapt, wrap
from moe_experts.hot_experts import enable_gpu_experts
from moe_experts.hybrid import GpuIdleMeter, enable_overlap, idle_meter
from moe_experts.testing import tiny_model

from .conftest import token_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(family: str, device: str):
    torch.manual_seed(1234)
    model = tiny_model(family).float()
    wrap(model, weight_dtype="fp32")
    model.to(device)  # placeholders move as metadata; the kernel's storage stays on the host
    # After the move, as load_pretrained(dense_device=...) then adapt: the expert LoRA is
    # created on the host, beside the kernel that reads it.
    result = adapt(model, LoraConfig(enable=True, rank=2, alpha=4, init_seed=11))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in result.named_optimizer_parameters:
            if name.endswith("_b"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.train()
    return model, result


def _step(model, result, ids):
    for p in result.parameters():
        p.grad = None
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone().cpu() for n, p in result.named_optimizer_parameters}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("variant", ["sync", "overlap", "hot"])
def test_hybrid_step_equals_all_cpu(family: str, variant: str) -> None:
    ids = token_batch()
    want_loss, want = _step(*_model(family, "cpu"), ids)
    model, result = _model(family, "cuda")
    if variant != "sync":
        enable_overlap(model)
    gpu = None
    if variant == "hot":
        gpu = enable_gpu_experts(model, 4, count_calls=1, device="cuda")
        _step(model, result, ids.cuda())
    meter = GpuIdleMeter()
    with idle_meter(meter):
        meter.begin_step()
        loss, got = _step(model, result, ids.cuda())
        meter.end_step()
    if gpu is not None:
        assert gpu.fixed
        assert gpu.resident_bytes() > 0
    assert abs(loss - want_loss) <= 1e-4 * abs(want_loss)
    for name, g in want.items():
        rel = float((got[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert rel <= (2e-2 if variant == "hot" else 1e-3), (name, rel)
    fraction = meter.idle_fraction() if variant != "sync" else 0.0
    assert 0.0 <= fraction <= 1.0


def test_overlap_copies_come_from_pinned_memory() -> None:
    model, result = _model("qwen3_moe", "cuda")
    enable_overlap(model)
    copies = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.is_cuda and out.device.type == "cpu" and kwargs.get("non_blocking"):
            copies.append(out.is_pinned())
        return out

    torch.Tensor.to = spy
    try:
        _step(model, result, token_batch().cuda())
    finally:
        torch.Tensor.to = original
    assert copies
    assert all(copies)
