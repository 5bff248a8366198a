"""The small-row product of a format (INT4, FP8: weights decoded in registers, no tile).

Tasks of at most ``torch.ops.kt_kernel.gemv_rows()`` rows take it (FP8 only for bf16 on
AVX512_BF16; elsewhere it declines); larger ones dequantise a tile and run a GEMM.
``torch.ops.kt_kernel.project`` computes one expert's product exactly as the op does, so each
row count below, at and above the threshold, with odd N and K, is compared with the float64
product on the format's dequantised weights, on every ISA path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

from ._op_run import op_problem as _op_problem
from ._op_run import run_op as _run_op

FP32_TOL = 1e-5
# One bf16 rounding of each output (2^-8 of it at most) and fp32 sums.
BF16_TOL = 1e-2
# The whole op in bf16 (several roundings in a row): test_conformance's bound.
OP_BF16_TOL = 3e-2

# Run as a script in one subprocess per ISA cap (the cap is read once per process); prints
# the worst relative error per case as JSON.
CHILD = r"""
import json, torch, kt_kernel as kk
torch.manual_seed(0)
ops = torch.ops.kt_kernel
thr = int(ops.gemv_rows())
out = {"isa": kk.backend_info().isa, "threshold": thr, "errors": {}, "fp8_tile_seconds": {}}
# (N, K, group): even, odd N, K not a multiple of 16 or 32, several groups per row, one group
shapes = [(48, 256, 64), (37, 200, 32), (9, 40, 32), (66, 130, 128), (21, 300, 64)]
rows = sorted({1, 2, 7, 8, 9, thr, thr + 1, 2 * thr + 3})
for dtype in (torch.float32, torch.bfloat16):
    for n, k, group in shapes:
        f = kk.Int4Grouped(dtype, group)
        parts = f.quantize(torch.randn(2, n, k))
        wts = f.dequantize(parts).double()
        args = list(f.native_args(parts))
        for m in rows:
            for nn in (False, True):
                x = torch.randn(m, n if nn else k).to(dtype)
                for e in range(2):
                    got = ops.project(f.name, args, n, k, e, x, nn).double()
                    ref = x.double() @ (wts[e] if nn else wts[e].t())
                    err = float((got - ref).abs().max() / ref.abs().max())
                    key = f"{str(dtype)[6:]}/N{n}/K{k}/G{group}/m{m}/{'nn' if nn else 'nt'}"
                    out["errors"][key] = max(out["errors"].get(key, 0.0), err)
    # FP8: 128x128 blocks; N and K odd, below and above one block
    for n, k in [(256, 256), (37, 129), (130, 200), (9, 40)]:
        f = kk.Fp8Block(dtype)
        parts = f.quantize(torch.randn(2, n, k))
        wts = f.dequantize(parts).double()
        args = list(f.native_args(parts))
        for m in rows:
            for nn in (False, True):
                x = torch.randn(m, n if nn else k).to(dtype)
                got = ops.project(f.name, args, n, k, 1, x, nn).double()
                ref = x.double() @ (wts[1] if nn else wts[1].t())
                err = float((got - ref).abs().max() / ref.abs().max())
                key = f"{str(dtype)[6:]}/fp8/N{n}/K{k}/m{m}/{'nn' if nn else 'nt'}"
                out["errors"][key] = err
    # Whether FP8's small-row routine ran in the op or declined: with every task small
    # (threshold 1000), the tile loader's time in the profile is zero only where it ran.
    spec = kk.ExpertSpec(4, 256, 128)
    w = kk.ExpertWeights.from_fused(spec, torch.randn(4, 256, 256), torch.randn(4, 256, 128),
                                    dtype=dtype, weight_dtype="fp8")
    x = torch.randn(8, 256).to(dtype).requires_grad_()
    ids = torch.randint(0, 4, (8, 2))
    ops.set_gemv_rows(1000)
    ops.profile(True)
    kk.moe_experts_forward(x, ids, torch.rand(8, 2), w, None).sum().backward()
    ops.set_gemv_rows(-1)
    prof = dict(zip(*ops.profile(True)))
    out["fp8_tile_seconds"][str(dtype)[6:]] = prof["dequantize"]
print(json.dumps(out))
"""


def _native() -> bool:
    return kk.backend_info().active == "native"


def _tol(case: str) -> float:
    return FP32_TOL if case.startswith("float32/") else BF16_TOL


def _fp8_small_row_runs(isa: str, feats: tuple[str, ...]) -> bool:
    """Whether FP8's small-row routine runs (bf16) under the ISA ``isa`` on this CPU."""
    return isa == "avx512" and "avx512bf16" in feats


def _vdpbf16_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x W^T`` as FP8's bf16 routine sums it: exact products, fp32 sums in its order.

    Per 32 columns, lane j of 16 adds the product of column 2j + 1, then of 2j (vdpbf16ps);
    the lanes are then summed as GCC's _mm512_reduce_add_ps does (halves, quarters, pairs).
    x bf16 [m, K], w bf16 [N, K] -> bf16 [m, N].
    """
    m, k = x.shape
    k32 = (k + 31) // 32 * 32
    xf = torch.zeros(m, 1, k32)
    xf[..., :k] = x.float()[:, None]
    wf = torch.zeros(1, w.shape[0], k32)
    wf[..., :k] = w.float()
    acc = torch.zeros(m, w.shape[0], 16)
    for c in range(0, k32, 32):
        p = (xf[..., c : c + 32] * wf[..., c : c + 32]).unflatten(-1, (16, 2))  # exact in fp32
        acc = acc + p[..., 1]
        acc = acc + p[..., 0]
    acc = acc[..., 8:] + acc[..., :8]
    acc = acc[..., 4:] + acc[..., :4]
    acc = acc + acc[..., [2, 3, 0, 1]]
    return (acc[..., 0] + acc[..., 1]).to(torch.bfloat16)


def _vdpbf16_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dy W`` as FP8's bf16 routine sums it: per output, row pairs in order, 2i + 1 first.

    x bf16 [m, N], w bf16 [N, K] -> bf16 [m, K].
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
    default = int(ops.gemv_rows())
    assert default == int(os.environ.get("KT_KERNEL_GEMV_ROWS", 24))
    try:
        ops.set_gemv_rows(3)
        assert int(ops.gemv_rows()) == 3
    finally:
        ops.set_gemv_rows(-1)  # back to the built-in default
    assert int(ops.gemv_rows()) == 24


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nn", [False, True], ids=["x_Wt", "dy_W"])
def test_both_paths_match_the_dequantized_product(fmt: str, dtype: torch.dtype, nn: bool) -> None:
    """The same rows through the small-row routine (threshold high) and tile + GEMM (0)."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    n, k = 45, 176  # odd N; K a multiple of 16 but not of 32
    f = kk.Int4Grouped(dtype, 32) if fmt == "int4" else kk.Fp8Block(dtype)
    parts = f.quantize(torch.randn(3, n, k))
    wts = f.dequantize(parts).double()
    args = list(f.native_args(parts))
    x = torch.randn(11, n if nn else k).to(dtype)
    ref = x.double() @ (wts[2] if nn else wts[2].t())
    got = {}
    try:
        for rows in (0, 1000):
            ops.set_gemv_rows(rows)
            got[rows] = ops.project(f.name, args, n, k, 2, x, nn).double()
    finally:
        ops.set_gemv_rows(-1)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for rows, y in got.items():
        assert y.shape == ref.shape
        err = float((y - ref).abs().max() / ref.abs().max())
        assert err < tol, (rows, err)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("int4", torch.float32), ("int4", torch.bfloat16), ("fp8", torch.bfloat16)],
    ids=["int4-fp32", "int4-bf16", "fp8-bf16"],
)
def test_op_matches_reference_with_and_without_the_small_row_path(
    fmt: str, dtype: torch.dtype
) -> None:
    """The whole op (forward, dx, d topk_weights, LoRA gradients), both routes, vs the oracle.

    fp32: the reference on the dequantised weights within 1e-5. bf16: the float64 reference
    on exactly the bf16 values the kernel holds, within test_conformance's bf16 bound (3e-2).
    """
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    weights, lora, x, ids, tw, dy = _op_problem(fmt, dtype)
    deq = weights.dequantized()
    if dtype == torch.float32:
        ref = _run_op(deq, lora, x, ids, tw, dy, "reference")
        tol = FP32_TOL
    else:
        w64 = kk.ExpertWeights.from_fused(weights.spec, deq.gate_up, deq.down, dtype=torch.float64)
        lora64 = kk.LoraBuffers(weights.spec, 4, 8.0, "fused", dtype=torch.float64)
        with torch.no_grad():
            for (_, a), (_, b) in zip(
                lora64.named_parameters(), lora.named_parameters(), strict=True
            ):
                a.copy_(b.to(dtype))
        ref = _run_op(w64, lora64, x.double(), ids, tw, dy.double(), "reference")
        tol = OP_BF16_TOL
    try:
        for rows in (0, 8, 1000):  # tile only; mixed (tasks of 8 rows take it); always
            ops.set_gemv_rows(rows)
            for a, b in zip(_run_op(weights, lora, x, ids, tw, dy, "native"), ref, strict=True):
                err = float((a.double() - b).abs().max() / b.abs().max())
                assert err < tol, (rows, err)
    finally:
        ops.set_gemv_rows(-1)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_small_row_op_is_bitwise_across_thread_counts(fmt: str) -> None:
    """Every task through the small-row routine (bf16): 1 and 3 kernel threads, same bits."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    problem = _op_problem(fmt, torch.bfloat16)
    got = {}
    try:
        ops.set_gemv_rows(1000)
        for threads in (1, 3):
            kk.set_num_threads(threads)
            got[threads] = _run_op(*problem, "native")
    finally:
        kk.set_num_threads(None)
        ops.set_gemv_rows(-1)
    for a, b in zip(got[1], got[3], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nn", [False, True], ids=["x_Wt", "dy_W"])
def test_fp8_small_row_sums_exact_products_in_a_fixed_order(nn: bool) -> None:
    """FP8's bf16 routine is bitwise the exact bf16 products of the tile loader's weights and
    the rows, summed in fp32 in the order _vdpbf16_nt/_nn give (the only difference from tile
    + GEMM, whose fp32 sums run in oneDNN's order)."""
    feats = kk.backend_info().cpu_features
    if not _native() or not _fp8_small_row_runs(kk.backend_info().isa, feats):
        pytest.skip("FP8's small-row routine runs on AVX512_BF16 only")
    ops = torch.ops.kt_kernel
    gen = torch.Generator().manual_seed(7)
    f = kk.Fp8Block(torch.bfloat16)
    try:
        ops.set_gemv_rows(1000)
        for n, k in [(256, 256), (37, 129), (130, 200), (9, 40), (45, 176)]:
            parts = f.quantize(torch.randn(2, n, k, generator=gen))
            w = f.dequantize(parts)[1]
            args = list(f.native_args(parts))
            for m in (1, 2, 7, 8, 9, 16, 17, 24):
                x = torch.randn(m, n if nn else k, generator=gen).to(torch.bfloat16)
                got = ops.project(f.name, args, n, k, 1, x, nn)
                want = _vdpbf16_nn(x, w) if nn else _vdpbf16_nt(x, w)
                assert torch.equal(got, want), (n, k, m)
    finally:
        ops.set_gemv_rows(-1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_each_isa_path_matches_the_dequantized_product(isa: str) -> None:
    feats = kk.backend_info().cpu_features
    if not _native():
        pytest.skip("needs the native extension")
    if isa == "avx512" and "avx512f" not in feats:
        pytest.skip("this CPU has no AVX-512")
    if isa == "avx2" and "avx2" not in feats:
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, OMP_NUM_THREADS="1", KT_KERNEL_ISA=isa)
    env.pop("KT_KERNEL_GEMV_ROWS", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=280
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["isa"] == isa
    # Row counts on both sides of the threshold were run.
    thr = res["threshold"]
    ms = {int(c.split("/m")[1].split("/")[0]) for c in res["errors"] if "/fp8/" not in c}
    assert any(m <= thr for m in ms)
    assert any(m > thr for m in ms)
    worst = {c: e for c, e in res["errors"].items() if e >= _tol(c)}
    assert not worst, worst
    # FP8's routine runs for bf16 on AVX512_BF16 only; it declines fp32 and every lower cap,
    # and the op then takes tile + GEMM (the loader's time shows in the profile).
    tile = res["fp8_tile_seconds"]
    assert tile["float32"] > 0
    if _fp8_small_row_runs(isa, feats):
        assert tile["bfloat16"] == 0
    else:
        assert tile["bfloat16"] > 0


@pytest.mark.parametrize("flush_denormal", [False, True], ids=["ieee", "flush_denormal"])
def test_fp8_small_row_decodes_every_byte_as_the_tile_loader(flush_denormal: bool) -> None:
    """Every finite E4M3 byte (subnormals, +-0, +-448) under tiny and large block scales: one-hot
    rows through the small-row routine give the loader's bf16 weights bitwise, also with
    denormals flushed (its fp16 widening never makes an fp32 denormal); a NaN byte gives NaN."""
    feats = kk.backend_info().cpu_features
    if not _native() or not _fp8_small_row_runs(kk.backend_info().isa, feats):
        pytest.skip("FP8's small-row routine runs on AVX512_BF16 only")
    ops = torch.ops.kt_kernel
    n, k = 130, 256  # each row: every byte, shifted by its index; two block rows and columns
    f = kk.Fp8Block(torch.bfloat16)
    byte = (torch.arange(k)[None] + torch.arange(n)[:, None]) % 256
    byte[(byte & 0x7F) == 0x7F] = 0x7E  # NaN would spread over a whole product: checked below
    weight = byte.to(torch.uint8).view(torch.float8_e4m3fn)[None].repeat(2, 1, 1)
    scale = torch.tensor([[[2.0**-100, 3.5e-3], [7.0, 2.0**100]]]).repeat(2, 1, 1)
    want = f.dequantize((weight, scale))[1]
    args = list(f.native_args((weight, scale)))
    nan_weight = weight.clone()
    nan_weight.view(torch.uint8)[1, 5, 200] = 0xFF
    nan_args = list(f.native_args((nan_weight, scale)))
    try:
        ops.set_gemv_rows(1000)
        if flush_denormal and not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush denormals")
        eye = torch.eye(k).to(torch.bfloat16)
        got = torch.cat(
            [ops.project(f.name, args, n, k, 1, eye[c : c + 24], False) for c in range(0, k, 24)]
        ).t()
        nan_out = ops.project(f.name, nan_args, n, k, 1, torch.ones(3, k).bfloat16(), False)
    finally:
        torch.set_flush_denormal(False)
        ops.set_gemv_rows(-1)
    assert torch.equal(got, want)
    assert nan_out[:, 5].isnan().all()
    assert not nan_out[:, :5].isnan().any()


def test_fp8_small_row_declines_scales_it_cannot_shift() -> None:
    """A block scale >= 2^119 (s * 2^8 would overflow; no real checkpoint has one): the op
    takes tile + GEMM, so the result is finite and equal to it bitwise."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    f = kk.Fp8Block(torch.bfloat16)
    weight = torch.full((1, 40, 64), 2.0**-9).to(torch.float8_e4m3fn)  # the least subnormal
    args = list(f.native_args((weight, torch.full((1, 1, 1), 2.0**125))))
    x = torch.rand(5, 64).bfloat16()
    got = {}
    try:
        for rows in (0, 1000):
            ops.set_gemv_rows(rows)
            got[rows] = ops.project(f.name, args, 40, 64, 0, x, False)
    finally:
        ops.set_gemv_rows(-1)
    assert torch.isfinite(got[1000]).all()
    assert torch.equal(got[1000], got[0])
