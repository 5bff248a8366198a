"""The small-row product of a format (INT4: weights decoded in registers, no tile).

Tasks of at most ``torch.ops.kt_kernel.gemv_rows()`` rows take it; larger ones dequantise a
tile and run a GEMM. ``torch.ops.kt_kernel.project`` computes one expert's product exactly as
the op does, so each row count below, at and above the threshold, with odd N and K, is
compared with the float64 product on the format's dequantised weights, on every ISA path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

FP32_TOL = 1e-5
# One bf16 rounding of each output (2^-8 of it at most) and fp32 sums.
BF16_TOL = 1e-2

# Run as a script in one subprocess per ISA cap (the cap is read once per process); prints
# the worst relative error per case as JSON.
CHILD = r"""
import json, torch, kt_kernel as kk
torch.manual_seed(0)
ops = torch.ops.kt_kernel
thr = int(ops.gemv_rows())
out = {"isa": kk.backend_info().isa, "threshold": thr, "errors": {}}
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
print(json.dumps(out))
"""


def _native() -> bool:
    return kk.backend_info().active == "native"


def _tol(case: str) -> float:
    return FP32_TOL if case.startswith("float32/") else BF16_TOL


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nn", [False, True], ids=["x_Wt", "dy_W"])
def test_both_paths_match_the_dequantized_product(dtype: torch.dtype, nn: bool) -> None:
    """The same rows through the small-row routine (threshold high) and tile + GEMM (0)."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    n, k = 45, 176  # odd N; K a multiple of 16 but not of 32
    f = kk.Int4Grouped(dtype, 16 * 2)
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


def test_op_matches_reference_with_and_without_the_small_row_path(kt) -> None:
    """The whole op (forward, dx, d topk_weights, LoRA gradients) on INT4, both routes."""
    if not _native():
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    gen = torch.Generator().manual_seed(3)
    spec = kk.ExpertSpec(4, 96, 80)
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.randn(4, 160, 96, generator=gen) / 96**0.5,
        torch.randn(4, 96, 80, generator=gen) / 80**0.5,
        dtype=torch.float32,
        weight_dtype="int4",
    )
    lora = kk.LoraBuffers(spec, 4, 8.0, "fused")
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.normal_(0, 0.2, generator=gen)
    tokens = 40  # 80 (token, slot) rows on 4 experts: about 20 each, padded to 8
    x = torch.randn(tokens, 96, generator=gen)
    ids = torch.rand(tokens, 4, generator=gen).topk(2, -1).indices
    tw = torch.rand(tokens, 2, generator=gen)
    dy = torch.randn(tokens, 96, generator=gen)

    def run(w: kk.ExpertWeights, backend: str) -> list[torch.Tensor]:
        xg, wg = x.clone().requires_grad_(), tw.clone().requires_grad_()
        for p in lora.parameters():
            p.grad = None
        y = kk.moe_experts_forward(xg, ids, wg, w, lora, backend=backend)
        y.backward(dy)
        return [t.detach() for t in [y, xg.grad, wg.grad, *[p.grad for p in lora.parameters()]]]

    ref = run(weights.dequantized(), "reference")
    try:
        for rows in (0, 8, 1000):  # tile only; mixed (tasks of 8 rows take it); always
            ops.set_gemv_rows(rows)
            for a, b in zip(run(weights, "native"), ref, strict=True):
                err = float((a - b).abs().max() / b.abs().max())
                assert err < FP32_TOL, (rows, err)
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
    ms = {int(c.split("/m")[1].split("/")[0]) for c in res["errors"]}
    assert any(m <= thr for m in ms)
    assert any(m > thr for m in ms)
    worst = {c: e for c, e in res["errors"].items() if e >= _tol(c)}
    assert not worst, worst
