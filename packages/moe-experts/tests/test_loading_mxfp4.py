"""load_pretrained of GPT-OSS as released: MXFP4 experts kept as shipped, transformers' oracle.

A tiny gpt_oss (H=64, I=96: multiples of 32, I != H, random biases) is saved in the hub's
MXFP4 layout (``save_mxfp4_checkpoint``: ``*_blocks`` uint8 ``[E, out, in/32, 16]`` and
``*_scales`` E8M0 ``[E, out, in/32]``, ``quantization_config: {quant_method: mxfp4}``). The
oracle is transformers' own dequantised model: ``from_pretrained`` with
``Mxfp4Config(dequantize=True)`` (its ``convert_moe_packed_tensors``), on the CPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_experts import KernelExperts, LoadError, is_placeholder, load_pretrained, wrap
from moe_experts.testing import save_mxfp4_checkpoint, tiny_config

from .conftest import token_batch

transformers = pytest.importorskip("transformers")
SHAPE = {"hidden_size": 64, "intermediate_size": 96}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt_oss", **SHAPE))
    with torch.no_grad():  # biases are zero at init: give them values
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.copy_(torch.randn_like(p) * 0.2)
    return save_mxfp4_checkpoint(model, tmp_path_factory.mktemp("mxfp4") / "gpt_oss")


def _transformers_dequantised(path: Path, dtype: torch.dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, quantization_config=transformers.Mxfp4Config(dequantize=True)
        ).eval()


def _kernels(model) -> dict[str, KernelExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, KernelExperts)}


def _own(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if not is_placeholder(p):
                p.data = p.data.clone()


def test_auto_keeps_the_shipped_blocks_and_scales(ckpt: Path) -> None:
    model = load_pretrained(ckpt, weight_dtype="auto")
    tensors = load_file(str(ckpt / "model.safetensors"))
    kernels = _kernels(model)
    assert len(kernels) == 2
    for name, kernel in kernels.items():
        w = kernel.expert_weights
        assert w.weight_dtype == "mxfp4"
        (gu_b, gu_s), (dn_b, dn_s) = w.storage
        # down: the shipped bytes as they are; gate_up: the same rows, gate (even) rows first.
        assert torch.equal(dn_b, tensors[f"{name}.down_proj_blocks"])
        assert torch.equal(dn_s, tensors[f"{name}.down_proj_scales"])
        inter = w.spec.intermediate_size
        order = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])
        assert torch.equal(gu_b, tensors[f"{name}.gate_up_proj_blocks"][:, order])
        assert torch.equal(gu_s, tensors[f"{name}.gate_up_proj_scales"][:, order])
        # Bytes and scales only, no bf16 copy beside them: at most 0.27x the bf16 experts.
        bf16 = 2 * (w.spec.num_experts * 3 * inter * w.spec.hidden_size)
        parts = sum(t.nbytes for t in (gu_b, gu_s, dn_b, dn_s))
        assert w.nbytes == parts + sum(b.nbytes for b in (w.gate_up_bias, w.down_bias))
        assert parts / bf16 <= 0.27
    assert load_pretrained(ckpt).model.layers[0].mlp.experts.expert_weights.weight_dtype == "mxfp4"


def test_logits_match_transformers_dequantised_model(ckpt: Path) -> None:
    ref = _transformers_dequantised(ckpt, torch.bfloat16)
    got = load_pretrained(ckpt, weight_dtype="auto", dtype=torch.bfloat16)
    assert "quantization_config" not in got.config.to_dict()
    ids = token_batch()
    with torch.no_grad():
        want, have = ref(ids).logits.float(), got(ids).logits.float()
    rel = float((have - want).norm() / want.norm())
    assert rel < 2e-2, rel  # bf16 tolerance: the kernel and transformers sum in other orders
    # The MXFP4 tiles are transformers' dequantised bf16 weights bitwise (E2M1 x 2^k is exact
    # in bf16), so against the dense bf16 kernel on those weights only the GEMM path differs.
    _own(ref)
    wrap(ref, weight_dtype="bf16")
    for name, kernel in _kernels(ref).items():
        mine = _kernels(got)[name].expert_weights
        assert torch.equal(mine.gate_up, kernel.expert_weights.gate_up), name
        assert torch.equal(mine.down, kernel.expert_weights.down), name
        assert torch.equal(mine.gate_up_bias, kernel.expert_weights.gate_up_bias), name
    ops = torch.ops.kt_kernel
    rows = int(ops.gemv_rows())
    try:
        ops.set_gemv_rows(0)  # tile + GEMM in both
        with torch.no_grad():
            assert torch.equal(got(ids).logits, ref(ids).logits)
    finally:
        ops.set_gemv_rows(rows)


def test_bf16_dequantises_like_transformers_and_wrap(ckpt: Path) -> None:
    ref = _transformers_dequantised(ckpt, torch.bfloat16)
    wrap(ref, weight_dtype="bf16")
    got = load_pretrained(ckpt, weight_dtype="bf16", dtype=torch.bfloat16)
    for name, want in _kernels(ref).items():
        have = _kernels(got)[name].expert_weights
        assert have.weight_dtype == "bf16"
        assert torch.equal(have.gate_up, want.expert_weights.gate_up), name
        assert torch.equal(have.down, want.expert_weights.down), name
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


def test_bad_requests_and_corrupt_parts_are_one_clear_error(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(LoadError, match=r"experts are MXFP4 .*'int4' would quantise them a second"):
        load_pretrained(ckpt, weight_dtype="int4")
    import json
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    key = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[key][0, 0, 0] = 255
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError, match=rf"'{key}' does not fit .*255 \(E8M0 NaN\)"):
        load_pretrained(bad)
    del tensors["model.layers.1.mlp.experts.down_proj_blocks"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError, match=rf"'{key}' is a mxfp4 part without"):
        load_pretrained(bad)
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"is a mxfp4 checkpoint part, but config\.json has no"):
        load_pretrained(plain)
