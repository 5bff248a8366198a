"""One vocabulary of weight formats: kt_kernel.FORMATS, "auto", and the old spellings."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import kt_kernel
from moe_experts import KernelExperts, LoadError, WrapError, load_pretrained, wrap
from moe_experts.finetune.config import coerce
from moe_experts.finetune.options import OPTIONS
from moe_experts.storage import StoragePlan, checkpoint_dtype
from moe_experts.testing import FP8_QUANTIZATION_CONFIG, tiny_model

from .conftest import token_batch


def _kernels(model) -> list[KernelExperts]:
    return [m for m in model.modules() if isinstance(m, KernelExperts)]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(token_batch()).logits


def _auto_name(dtype: torch.dtype) -> str:
    # bf16 weights are stored repacked (the same values) where kt-kernel runs bf16-packed's
    # own products (AVX512_BF16), densely elsewhere: kt-kernel's tests pin which CPU is which.
    if dtype == torch.float32:
        return "fp32"
    return "bf16-packed" if kt_kernel.Bf16Packed.own_products_here() else "bf16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wrap_auto_stores_the_experts_in_their_own_dtype(fresh, dtype) -> None:
    name = _auto_name(dtype)
    auto, named = fresh("qwen3_moe").to(dtype), fresh("qwen3_moe").to(dtype)
    report = wrap(auto, weight_dtype="auto")
    assert report.weight_dtype == name
    want = kt_kernel.FORMATS[name]()
    assert all(k.expert_weights.format == want for k in _kernels(auto))
    assert all(k.expert_weights.dtype == dtype for k in _kernels(auto))
    wrap(named, weight_dtype=name)
    assert torch.equal(_logits(auto), _logits(named))


def test_old_spellings_warn_and_mean_the_new_names(fresh, capsys) -> None:
    model = fresh("qwen3_moe")
    with pytest.warns(FutureWarning, match="'bfloat16' is deprecated; use 'bf16'"):
        report = wrap(model, weight_dtype="bfloat16")
    assert report.weight_dtype == "bf16"
    assert all(k.expert_weights.weight_dtype == "bf16" for k in _kernels(model))
    # The fine-tune CLI reads the same registry: old spellings with a warning, typos refused.
    opt = next(o for o in OPTIONS if o.dest == "weight_dtype")
    assert coerce(opt, "float32", "--weight-dtype") == "fp32"
    assert "warning: --weight-dtype 'float32' is deprecated; use 'fp32'" in capsys.readouterr().err
    assert coerce(opt, "auto", "--weight-dtype") == "auto"
    for name in kt_kernel.FORMATS:
        assert coerce(opt, name, "--weight-dtype") == name
    with pytest.raises(Exception, match=r"--weight-dtype 'int9': expected one of auto, fp32"):
        coerce(opt, "int9", "--weight-dtype")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny qwen3_moe saved in fp32, in bf16, and in fp32 with no dtype in config.json."""
    torch.manual_seed(1234)
    model = tiny_model("qwen3_moe")
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = tmp_path_factory.mktemp(f"ckpt-{name}")
        model.to(dtype).save_pretrained(out[name])
    out["no_dtype"] = tmp_path_factory.mktemp("ckpt-no-dtype")
    model.to(torch.bfloat16).save_pretrained(out["no_dtype"])
    config = json.loads((out["no_dtype"] / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (out["no_dtype"] / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_load_pretrained_auto_is_the_checkpoint_dtype(checkpoints, which: str) -> None:
    path = checkpoints[which]
    name = _auto_name(torch.float32 if which == "fp32" else torch.bfloat16)
    plan = StoragePlan.for_checkpoint(path, "auto")
    assert plan.weight_dtype == name
    assert plan.reason.startswith("auto: the checkpoint's")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = load_pretrained(path, weight_dtype="auto", dtype=torch.float32)
        named = load_pretrained(path, weight_dtype=name, dtype=torch.float32)
    assert {k.expert_weights.weight_dtype for k in _kernels(auto)} == {name}
    assert torch.equal(_logits(auto), _logits(named))


def test_load_pretrained_streams_into_bf16_packed(checkpoints) -> None:
    # kt-kernel's repacked bf16 layout: the same values as bf16, streamed from the checkpoint.
    path = checkpoints["bf16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = load_pretrained(path, weight_dtype="bf16-packed")
        dense = load_pretrained(path, weight_dtype="bf16")
    assert {k.expert_weights.format.name for k in _kernels(packed)} == {"bf16_packed"}
    for a, b in zip(_kernels(packed), _kernels(dense), strict=True):
        assert torch.equal(a.expert_weights.gate_up, b.expert_weights.gate_up)
        assert torch.equal(a.expert_weights.down, b.expert_weights.down)
    got, want = _logits(packed), _logits(dense)
    assert (got - want).abs().max() / want.abs().max() < 2e-2


def test_checkpoint_dtype_falls_back_to_the_tensors(checkpoints) -> None:
    # config.json without dtype/torch_dtype: the dtype most of the checkpoint's tensors have.
    raw = json.loads((checkpoints["no_dtype"] / "config.json").read_text())
    assert checkpoint_dtype(checkpoints["no_dtype"], raw) == torch.bfloat16
    plan = StoragePlan.for_checkpoint(checkpoints["no_dtype"], "auto")
    assert plan.weight_dtype == _auto_name(torch.bfloat16)


def test_quantised_checkpoints_keep_their_format(checkpoints, tmp_path: Path) -> None:
    # Only config.json is read to plan: the quantization_config picks the shipped format.
    config = json.loads((checkpoints["bf16"] / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for asked in ("auto", None, "fp8"):
        assert StoragePlan.for_checkpoint(tmp_path, asked).weight_dtype == "fp8"
    assert StoragePlan.for_checkpoint(tmp_path, "fp32").weight_dtype == "fp32"  # dequantised
    with pytest.raises(LoadError, match=r"experts are FP8 .*'int4' would quantise them a second"):
        StoragePlan.for_checkpoint(tmp_path, "int4")
    config["quantization_config"] = {"quant_method": "awq"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"config\.json: no weight format .* quant_method='awq'"):
        StoragePlan.for_checkpoint(tmp_path, "auto")
    with pytest.raises(WrapError, match=r"weight_dtype must be 'auto' or one of"):
        StoragePlan.for_checkpoint(tmp_path, "int9")


class _Int8Coarse(kt_kernel.Int8PerChannel):
    """A format only this test knows: INT8 storage with a looser self-check tolerance."""

    weight_dtype = "int8_coarse"
    self_check_tolerance = 0.07


def test_a_new_format_is_one_registration_in_kt_kernel(fresh, checkpoints) -> None:
    # Nothing in moe-experts names a format: registering one in kt-kernel makes it a choice of
    # wrap, load_pretrained, the self-check and the CLI at once.
    kt_kernel.register_format("int8_coarse", _Int8Coarse)
    try:
        model = fresh("qwen3_moe")
        report = wrap(model, weight_dtype="int8_coarse")
        assert report.weight_dtype == "int8_coarse"
        assert all(isinstance(k.expert_weights.format, _Int8Coarse) for k in _kernels(model))
        assert all(0 < c.quantization_error <= 0.07 for c in report.self_checks)
        assert len(report.quantization) == len(report.wrapped_blocks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = load_pretrained(checkpoints["fp32"], weight_dtype="int8_coarse")
        assert {k.expert_weights.weight_dtype for k in _kernels(loaded)} == {"int8_coarse"}
        opt = next(o for o in OPTIONS if o.dest == "weight_dtype")
        assert coerce(opt, "int8_coarse", "--weight-dtype") == "int8_coarse"
    finally:
        del kt_kernel.FORMATS["int8_coarse"]
