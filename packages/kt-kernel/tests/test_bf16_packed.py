"""The bf16-packed format: bf16 weights stored once in the layout the native products stream.

The layout and its inverse are checked element by element; the native tile loader against the
Python ``dequantize`` bitwise; the two products against exact-order float32 models of the
vdpbf16ps sums bitwise (where they run) and against the float64 product everywhere; the whole
op through both routes against the oracle. The per-format conformance suite
(test_conformance) runs it with every activation as well, by its registration.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

from ._op_run import op_problem
from ._op_run import run_op as _run
from ._packed_order import ROWS, SHAPES
from ._packed_order import mismatches as order_mismatches
from ._packed_order import weights as _weights

BF16_TOL = 1e-2  # one bf16 rounding of each output and fp32 sums
OP_BF16_TOL = 3e-2  # the whole op in bf16: test_conformance's bound


def _native() -> bool:
    return kk.backend_info().active == "native"


def _products_run() -> bool:
    info = kk.backend_info()
    return _native() and info.isa == "avx512" and "avx512bf16" in info.cpu_features


def test_layout_places_each_weight_and_unpacks_exactly() -> None:
    w = _weights(32, 6)
    packed, shape = kk.Bf16Packed().quantize(w)
    assert packed.shape == (2, 2, 16 * 6 + 32)
    assert packed.dtype == torch.bfloat16
    assert shape.tolist() == [[32, 6], [32, 6]]
    for b in range(2):
        for p in range(3):
            for row in range(16):
                for h in range(2):
                    got = packed[1, b, p * 32 + (row // 2) * 4 + h * 2 + row % 2]
                    assert torch.equal(got, w[1, 16 * b + row, 2 * p + h])
    assert not packed[..., 16 * 6 :].any()  # the pad is zeros
    assert torch.equal(kk.Bf16Packed().dequantize((packed, shape)), w)
    assert torch.equal(kk.Bf16Packed().dequantize((packed, shape), torch.float32), w.float())


def test_shapes_off_the_blocks_are_padded_with_zeros() -> None:
    w = _weights(21, 7)  # a partial block of 5 rows, an odd K
    packed, shape = kk.Bf16Packed().quantize(w)
    assert packed.shape == (2, 2, 16 * 8 + 32)
    assert torch.equal(kk.Bf16Packed().dequantize((packed, shape)), w)
    assert int(packed.float().abs().gt(0).sum()) == int(w.float().abs().gt(0).sum())


def test_compute_dtypes_other_than_bf16_are_refused_by_name() -> None:
    with pytest.raises(kk.KernelDTypeError, match=r"must be torch\.bfloat16, got torch\.float32"):
        kk.Bf16Packed(torch.float32)
    with pytest.raises(kk.KernelDTypeError, match=r"must be torch\.bfloat16"):
        kk.ExpertWeights.from_fused(
            kk.ExpertSpec(2, 32, 16),
            torch.randn(2, 32, 32),
            torch.randn(2, 32, 16),
            dtype=torch.float32,
            weight_dtype="bf16-packed",
        )


def test_select_rows_and_fuse_gate_up_move_whole_rows() -> None:
    f = kk.Bf16Packed()
    gate, up = _weights(16, 8, seed=1), _weights(16, 8, seed=2)
    fused = f.fuse_gate_up(f.quantize(gate), f.quantize(up))
    assert torch.equal(f.dequantize(fused), torch.cat([gate, up], dim=1))
    index = torch.arange(32).flip(0)
    both = torch.cat([gate, up], 1)
    assert torch.equal(f.dequantize(f.select_rows(fused, index)), both[:, index])


# The packed formats with products of their own; int8-packed and int4-packed run theirs on AMX.
PACKED = ["bf16-packed", "int8-packed", "int4-packed"]


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tile_loader_is_the_python_dequantize(dtype: torch.dtype, fmt: str) -> None:
    if not _native():
        pytest.skip("needs the native extension")
    f = kk.FORMATS[fmt](torch.bfloat16)
    n, k = 48, 70
    parts = f.quantize(_weights(n, k))
    full = f.dequantize(parts, dtype)
    args = list(f.native_args(parts))
    for row0, col0, rows, cols in [(0, 0, n, k), (16, 0, 32, k), (0, 16, n, 54), (32, 33, 5, 3)]:
        got = torch.ops.kt_kernel.dequantize_tile(f.name, args, n, k, row0, col0, rows, cols, dtype)
        assert torch.equal(got, full[:, row0 : row0 + rows, col0 : col0 + cols])


def test_products_are_the_exact_order_model_bitwise() -> None:
    """Where they run, the products equal exact bf16 products summed in fp32 in their order."""
    if not _products_run():
        pytest.skip("the packed products run on AVX512_BF16 only")
    assert order_mismatches() == []


def test_products_without_amx_are_the_exact_order_model_bitwise() -> None:
    """With AMX tiles switched off (KT_KERNEL_AMX=0, in a child), every row count takes the
    vdpbf16ps products, both of dy W's orders included: each bitwise its model."""
    if not _products_run():
        pytest.skip("the packed products run on AVX512_BF16 only")
    if not torch.ops.kt_kernel.amx():
        pytest.skip("no AMX tiles here: the test above covers every row count in process")
    from ._isa_child import child_mismatches

    off = {"KT_KERNEL_AMX": "0"}
    amx, bad = child_mismatches("_packed_order", off, "torch.ops.kt_kernel.amx()")
    assert amx is False, "KT_KERNEL_AMX=0 still ran AMX tiles"
    assert bad == []


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("nn", [False, True], ids=["x_Wt", "dy_W"])
def test_both_routes_match_the_float64_product(nn: bool, fmt: str) -> None:
    """The products (any row count) and tile + GEMM (small-row products off) vs float64."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    f = kk.FORMATS[fmt](torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    try:
        for n, k in SHAPES:
            parts = f.quantize(_weights(n, k))
            w = f.dequantize(parts)[0].double()
            args = list(f.native_args(parts))
            # AMX: 1, 2, 3, 5 and 10 row tiles of 32; 16, 40, 144 and 300 end in one of 16 rows
            for m in (*ROWS, 40, 96, 144, 300):
                x = torch.randn(m, n if nn else k, generator=gen).to(torch.bfloat16)
                ref = x.double() @ (w if nn else w.t())
                for rows in (0, -1):
                    ops.set_gemv_rows(rows)
                    got = ops.project(f.name, args, n, k, 0, x, nn).double()
                    err = float((got - ref).abs().max() / ref.abs().max())
                    assert err < BF16_TOL, (n, k, m, rows, err)
    finally:
        ops.set_gemv_rows(-1)


def _problem(seed: int = 3, fmt: str = "bf16-packed"):
    """The shared small op problem (gate_up N=160, down N=96: whole and partial blocks)."""
    return op_problem(fmt, torch.bfloat16, seed)


def _oracle(weights, lora, x, ids, tw, dy) -> list[torch.Tensor]:
    """The float64 reference op on the packed weights' values and the bf16-rounded LoRA."""
    deq = weights.dequantized()
    w64 = kk.ExpertWeights.from_fused(weights.spec, deq.gate_up, deq.down, dtype=torch.float64)
    lora64 = kk.LoraBuffers(weights.spec, 4, 8.0, "fused", dtype=torch.float64)
    with torch.no_grad():
        for (_, a), (_, b) in zip(lora64.named_parameters(), lora.named_parameters(), strict=True):
            a.copy_(b.to(torch.bfloat16))
    return _run(w64, lora64, x.double(), ids, tw, dy.double(), "reference")


@pytest.mark.parametrize("fmt", PACKED)
def test_op_matches_the_float64_oracle_through_both_routes(fmt: str) -> None:
    """About 20 rows per expert: AMX tiles where the CPU has them, else the other routes."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    weights, lora, x, ids, tw, dy = _problem(fmt=fmt)
    deq = weights.dequantized()
    assert deq.weight_dtype == "bf16"
    ref = _oracle(weights, lora, x, ids, tw, dy)
    # The same values as dense bf16: the two agree as closely as each agrees with ref.
    dense = _run(deq, lora, x, ids, tw, dy)
    try:
        for rows in (0, -1):
            ops.set_gemv_rows(rows)
            got = _run(weights, lora, x, ids, tw, dy)
            for a, b, d in zip(got, ref, dense, strict=True):
                err = float((a.double() - b).abs().max() / b.abs().max())
                assert err < OP_BF16_TOL, (rows, err)
                assert float((a.double() - d.double()).abs().max() / b.abs().max()) < OP_BF16_TOL
    finally:
        ops.set_gemv_rows(-1)


def test_rows_are_padded_only_where_onednn_runs_the_products() -> None:
    """No padding rows where the format's own routines run every product; 16 where oneDNN does.

    The padding bounds oneDNN's per-shape primitives; on the own routines it was pure waste (a
    17-row expert took 32 rows of work). Small-row products off routes the products to tile +
    oneDNN, and the padding comes back.
    """
    if not _products_run():
        pytest.skip("needs the native products (AVX512_BF16)")
    ops = torch.ops.kt_kernel
    weights, lora, x, ids, tw, _ = _problem()
    counts = torch.bincount(ids.flatten(), minlength=4)
    args = weights.native_args()
    factors = [p.detach().to(torch.bfloat16) for p in lora.parameters()]

    def offsets() -> torch.Tensor:
        _, saved = ops.forward(x, ids, tw, *args, factors, 2.0, True, True, 256)
        return saved[2]

    try:
        for rows, pad in ((-1, 1), (0, 16)):
            ops.set_gemv_rows(rows)
            got = offsets().diff()
            assert torch.equal(got, (counts + pad - 1) // pad * pad), (rows, got, counts)
    finally:
        ops.set_gemv_rows(-1)


def test_op_is_bitwise_across_thread_counts() -> None:
    if not _native():
        pytest.skip("needs the native extension")
    problem = _problem(seed=4)
    got = {}
    try:
        for threads in (1, 3):
            kk.set_num_threads(threads)
            got[threads] = _run(*problem)
    finally:
        kk.set_num_threads(None)
    for a, b in zip(got[1], got[3], strict=True):
        assert torch.equal(a, b)


def test_memory_is_one_copy_of_the_bf16_bytes() -> None:
    spec = kk.ExpertSpec(4, 2048, 768)
    dense = 4 * (2 * 768 * 2048 + 2048 * 768) * 2
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.zeros(4, 2 * 768, 2048, dtype=torch.bfloat16),
        torch.zeros(4, 2048, 768, dtype=torch.bfloat16),
        weight_dtype="bf16-packed",
    )
    assert dense < weights.nbytes <= 1.005 * dense


@pytest.mark.timeout(300)
def test_forced_isas_agree_amx_avx512_and_tile_gemm() -> None:
    """The op in children: AMX tiles (where the CPU has AMX), KT_KERNEL_AMX=0 (vdpbf16ps) and
    KT_KERNEL_ISA=avx2 (the products decline: exact tiles for oneDNN), each against float64;
    and weight_dtype="auto" picks bf16-packed for bf16 weights exactly where the products run."""
    if not _products_run():
        pytest.skip("compares the AVX512_BF16 products with the path without them")
    code = (
        "import torch, sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import _op_run as o\n"
        "w, lora, x, ids, tw, dy = o.op_problem('bf16-packed', torch.bfloat16, 8)\n"
        "got = o.run_op(w, lora, x, ids, tw, dy)\n"
        "import kt_kernel as kk\n"
        "auto = kk.auto_format(torch.bfloat16)\n"
        "torch.save({'got': got, 'amx': torch.ops.kt_kernel.amx(), 'auto': auto}, sys.argv[1])\n"
    )
    runs = {"default": {}, "no_amx": {"KT_KERNEL_AMX": "0"}, "avx2": {"KT_KERNEL_ISA": "avx2"}}
    out = {}
    for name, extra in runs.items():
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kt_packed_{os.getpid()}_{name}.pt")
        env = {**os.environ, **extra}
        run = subprocess.run(
            [sys.executable, "-c", code, path], capture_output=True, text=True, env=env, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = torch.load(path)
        os.remove(path)
    # AMX runs by default where this process may use it (CPUID, XCR0, Linux's permission);
    # never when switched off or below the AVX-512 level.
    assert out["default"]["amx"] == torch.ops.kt_kernel.amx()
    if "amx-bf16" not in kk.backend_info().cpu_features:
        assert not out["default"]["amx"]
    assert not out["no_amx"]["amx"]
    assert not out["avx2"]["amx"]
    # weight_dtype="auto" stores bf16 experts repacked exactly where these products run.
    assert [out[name]["auto"] for name in runs] == ["bf16-packed", "bf16-packed", "bf16"]
    ref = _oracle(*_problem(8))
    for name in runs:
        for a, b in zip(out[name]["got"], ref, strict=True):
            err = float((a.double() - b).abs().max() / b.abs().max())
            assert err < OP_BF16_TOL, (name, err)
