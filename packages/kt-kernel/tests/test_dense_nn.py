"""The dense bf16 small-row "nn" product (dx = dgu W_gu, dh = dy W_down) on AVX512_BF16.

Tasks of at most ``torch.ops.kt_kernel.dense_nn_rows()`` rows run it instead of oneDNN's GEMM
when K is a multiple of 64 (strips of W of up to 256 columns, the last 64-192). Oracles: the
exact bf16 products summed in fp32 in the routine's order (bitwise), the float64 product, and
the float64 reference op.
"""

from __future__ import annotations

import os

import pytest
import torch

import kt_kernel as kk

BF16_TOL = 1e-2  # one bf16 rounding of each output and fp32 sums
OP_BF16_TOL = 3e-2  # the whole op in bf16: test_conformance's bound


def _native() -> bool:
    return kk.backend_info().active == "native"


def _routine_runs() -> bool:
    info = kk.backend_info()
    return _native() and info.isa == "avx512" and "avx512bf16" in info.cpu_features


def _vdpbf16_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x W`` as vdpbf16ps sums it: per output, row pairs of W in order, row 2i + 1 first.

    x bf16 [m, N], w bf16 [N, K] -> bf16 [m, K] (exact products, fp32 sums, one rounding).
    """
    acc = torch.zeros(x.shape[0], w.shape[1])
    for i in range(0, w.shape[0], 2):
        for j in (i + 1, i):
            if j < w.shape[0]:
                acc = acc + x[:, j, None].float() * w[None, j].float()
    return acc.to(torch.bfloat16)


def test_threshold_default_and_setter() -> None:
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    assert int(ops.dense_nn_rows()) == int(os.environ.get("KT_KERNEL_DENSE_NN_ROWS", 128))
    try:
        ops.set_dense_nn_rows(3)
        assert int(ops.dense_nn_rows()) == 3
    finally:
        ops.set_dense_nn_rows(-1)
    assert int(ops.dense_nn_rows()) == 128


def test_routine_sums_exact_products_in_a_fixed_order() -> None:
    """Bitwise the oracle's order: odd N (last row paired with zero), one strip, several, a
    64-192-column tail strip, every register-row remainder. Up to N = 1000 oneDNN's GEMM gives
    the same bits; at N = 1536 (last case, torch 2.13) it splits N and some outputs differ, so
    there this test also fails if the op's product does not take the routine."""
    if not _routine_runs():
        pytest.skip("the dense nn routine runs on AVX512_BF16 only")
    ops = torch.ops.kt_kernel
    gen = torch.Generator().manual_seed(11)
    try:
        ops.set_dense_nn_rows(1000)
        for n, k in [(37, 320), (66, 256), (9, 64), (48, 448), (130, 128), (1, 192)]:
            w = torch.randn(2, n, k, generator=gen).to(torch.bfloat16)
            for m in (1, 2, 5, 6, 7, 12, 13, 64):
                x = torch.randn(m, n, generator=gen).to(torch.bfloat16)
                got = ops.project("dense", [w], n, k, 1, x, True)
                assert torch.equal(got, _vdpbf16_nn(x, w[1])), (n, k, m)
        w = torch.randn(1, 1536, 256, generator=gen).to(torch.bfloat16)
        x = torch.randn(64, 1536, generator=gen).to(torch.bfloat16)
        got = ops.project("dense", [w], 1536, 256, 0, x, True)
        assert torch.equal(got, _vdpbf16_nn(x, w[0]))
    finally:
        ops.set_dense_nn_rows(-1)


@pytest.mark.parametrize("rows", [0, 1000, -1], ids=["gemm", "routine", "default"])
def test_product_matches_float64_on_every_route(rows: int) -> None:
    """Both routes (and K not a multiple of 64, which always takes the GEMM) vs float64."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    gen = torch.Generator().manual_seed(12)
    try:
        ops.set_dense_nn_rows(rows)
        for n, k in [(37, 320), (40, 100), (17, 64)]:
            w = torch.randn(2, n, k, generator=gen).to(torch.bfloat16)
            for m in (1, 7, 64, 129, 130):
                x = torch.randn(m, n, generator=gen).to(torch.bfloat16)
                got = ops.project("dense", [w], n, k, 0, x, True).double()
                ref = x.double() @ w[0].double()
                err = float((got - ref).abs().max() / ref.abs().max())
                assert err < BF16_TOL, (n, k, m, err)
    finally:
        ops.set_dense_nn_rows(-1)


def _op_problem():
    """bf16 weights (H = 128, I = 64: both nn products take the routine), LoRA and inputs."""
    gen = torch.Generator().manual_seed(13)
    spec = kk.ExpertSpec(4, 128, 64)
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.randn(4, 128, 128, generator=gen) / 128**0.5,
        torch.randn(4, 128, 64, generator=gen) / 64**0.5,
        dtype=torch.bfloat16,
    )
    lora = kk.LoraBuffers(spec, 4, 8.0, "fused")
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.normal_(0, 0.2, generator=gen)
    tokens = 40
    x = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, 4, generator=gen).topk(2, -1).indices
    tw = torch.rand(tokens, 2, generator=gen)
    dy = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16)
    return weights, lora, x, ids, tw, dy


def _run_op(weights, lora, x, ids, tw, dy, backend: str) -> list[torch.Tensor]:
    """y, dx, d topk_weights and the LoRA gradients of one forward + backward."""
    xg, wg = x.clone().requires_grad_(), tw.clone().requires_grad_()
    for p in lora.parameters():
        p.grad = None
    y = kk.moe_experts_forward(xg, ids, wg, weights, lora, backend=backend)
    y.backward(dy)
    return [t.detach() for t in [y, xg.grad, wg.grad, *[p.grad for p in lora.parameters()]]]


def test_op_matches_float64_reference_on_both_routes() -> None:
    """Forward, dx, d topk_weights and LoRA gradients vs the float64 reference op."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    weights, lora, x, ids, tw, dy = _op_problem()
    w64 = kk.ExpertWeights.from_fused(
        weights.spec, weights.gate_up, weights.down, dtype=torch.float64
    )
    lora64 = kk.LoraBuffers(weights.spec, 4, 8.0, "fused", dtype=torch.float64)
    with torch.no_grad():
        for (_, a), (_, b) in zip(lora64.named_parameters(), lora.named_parameters(), strict=True):
            a.copy_(b.to(torch.bfloat16))
    ref = _run_op(w64, lora64, x.double(), ids, tw, dy.double(), "reference")
    try:
        for rows in (0, 1000):
            ops.set_dense_nn_rows(rows)
            got = _run_op(weights, lora, x, ids, tw, dy, "native")
            for a, b in zip(got, ref, strict=True):
                err = float((a.double() - b).abs().max() / b.abs().max())
                assert err < OP_BF16_TOL, (rows, err)
    finally:
        ops.set_dense_nn_rows(-1)


def test_op_with_the_routine_is_bitwise_across_thread_counts() -> None:
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    problem = _op_problem()
    got = {}
    try:
        ops.set_dense_nn_rows(1000)
        for threads in (1, 3):
            kk.set_num_threads(threads)
            got[threads] = _run_op(*problem, "native")
    finally:
        kk.set_num_threads(None)
        ops.set_dense_nn_rows(-1)
    for a, b in zip(got[1], got[3], strict=True):
        assert torch.equal(a, b)
