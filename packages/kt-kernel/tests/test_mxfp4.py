"""MXFP4 base (GPT-OSS's shipped experts): transformers' convention, the quantiser, every code.

test_conformance (every activation x bias, fp32/bf16 forward and backward against the
reference on the dequantised weights, bitwise across thread counts) and test_isa run
``"mxfp4"`` too, because it is registered in ``kk.FORMATS``; test_native_safety covers its
tile bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk
from kt_kernel.formats_mxfp4 import E2M1_VALUES

tile = torch.ops.kt_kernel.dequantize_tile


def _native() -> bool:
    return kk.backend_info().active == "native"


def _every_byte(*lead: int) -> torch.Tensor:
    """uint8 ``[*lead, 16]`` cycling through all 256 bytes (every pair of E2M1 codes)."""
    n = 16
    for d in lead:
        n *= d
    return torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(*lead, 16)


def test_dequantize_is_transformers_convert_moe_packed_tensors() -> None:
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    assert tuple(mx.FP4_VALUES) == E2M1_VALUES  # the table, low nibble = even column
    blocks = _every_byte(2, 6, 5)  # [E, N, G, 16]: K = 160
    gen = torch.Generator().manual_seed(0)
    scales = torch.randint(100, 150, (2, 6, 5), generator=gen, dtype=torch.uint8)
    parts = kk.Mxfp4.from_checkpoint(blocks, scales)
    for dtype in (torch.bfloat16, torch.float32):
        ours = kk.Mxfp4(dtype).dequantize(parts)
        theirs = mx.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
        assert torch.equal(ours, theirs.transpose(1, 2))


def test_quantize_picks_the_nearest_e2m1_value_times_a_power_of_two() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 8, 96, generator=gen) * torch.logspace(-3, 2, 8).view(1, 8, 1)
    w[0, 0, :32] = 0.0  # an all-zero group
    fmt = kk.Mxfp4(torch.float32)
    blocks, scales = fmt.quantize(w)
    assert blocks.shape == (3, 8, 3, 16)
    assert scales.shape == (3, 8, 3)
    deq = fmt.dequantize((blocks, scales))
    # Oracle: brute force over the 16 values at the group's scale, with nothing clipped.
    grid = torch.tensor(E2M1_VALUES)
    s = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)
    assert bool((w.abs() <= 6 * s).all())  # the scale is large enough ...
    assert bool(
        (w.abs().view(3, 8, 3, 32).amax(-1) > 3 * torch.exp2(scales.double() - 127))[
            w.abs().view(3, 8, 3, 32).amax(-1) > 0
        ].all()
    )  # ... and the smallest that is
    dist = (w.double().unsqueeze(-1) - grid.double() * s.unsqueeze(-1)).abs()
    best = dist.min(dim=-1).values
    assert torch.equal((deq.double() - w.double()).abs(), best)
    assert torch.equal(deq[0, 0, :32], torch.zeros(32))
    # Values on the grid come back exactly.
    exact = grid[torch.randint(0, 16, (4, 64), generator=gen)] * 2.0**-3
    assert torch.equal(fmt.dequantize(fmt.quantize(exact)), exact)


def test_bytes_are_0_266x_bf16_and_auto_picks_it_for_mxfp4_checkpoints() -> None:
    spec = kk.ExpertSpec(2, 128, 64)
    gu, dn = torch.randn(2, 128, 128), torch.randn(2, 128, 64)
    w16 = kk.ExpertWeights.from_fused(spec, gu, dn, dtype=torch.bfloat16)
    w4 = kk.ExpertWeights.from_fused(spec, gu, dn, weight_dtype="mxfp4")
    assert w4.weight_dtype == "mxfp4"
    assert w4.nbytes / w16.nbytes == pytest.approx((0.5 + 1 / 32) / 2)
    assert w4.nbytes / w16.nbytes <= 0.27
    assert kk.auto_format(torch.bfloat16, {"quant_method": "mxfp4"}) == "mxfp4"
    assert kk.FORMATS["mxfp4"] is kk.Mxfp4


def test_checkpoint_parts_are_adopted_without_a_copy_and_bad_ones_refused() -> None:
    blocks, scales = _every_byte(2, 4, 3), torch.full((2, 4, 3), 127, dtype=torch.uint8)
    got = kk.Mxfp4.from_checkpoint(blocks, scales)
    assert got[0].data_ptr() == blocks.data_ptr()
    assert got[1].data_ptr() == scales.data_ptr()
    with pytest.raises(kk.KernelDTypeError, match="MXFP4 scales must be uint8"):
        kk.Mxfp4.from_checkpoint(blocks, scales.float())
    with pytest.raises(kk.KernelInputError, match=r"scales must be \[2, 4, 3\]"):
        kk.Mxfp4.from_checkpoint(blocks, scales[:, :2])
    with pytest.raises(kk.KernelInputError, match=r"blocks must be \[\.\.\., N, K/32, 16\]"):
        kk.Mxfp4.from_checkpoint(blocks.view(2, 4, 6, 8), scales)
    bad = scales.clone()
    bad[1, 2, 0] = 255
    with pytest.raises(kk.KernelInputError, match=r"255 .*NaN"):
        kk.Mxfp4.from_checkpoint(blocks, bad)
    with pytest.raises(kk.KernelInputError, match=r"multiple of 32.*K=40"):
        kk.Mxfp4().quantize(torch.randn(4, 40))
    # Interleaved gate/up rows (GPT-OSS) reorder with their scales.
    w = torch.randn(6, 64)
    fmt = kk.Mxfp4(torch.float32)
    order = torch.tensor([0, 2, 4, 1, 3, 5])
    assert torch.equal(
        fmt.dequantize(fmt.select_rows(fmt.quantize(w), order)),
        fmt.dequantize(fmt.quantize(w))[order],
    )


CHILD = r"""
import json, torch, kt_kernel as kk
n, g = 50, 13  # K = 416
blocks = torch.arange(n * g * 16).remainder(256).to(torch.uint8).reshape(1, n, g, 16)
scales = torch.randint(90, 160, (1, n, g), generator=torch.Generator().manual_seed(0),
                       dtype=torch.uint8)
scales[0, 0] = torch.tensor([0, 1, 2, 126, 127, 128, 253, 254, 0, 1, 2, 3, 4])  # the extremes
out = {"isa": kk.backend_info().isa}
for dtype in (torch.float32, torch.bfloat16):
    fmt = kk.Mxfp4(dtype)
    parts = fmt.from_checkpoint(blocks, scales)
    ref = fmt.dequantize(parts)
    args = list(fmt.native_args(parts))
    same = True
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for r0, c0, rows, cols in ((0, 0, n, 416), (16, 32, 34, 384), (3, 1, 9, 17), (0, 5, 2, 90)):
        got = torch.ops.kt_kernel.dequantize_tile("mxfp4", args, n, 416, r0, c0, rows, cols, dtype)
        want = ref[:, r0:r0 + rows, c0:c0 + cols]
        same &= bool(torch.equal(got.view(bits), want.view(bits)))
    out[str(dtype)] = same
print(json.dumps(out))
"""


@pytest.mark.skipif(not _native(), reason="needs the native extension")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_every_code_and_scale_decodes_bitwise_on_each_isa(isa: str) -> None:
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


@pytest.mark.skipif(not _native(), reason="needs the native extension")
def test_tile_bounds_and_part_checks_are_clear_errors() -> None:
    fmt = kk.Mxfp4(torch.float32)
    args = list(fmt.native_args(fmt.quantize(torch.randn(2, 64, 64))))
    with pytest.raises(ValueError, match=r"out of range of \[64, 64\]"):
        tile("mxfp4", args, 64, 64, 0, 2**63 - 1, 1, 1, torch.float32)
    with pytest.raises(ValueError, match=r"out of range of \[64, 64\]"):
        tile("mxfp4", args, 64, 64, 60, 0, 8, 64, torch.float32)
    with pytest.raises(ValueError, match=r"part 1 \(scales\) must be a contiguous"):
        tile("mxfp4", [args[0], args[1][:, :32]], 64, 64, 0, 0, 1, 1, torch.float32)
    with pytest.raises(TypeError, match=r"part 0 \(blocks\) must be Byte"):
        tile("mxfp4", [args[0].float(), args[1]], 64, 64, 0, 0, 1, 1, torch.float32)
    with pytest.raises(ValueError, match="must be 2 tensors"):
        tile("mxfp4", args[:1], 64, 64, 0, 0, 1, 1, torch.float32)
