"""FP8-block base: the checkpoint convention, adoption without a copy, every E4M3 code per ISA.

test_conformance (every activation x bias, fp32/bf16, bitwise across thread counts) and
test_isa run ``"fp8"`` too, because it is registered in ``kk.FORMATS``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

tile = torch.ops.kt_kernel.dequantize_tile


def _native() -> bool:
    return kk.backend_info().active == "native"


def _all_codes(n: int, k: int) -> torch.Tensor:
    """``[n, k]`` E4M3 tensor cycling through all 254 non-NaN codes (subnormals and -0 too)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    return codes.repeat(-(-n * k // len(codes)))[: n * k].reshape(n, k).view(torch.float8_e4m3fn)


def test_dequantize_is_transformers_finegrained_fp8_convention() -> None:
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    fmt = kk.Fp8Block(torch.float32)
    w = _all_codes(300, 260)
    scale_inv = torch.rand(3, 3) * 1e-2 + 1e-4
    ours = fmt.dequantize(fmt.from_checkpoint(w, scale_inv))
    theirs = fp8._dequantize_fp8_weight(w, scale_inv, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)


def test_from_checkpoint_adopts_without_copy_and_widens_scales() -> None:
    fmt = kk.Fp8Block()
    w = _all_codes(256, 384).unsqueeze(0).repeat(2, 1, 1)
    s = torch.rand(2, 2, 3)
    pw, ps = fmt.from_checkpoint(w, s)
    assert pw.data_ptr() == w.data_ptr()
    assert ps.data_ptr() == s.data_ptr()
    _, ps16 = fmt.from_checkpoint(w, s.bfloat16())
    assert torch.equal(ps16, s.bfloat16().float())
    if hasattr(torch, "float8_e8m0fnu"):
        e8 = torch.tensor([2.0**-7, 2.0**-9]).repeat(6)[:12].reshape(2, 2, 3)
        _, ps8 = fmt.from_checkpoint(w, e8.to(torch.float8_e8m0fnu))
        assert torch.equal(ps8, e8)
    spec = kk.ExpertSpec(2, 384, 128)
    gate, up = fmt.from_checkpoint(w[:, :128], s[:, :1]), fmt.from_checkpoint(w[:, 128:], s[:, 1:])
    down = fmt.quantize(torch.randn(2, 384, 128))
    weights = kk.ExpertWeights.from_parts(spec, fmt, fmt.fuse_gate_up(gate, up), down)
    assert weights.storage[1][0].data_ptr() == down[0].data_ptr()  # contiguous: adopted
    assert torch.equal(weights.gate_up[:, :128], fmt.dequantize(gate))
    assert weights.nbytes / (2 * (256 * 384 + 384 * 128) * 2) < 0.52


def test_checkpoint_errors_name_the_tensor() -> None:
    fmt = kk.Fp8Block()
    w = _all_codes(130, 128)
    with pytest.raises(kk.KernelDTypeError, match=r"weight must be torch\.float8_e4m3fn"):
        fmt.from_checkpoint(w.float(), torch.ones(2, 1))
    with pytest.raises(kk.KernelInputError, match=r"weight_scale_inv must have shape \[2, 1\]"):
        fmt.from_checkpoint(w, torch.ones(1, 1))
    with pytest.raises(kk.KernelDTypeError, match="weight_scale_inv must be float32"):
        fmt.from_checkpoint(w, torch.ones(2, 1, dtype=torch.float16))
    bad = w.view(torch.uint8).clone()
    bad[3, 5] = 0xFF
    with pytest.raises(kk.KernelInputError, match="NaN"):
        fmt.from_checkpoint(bad.view(torch.float8_e4m3fn), torch.ones(2, 1))
    with pytest.raises(kk.KernelInputError, match="multiple of 128"):
        fmt.fuse_gate_up((w[:100], torch.ones(1, 1)), (w[:100], torch.ones(1, 1)))
    for value in (-0.5, float("nan"), float("inf")):  # scale_inv = max|block| / 448 >= 0
        scale = torch.ones(2, 1)
        scale[1, 0] = value
        with pytest.raises(kk.KernelInputError, match="negative, NaN or inf scale"):
            fmt.from_checkpoint(w, scale)
        with pytest.raises(kk.KernelInputError, match="negative, NaN or inf scale"):
            fmt.from_checkpoint(w, scale.bfloat16())
    zero = fmt.from_checkpoint(w, torch.zeros(2, 1))  # an all-zero block has scale 0
    assert torch.equal(fmt.dequantize(zero, torch.float32), torch.zeros(130, 128))


def test_quantise_error_bound_and_memory() -> None:
    fmt = kk.Fp8Block(torch.float32)
    w = torch.randn(2, 200, 300) * torch.logspace(-3, 0, 300)  # many binades in one block
    weight, scale_inv = fmt.quantize(w)
    assert weight.dtype == torch.float8_e4m3fn
    assert scale_inv.shape == (2, 2, 3)
    deq = fmt.dequantize((weight, scale_inv))
    s = scale_inv.repeat_interleave(128, -2)[:, :200].repeat_interleave(128, -1)[..., :300]
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative, 2^-10 x scale in subnormals.
    bound = torch.maximum(w.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
    assert bool(((deq - w).abs() <= bound).all())
    spec = kk.ExpertSpec(2, 256, 128)
    w8 = kk.ExpertWeights.from_fused(
        spec, torch.randn(2, 256, 256), torch.randn(2, 256, 128), weight_dtype="fp8"
    )
    w16 = kk.ExpertWeights.from_fused(
        spec, torch.randn(2, 256, 256), torch.randn(2, 256, 128), dtype=torch.bfloat16
    )
    assert w8.format == kk.Fp8Block(torch.float32)
    assert w8.weight_dtype == "fp8"
    assert w8.nbytes / w16.nbytes == pytest.approx(0.5 + 2 / 128**2)


CHILD = r"""
import json, torch, kt_kernel as kk
codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
n, k = 150, 254 * 2 + 3  # 511: 4 column blocks, the last partial
w = codes.repeat(n * k // 254 + 1)[: n * k].reshape(1, n, k).view(torch.float8_e4m3fn)
s = torch.rand(1, 2, 4) * 1e-2 + 1e-6
out = {"isa": kk.backend_info().isa}
for dtype in (torch.float32, torch.bfloat16):
    fmt = kk.Fp8Block(dtype)
    parts = fmt.from_checkpoint(w, s)
    ref = fmt.dequantize(parts)
    args = list(fmt.native_args(parts))
    same = True
    for r0, c0, rows, cols in ((0, 0, n, k), (16, 32, 120, 400), (3, 1, 9, 17)):
        got = torch.ops.kt_kernel.dequantize_tile("fp8", args, n, k, r0, c0, rows, cols, dtype)
        same &= torch.equal(got, ref[:, r0:r0 + rows, c0:c0 + cols])
    out[str(dtype)] = bool(same)
print(json.dumps(out))
"""


@pytest.mark.skipif(not _native(), reason="needs the native extension")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_every_e4m3_code_decodes_bitwise_on_each_isa(isa: str) -> None:
    feats = kk.backend_info().cpu_features
    if (isa == "avx512" and "avx512f" not in feats) or (isa == "avx2" and "avx2" not in feats):
        pytest.skip(f"this CPU has no {isa}")
    env = dict(os.environ, KT_KERNEL_ISA=isa, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"isa": isa, "torch.float32": True, "torch.bfloat16": True}
