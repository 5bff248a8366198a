"""INT4 group-wise base: packing, quantisation bounds, memory, native tiles and the op.

The shared suites cover the rest: test_conformance (every activation x bias, fp32/bf16,
bitwise across thread counts) and test_isa (each ISA path against the oracle and its tiles
bitwise against ``dequantize``) run ``"int4"`` because it is registered in ``kk.FORMATS``.
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk
from kt_kernel.formats_int4 import INT4_GROUP_SIZES, pack_int4, unpack_int4

tile = torch.ops.kt_kernel.dequantize_tile


def _native() -> bool:
    return kk.backend_info().active == "native"


def test_pack_layout_and_round_trip() -> None:
    q = torch.randint(-8, 8, (2, 5, 9), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (2, 3, 9)
    assert packed.dtype == torch.uint8
    # byte [p, k]: row 2p in the low nibble, row 2p + 1 in the high one, each as q + 8.
    assert int(packed[1, 1, 4]) == (int(q[1, 2, 4]) + 8) | ((int(q[1, 3, 4]) + 8) << 4)
    assert int(packed[0, 2, 0]) == (int(q[0, 4, 0]) + 8) | (8 << 4)  # odd N: padding row = 0
    assert torch.equal(unpack_int4(packed, 5), q)


@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
def test_quantise_error_within_half_step_and_zero_groups_exact(group: int) -> None:
    fmt = kk.Int4Grouped(torch.float32, group_size=group)
    w = torch.randn(3, 10, 300)
    w[0, 2, :group] = 0.0  # an all-zero group
    packed, scale = fmt.quantize(w)
    assert scale.shape == (3, 10, -(-300 // group))
    assert scale.dtype == torch.bfloat16
    deq = fmt.dequantize((packed, scale))
    assert deq.shape == w.shape
    assert deq.dtype == torch.float32
    step = scale.float().repeat_interleave(group, dim=-1)[..., :300]
    # Half a step, plus the bf16 rounding of the scale: amax / scale <= 7 * (1 + 2^-8).
    assert bool(((deq - w).abs() <= step * (0.5 + 7 * 2**-8) + 1e-7).all())
    assert bool((deq[0, 2, :group] == 0).all())
    q = unpack_int4(packed, 10)
    assert int(q.abs().max()) <= 7


def test_expert_memory_at_most_030_of_bf16() -> None:
    spec = kk.ExpertSpec(4, 256, 128)
    gate_up, down = torch.randn(4, 256, 256), torch.randn(4, 256, 128)
    w4 = kk.ExpertWeights.from_fused(spec, gate_up, down, weight_dtype="int4")
    w16 = kk.ExpertWeights.from_fused(spec, gate_up, down, dtype=torch.bfloat16)
    ratio = w4.nbytes / w16.nbytes
    # 1/2 byte per weight + one bf16 scale per 64: (0.5 + 2/64) / 2 = 0.2656.
    assert ratio == pytest.approx(0.25 + 1 / 64)
    assert ratio <= 0.30
    # fp32 source -> fp32 compute by default (resolve_format's rule for every format).
    assert w4.weight_dtype == "int4"
    assert w4.dtype == torch.float32
    assert w4.format == kk.Int4Grouped(torch.float32, 64)
    rep = w4.quantization_report()
    for proj in (rep.gate, rep.up, rep.down):
        assert 0 < proj.max_abs_error <= proj.max_step * (0.5 + 7 * 2**-8)


@pytest.mark.skipif(not _native(), reason="needs the native extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
def test_native_tiles_bitwise_equal_dequantize(group: int, dtype: torch.dtype) -> None:
    fmt = kk.Int4Grouped(dtype, group_size=group)
    n, k = 37, 150  # odd N (a padding row), K neither a multiple of 16 nor of the group
    parts = fmt.quantize(torch.randn(2, n, k))
    ref = fmt.dequantize(parts)
    args = list(fmt.native_args(parts))
    for r0, c0, rows, cols in ((0, 0, n, k), (16, 0, 21, k), (0, 16, n, 134), (1, 3, 5, 77)):
        got = tile(fmt.name, args, n, k, r0, c0, rows, cols, dtype)
        assert torch.equal(got, ref[:, r0 : r0 + rows, c0 : c0 + cols]), (r0, c0, rows, cols)


@pytest.mark.skipif(not _native(), reason="needs the native extension")
@pytest.mark.parametrize("group", [32, 128])
def test_other_group_sizes_match_reference(kt, group: int) -> None:
    # The default group (64) runs through the shared conformance suite; the others here.
    spec = kk.ExpertSpec(6, 64, 40)
    gen = torch.Generator().manual_seed(group)
    w = kk.ExpertWeights.from_fused(
        spec,
        torch.randn(6, 80, 64, generator=gen) / 8,
        torch.randn(6, 64, 40, generator=gen) / 40**0.5,
        weight_dtype=kk.Int4Grouped(torch.float32, group_size=group),
    )
    lora = kk.LoraBuffers(spec, 4, 8.0, "split")
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(20, 64, generator=gen)
    ids = kt.random_ids(20, 2, 6, gen)
    tw = torch.rand(ids.shape, generator=gen)
    dy = torch.randn(20, 64, generator=gen)
    nat = kt.run(kt.Problem(spec, w, lora, x, ids, tw, dy), "native")
    ref = kt.run(kt.Problem(spec, w.dequantized(), lora, x, ids, tw, dy), "reference")
    for name in ref:
        assert kt.rel_err(nat[name], ref[name]) < 1e-5, name


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(kk.KernelInputError, match=r"group_size must be one of \(32, 64, 128\)"):
        kk.Int4Grouped(torch.bfloat16, group_size=48)
    with pytest.raises(kk.KernelDTypeError, match="compute dtype"):
        kk.Int4Grouped(torch.float16)
    with pytest.raises(kk.KernelInputError, match="NaN or inf"):
        kk.Int4Grouped().quantize(torch.tensor([[1.0, float("nan")]]))
    spec = kk.ExpertSpec(2, 64, 32)
    fmt = kk.Int4Grouped(torch.bfloat16)
    good_gu = fmt.quantize(torch.randn(2, 64, 64))
    good_dn = fmt.quantize(torch.randn(2, 64, 32))
    with pytest.raises(kk.KernelInputError, match=r"down\.scale must be torch\.bfloat16"):
        kk.ExpertWeights.from_parts(spec, fmt, good_gu, (good_dn[0], good_dn[1].float()))
    bad = r"gate_up\.packed must be torch\.uint8 \[2, 32, 64\]"
    with pytest.raises(kk.KernelInputError, match=bad):
        kk.ExpertWeights.from_parts(spec, fmt, (good_gu[0][:, :16], good_gu[1]), good_dn)
