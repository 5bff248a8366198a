"""wrap(weight_dtype="int8"): the experts run on kt-kernel's weight-only INT8 base."""

import pytest
import torch

from lora_core import LoraConfig
from moe_experts import WrapError, adapt, adapt_model, experts_sites, wrap

from .conftest import token_batch

CFG = LoraConfig(enable=True, rank=4, alpha=8, init_seed=3)
DENSE = LoraConfig(enable=True, rank=4, alpha=8, init_seed=3, target_modules=["q_proj", "v_proj"])


def _kernels(model):
    return [k for _, k in experts_sites(model)]


def test_wrap_int8_storage_memory_and_report(fresh) -> None:
    model8, model16 = fresh("qwen3_moe"), fresh("qwen3_moe")
    rep8 = wrap(model8, weight_dtype="int8")
    rep16 = wrap(model16, weight_dtype="bf16")
    assert rep8.weight_dtype == "int8"
    assert rep8.bytes_moved == rep16.bytes_moved
    # One byte per weight plus one fp32 scale per output channel (E * (2I + H) per block):
    # (1 + 4/K) / 2 of bf16, so <= 0.55 from K = 40 (kt-kernel's tests check a real shape;
    # this tiny model has K = I = 16).
    channels = sum(
        k.spec.num_experts * (2 * k.spec.intermediate_size + k.spec.hidden_size)
        for k in _kernels(model8)
    )
    assert rep8.kernel_bytes == rep16.kernel_bytes // 2 + 4 * channels
    assert [name for name, _ in rep8.quantization] == list(rep8.wrapped_blocks)
    assert rep16.quantization == ()
    for kernel, (_, report) in zip(_kernels(model8), rep8.quantization, strict=True):
        w = kernel.expert_weights
        assert w.is_quantized
        assert w.dtype == torch.bfloat16
        assert report is w.quantization_report()
        for proj in (report.gate, report.up, report.down):
            assert 0 < proj.max_abs_error <= proj.max_step / 2 + 1e-9
            assert 0 < proj.rel_fro_error < 0.02
    # The module tree keeps zero-storage placeholders, as for the other dtypes.
    assert rep8.placeholders == rep16.placeholders


def test_int8_model_equals_bf16_model_on_dequantized_weights(fresh) -> None:
    # The oracle: the same model with its expert weights replaced by the dequantised INT8
    # values (q * scale rounded to bf16, exactly what the kernel's tiles hold), on the bf16
    # base. Only accumulation order differs, so logits and LoRA gradients agree to bf16
    # precision (3e-2 max-norm relative, as kt-kernel's bf16 tests).
    model8 = fresh("qwen3_moe")
    oracle = fresh("qwen3_moe")
    wrap(model8, weight_dtype="int8")
    with torch.no_grad():
        for (site, kernel), (name, module) in zip(
            experts_sites(model8),
            [(n, m) for n, m in oracle.named_modules() if n.endswith("mlp.experts")],
            strict=True,
        ):
            assert site.experts_name == name
            module.gate_up_proj.copy_(kernel.expert_weights.gate_up.float())
            module.down_proj.copy_(kernel.expert_weights.down.float())
    wrap(oracle, weight_dtype="bf16")
    grads = []
    for model in (model8, oracle):
        for p in model.parameters():
            p.requires_grad_(False)
        result = adapt(model, CFG)
        with torch.no_grad():  # non-zero B, so every LoRA gradient is informative
            gen = torch.Generator().manual_seed(5)
            for name, p in result.named_optimizer_parameters:
                if name.endswith("_b"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        ids = token_batch()
        out = model(ids, labels=ids)
        out.loss.backward()
        grads.append((out.logits.detach(), [p.grad.clone() for p in result.parameters()]))
    (logits8, g8), (logits_o, g_o) = grads
    scale = logits_o.abs().max()
    assert float((logits8 - logits_o).abs().max() / scale) < 3e-2
    for a, b in zip(g8, g_o, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 3e-2


@pytest.mark.timeout(120)
def test_int8_finetune_reaches_bf16_loss(fresh) -> None:
    # 30 AdamW steps on a fixed batch, dense (q/v) plus expert LoRA, from the same init. The
    # INT8 base perturbs each expert weight by at most half a quantisation step (about 0.6%
    # relative Frobenius error per projection), a perturbation LoRA learns around: the final
    # loss may differ from the bf16-base run by at most 5% of the loss the bf16 run removed
    # (measured: 5.26 -> 0.977 on bf16, 5.26 -> 1.092 on int8, i.e. 2.7%).
    ids = token_batch(batch=4, seq=16, seed=11)
    losses = {}
    for dtype in ("bf16", "int8"):
        torch.manual_seed(0)
        model = fresh("qwen3_moe")
        result = adapt_model(model, CFG, dense_config=DENSE, weight_dtype=dtype)
        opt = torch.optim.AdamW(result.parameters(), lr=1e-2)
        trace = []
        for _ in range(30):
            opt.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            trace.append(float(loss.detach()))
        losses[dtype] = trace
    bf16, int8 = losses["bf16"], losses["int8"]
    progress = bf16[0] - bf16[-1]
    assert progress > 0.5  # the run really trains (otherwise the margin means nothing)
    assert abs(int8[0] - bf16[0]) < 0.02 * bf16[0]
    assert abs(int8[-1] - bf16[-1]) <= 0.05 * progress, (int8[-1], bf16[-1], progress)


def test_bad_weight_dtype_names_the_choices(fresh) -> None:
    import re

    import kt_kernel

    # Every registered format is named (mxfp4 came with the registry, and a new one will too).
    assert {"fp32", "bf16", "int8", "fp8", "int4", "mxfp4"} <= set(kt_kernel.FORMATS)
    choices = re.escape(f"'auto' or one of {list(kt_kernel.FORMATS)}")
    with pytest.raises(WrapError, match=rf"weight_dtype must be {choices} .*, got 'int2'"):
        wrap(fresh("qwen3_moe"), weight_dtype="int2")  # type: ignore[arg-type]
