"""``int8-packed-a8``: int8-packed's storage, its products W8A8 on AMX-INT8 tiles.

Where the CPU has AMX-INT8 tiles, both products quantise their input rows to int8 and
multiply on int8 tiles; the values are defined exactly (``csrc/format_int8_packed.cpp``) and
modelled here in torch: the int32 sums exact (int64 here), every other step one fp32 operation.
Elsewhere (or with ``KT_KERNEL_AMX=0``) the products are int8-packed's, bitwise. The whole op
runs it in the per-format conformance suite by its registration.
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk


def _amx_int8() -> bool:
    """Whether the kernel runs AMX-INT8 tiles here."""
    return kk.Int8PackedA8.own_products_here()


needs_amx_int8 = pytest.mark.skipif(not _amx_int8(), reason="no AMX-INT8 tiles here")
SHAPES = [(48, 64), (40, 100), (37, 7), (16, 32), (200, 1408), (1536, 2048)]
ROWS = (1, 15, 16, 17, 33, 100, 128, 150)


def _quantised_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: round-to-even(v * (127 / amax)) as int64, and amax / 127 (fp32; 0 rows stay 0)."""
    amax = v.abs().amax(1)
    q = torch.round(v * (torch.full_like(amax, 127.0) / amax)[:, None]).clamp(-127, 127)
    q = torch.where(amax[:, None] > 0, q, torch.zeros_like(q))
    return q.long(), amax / 127.0


def _model(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, nn: bool) -> torch.Tensor:
    """The W8A8 product of bf16 ``x`` and int8 ``q [N, K]`` with row scales ``s``, in bf16."""
    if nn:
        vq, sv = _quantised_rows(x.float() * s[None, :])
        return ((vq @ q.long()).float() * sv[:, None]).bfloat16()
    xq, sx = _quantised_rows(x.float())
    return (((xq @ q.long().t()).float() * sx[:, None]) * s[None, :]).bfloat16()


@needs_amx_int8
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_products_are_the_w8a8_model_bitwise(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(3, n, k, generator=gen)
    parts = kk.Int8Packed().quantize(w)
    q, s = kk.Int8PerChannel().quantize(w)
    args = list(kk.Int8Packed().native_args(parts))
    for m in ROWS:
        for nn in (False, True):
            e = m % 3
            x = torch.randn(m, n if nn else k, generator=gen).bfloat16()
            if m > 3:
                x[2] = 0  # a zero row: scale 0, no division by zero
            got = torch.ops.kt_kernel.project("int8_packed_a8", args, n, k, e, x, nn)
            assert torch.equal(got, _model(x, q[e], s[e], nn)), (m, nn)


@needs_amx_int8
def test_the_activations_rounding_is_what_sets_the_error() -> None:
    # Against the exact product of the dequantised weights, W8A8 errs more than bf16 rounding
    # but within int8's step: the tests above pin the values; this pins their meaning.
    gen = torch.Generator().manual_seed(1)
    n, k, m = 256, 512, 64
    w = torch.randn(1, n, k, generator=gen) / k**0.5
    parts = kk.Int8Packed().quantize(w)
    args = list(kk.Int8Packed().native_args(parts))
    wd = kk.Int8Packed().dequantize(parts, torch.float32)[0].double()
    x = torch.randn(m, k, generator=gen).bfloat16()
    exact = x.double() @ wd.t()
    got = torch.ops.kt_kernel.project("int8_packed_a8", args, n, k, 0, x, False).double()
    err = ((got - exact).norm() / exact.norm()).item()
    assert 2e-3 < err < 2e-2


def mismatches() -> list[list[int]]:
    """``[n, k, m, nn]`` where int8-packed-a8's product is not int8-packed's bitwise."""
    bad = []
    for n, k in SHAPES[:4]:
        w = torch.randn(2, n, k, generator=torch.Generator().manual_seed(n + k))
        args = list(kk.Int8Packed().native_args(kk.Int8Packed().quantize(w)))
        for m in ROWS:
            for nn in (False, True):
                x = torch.randn(m, n if nn else k, generator=torch.Generator().manual_seed(m))
                x = x.bfloat16()
                a8 = torch.ops.kt_kernel.project("int8_packed_a8", args, n, k, 1, x, nn)
                base = torch.ops.kt_kernel.project("int8_packed", args, n, k, 1, x, nn)
                if not torch.equal(a8, base):
                    bad.append([n, k, m, int(nn)])
    return bad


def test_without_amx_int8_the_products_are_int8_packeds() -> None:
    if kk.backend_info().active != "native":
        pytest.skip("needs the native extension")
    if not _amx_int8():
        assert mismatches() == []
        return
    from ._isa_child import child_mismatches

    amx, bad = child_mismatches(
        "test_int8_packed_a8", {"KT_KERNEL_AMX": "0"}, "torch.ops.kt_kernel.amx()"
    )
    assert amx is False
    assert bad == []
    assert mismatches() != []  # with AMX-INT8 they differ: the check can fail
