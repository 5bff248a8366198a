"""Weight-only INT8 expert base: quantisation, the native op against the oracle, and its limits."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk
from kt_kernel.quant import dequantize_per_channel, quantize_per_channel

FP32_TOL = 1e-5
# As in test_native_vs_reference: bf16 keeps 8 significant bits and the op rounds 4-6 times in
# a chain (each sum in fp32), so a few 2e-3 against an fp64 oracle; 3e-2 max-norm relative.
BF16_TOL = 3e-2


def int8_problem(kt, dtype: torch.dtype, **kw):
    """A problem from conftest with its base replaced by the INT8 quantisation of that base."""
    p = kt.make_problem(dtype=torch.float32, **kw)
    full = p.weights
    p.weights = kk.ExpertWeights.from_fused(
        p.spec, full.gate_up, full.down, dtype=dtype, weight_dtype="int8"
    )
    p.x = p.x.to(dtype)
    p.dy = p.dy.to(dtype)
    if p.lora is not None and dtype != torch.float32:
        p.lora = p.lora.to(dtype)
    return p, full


def with_weights(p, weights):
    """The same problem on other base weights (inputs, routing and LoRA shared)."""
    return type(p)(p.spec, weights, p.lora, p.x, p.ids, p.w, p.dy)


def test_quantize_per_channel_definition() -> None:
    w = torch.randn(3, 5, 40, dtype=torch.float64)
    w[1, 2] = 0.0  # an all-zero channel dequantises exactly
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8
    assert scale.dtype == torch.float32
    assert scale.shape == (3, 5)
    expected_scale = (w.float().abs().amax(-1) / 127).float()
    assert torch.equal(scale, expected_scale)
    assert int(q.abs().max()) <= 127
    assert torch.equal(q[1, 2], torch.zeros(40, dtype=torch.int8))
    # Every channel's largest element maps to +-127, and each error is at most half a step.
    assert torch.equal(q.abs().amax(-1)[scale > 0].long(), torch.full((14,), 127))
    err = (w - q.double() * scale.double().unsqueeze(-1)).abs()
    assert bool((err <= scale.double().unsqueeze(-1) / 2 + 1e-12).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_tile_dequant_matches_python(dtype: torch.dtype) -> None:
    # Odd sizes exercise the masked tails of the SIMD loop, the column blocks its strided use.
    q, s = quantize_per_channel(torch.randn(2, 7, 53))
    ref = dequantize_per_channel(q, s, dtype)
    tile = torch.ops.kt_kernel.dequantize_tile
    assert torch.equal(tile("int8", [q, s], 7, 53, 0, 0, 7, 53, dtype), ref)
    assert torch.equal(tile("int8", [q, s], 7, 53, 0, 5, 7, 37, dtype), ref[:, :, 5:42])
    assert torch.equal(tile("int8", [q, s], 7, 53, 2, 0, 4, 53, dtype), ref[:, 2:6])


def test_weights_storage_report_and_nbytes() -> None:
    spec = kk.ExpertSpec(4, 256, 128)
    gate_up = torch.randn(4, 256, 256).bfloat16()
    down = torch.randn(4, 256, 128).bfloat16()
    w8 = kk.ExpertWeights.from_fused(spec, gate_up, down, weight_dtype="int8")
    wb = kk.ExpertWeights.from_fused(spec, gate_up, down)
    assert w8.weight_dtype == "int8"
    assert w8.dtype == torch.bfloat16
    assert w8.is_quantized
    gu_q, gu_s, dn_q, dn_s = w8.int8_storage()
    assert (gu_q.dtype, dn_q.dtype, gu_s.dtype, dn_s.dtype) == (torch.int8,) * 2 + (
        torch.float32,
    ) * 2
    assert gu_s.shape == (4, 256)
    assert dn_s.shape == (4, 256)
    # int8 values plus one fp32 scale per output channel: (1 + 4/K) / 2 of bf16.
    assert w8.nbytes == gu_q.numel() + dn_q.numel() + 4 * (gu_s.numel() + dn_s.numel())
    assert w8.nbytes <= 0.55 * wb.nbytes
    rep = w8.quantization_report()
    for proj, src in (
        (rep.gate, gate_up[:, :128]),
        (rep.up, gate_up[:, 128:]),
        (rep.down, down),
    ):
        full = src.double()
        q, s = quantize_per_channel(src)  # the report measures q * scale before bf16 rounding
        diff = full - q.double() * s.double().unsqueeze(-1)
        assert proj.max_abs_error == pytest.approx(float(diff.abs().max()), rel=1e-5)
        assert proj.rel_fro_error == pytest.approx(float(diff.norm() / full.norm()), rel=1e-5)
        assert proj.max_step == pytest.approx(float(s.max()))
        assert 0 < proj.max_abs_error <= proj.max_step / 2 + 1e-9
    assert set(rep.as_dict()) == {"gate", "up", "down"}
    split = kk.ExpertWeights.from_split(
        spec, gate_up[:, :128], gate_up[:, 128:], down, weight_dtype="int8"
    )
    assert all(
        torch.equal(a, b) for a, b in zip(split.int8_storage(), w8.int8_storage(), strict=True)
    )


@pytest.mark.parametrize("layout", ["split", "fused", None])
@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_fp32_matches_reference_on_dequantized(kt, layout: str | None, policy: str) -> None:
    p, _ = int8_problem(
        kt, torch.float32, rank=None if layout is None else 4, layout=layout or "split"
    )
    ref = kt.run(with_weights(p, p.weights.dequantized()), "reference")
    nat = kt.run(p, "native", policy)
    assert ref.keys() == nat.keys()
    for name in ref:
        assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, name
    # The reference accepts the INT8 weights itself (dequantising one expert at a time).
    ref8 = kt.run(p, "reference")
    for name in ref:
        assert torch.equal(ref8[name], ref[name]), name


@pytest.mark.parametrize("layout", ["split", "fused"])
@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_bf16_matches_fp64_oracle_on_dequantized(kt, layout: str, policy: str) -> None:
    p, _ = int8_problem(kt, torch.bfloat16, layout=layout, tokens=45)
    deq = p.weights.dequantized()  # bf16 values: exactly the weights the kernel's tiles hold
    oracle_w = kk.ExpertWeights.from_fused(p.spec, deq.gate_up, deq.down, dtype=torch.float64)
    lora64 = copy.deepcopy(p.lora).to(torch.float64)
    oracle = with_weights(p, oracle_w)
    oracle.lora, oracle.x, oracle.dy = lora64, p.x.double(), p.dy.double()
    ref = kt.run(oracle, "reference")
    nat = kt.run(p, "native", policy)
    assert nat["y"].dtype == torch.bfloat16
    assert nat["dx"].dtype == torch.bfloat16
    for name in ref:
        assert kt.rel_err(nat[name], ref[name]) < BF16_TOL, name


def test_int8_against_full_precision_base_within_quantization_bound(kt) -> None:
    # Per element, |W - q*scale| <= step/2 with step = max|W[e, n, :]| / 127; for inputs
    # uncorrelated with that error, a projection's output error relative to its output is its
    # relative Frobenius weight error e_p (the report). Through silu(g) * u then down, first
    # order errors add: |d silu(g) / silu(g)| * |g| <= 1.1 for the gate, 1 for up and down, so
    # rel(y) ~ 1.1 e_gate + e_up + e_down. The bound allows 1.5x that for finite-sample spread.
    p, full = int8_problem(kt, torch.float32, tokens=200, hidden=128, inter=64, rank=4)
    rep = p.weights.quantization_report()
    bound = 1.5 * (1.1 * rep.gate.rel_fro_error + rep.up.rel_fro_error + rep.down.rel_fro_error)
    exact = kt.run(with_weights(p, full), "reference")
    nat = kt.run(p, "native")
    for name in ("y", "dx"):
        rel = float((nat[name] - exact[name]).norm() / exact[name].norm())
        assert 0 < rel < bound, (name, rel, bound)
    assert bound < 0.05  # the step of 8-bit per-channel weights: about 1% per projection


def test_multi_tile_weights_and_row_tiles_in_subprocess() -> None:
    # Tiny dequant tiles (KT_INT8_TILE_ELEMS is read once per process, hence the subprocess)
    # split every expert into many row and column blocks, and 600 rows on one expert span two
    # row tasks; results must equal the oracle exactly as with one tile.
    code = r"""
import torch, kt_kernel as kk
torch.manual_seed(0)
spec = kk.ExpertSpec(6, 128, 96)
w8 = kk.ExpertWeights.from_fused(spec, torch.randn(6, 192, 128) / 11, torch.randn(6, 128, 96) / 10,
                                 weight_dtype="int8", dtype=torch.float32)
lora = kk.LoraBuffers(spec, 4, 8.0, "split")
with torch.no_grad():
    for _, t in lora.named_parameters():
        t.normal_(0, 0.1)
ids = torch.stack([torch.full((600,), 2), torch.randint(3, 6, (600,))], 1)
x = torch.randn(600, 128)
w = torch.rand(600, 2)
dy = torch.randn(600, 128)
worst = 0.0
for policy in ("save", "recompute"):
    outs = []
    for weights, backend in ((w8, "native"), (w8.dequantized(), "reference")):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        for t in lora.parameters():
            t.grad = None
        y = kk.moe_experts_forward(xg, ids, wg, weights, lora, policy=policy, backend=backend)
        y.backward(dy)
        outs.append([y, xg.grad, wg.grad] + [t.grad.clone() for t in lora.parameters()])
    for a, b in zip(*outs):
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
print(worst)
"""
    env = dict(os.environ, KT_INT8_TILE_ELEMS="2048", OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < FP32_TOL


def test_scalar_fallback_gives_the_same_tiles_and_results() -> None:
    # KT_KERNEL_ISA=scalar forces the portable loops; they round exactly like the SIMD path.
    code = r"""
import torch, kt_kernel as kk
from kt_kernel.quant import dequantize_per_channel, int8_isa, quantize_per_channel
torch.manual_seed(0)
q, s = quantize_per_channel(torch.randn(3, 9, 45))
deq = torch.ops.kt_kernel.dequantize_tile
same = all(torch.equal(deq("int8", [q, s], 9, 45, 0, 0, 9, 45, dt),
                       dequantize_per_channel(q, s, dt)) for dt in (torch.float32, torch.bfloat16))
spec = kk.ExpertSpec(4, 32, 16)
w8 = kk.ExpertWeights.from_fused(spec, torch.randn(4, 32, 32), torch.randn(4, 32, 16),
                                 weight_dtype="int8", dtype=torch.bfloat16)
x = torch.randn(20, 32).bfloat16()
ids = torch.rand(20, 4).topk(2, -1).indices
y = kk.moe_experts_forward(x, ids, torch.rand(20, 2), w8, backend="native")
print(int8_isa(), same, y.float().abs().sum().item())
"""
    results = []
    for isa in ("scalar", None):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("KT_KERNEL_ISA", None)
        if isa is not None:
            env["KT_KERNEL_ISA"] = isa
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        results.append(out.stdout.split())
    (isa_s, same_s, sum_s), (isa_d, same_d, sum_d) = results
    assert isa_s == "scalar"
    assert isa_d in ("avx512_bf16", "avx512", "scalar")
    assert same_s == same_d == "True"
    # Identical tiles and GEMMs; only the dense op's elementwise loops may round differently
    # per ISA (FMA contraction), so the outputs agree to bf16 precision.
    assert abs(float(sum_s) - float(sum_d)) <= 1e-2 * abs(float(sum_d))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_no_full_precision_copy_of_the_weights_is_made() -> None:
    # Peak RSS growth over a forward+backward at few tokens (VmHWM after resetting it) must stay
    # far below the 96 MiB a bf16 copy of these weights would take: the op only ever holds
    # one dequantised tile per thread (2 MiB) next to small activations.
    code = r"""
import torch, kt_kernel as kk
from pathlib import Path
def hwm():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
spec = kk.ExpertSpec(16, 1024, 1024)
w8 = kk.ExpertWeights.from_fused(spec, torch.randn(16, 2048, 1024).bfloat16(),
                                 torch.randn(16, 1024, 1024).bfloat16(), weight_dtype="int8")
lora = kk.LoraBuffers(spec, 4, 8.0, "fused", dtype=torch.bfloat16)
x = torch.randn(16, 1024).bfloat16().requires_grad_()
ids = torch.arange(32).reshape(16, 2) % 16
w = torch.rand(16, 2, requires_grad=True)
def step():
    kk.moe_experts_forward(x, ids, w, w8, lora).sum().backward()
step()  # warm-up: oneDNN primitives, scratch pool, thread-local tiles
full_bf16 = 2 * sum(t.numel() for t in w8.int8_storage()[::2])
Path("/proc/self/clear_refs").write_text("5")
base = hwm()
step()
print(hwm() - base, full_bf16)
"""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    growth, full_bf16 = (int(v) for v in out.stdout.split())
    assert full_bf16 == 96 * 2**20
    assert growth < full_bf16 // 4, (growth, full_bf16)


def test_inference_path_keeps_no_graph_and_matches(kt) -> None:
    p, _ = int8_problem(kt, torch.bfloat16)
    trained = kt.run(p, "native")["y"]
    with torch.no_grad():
        y = kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, p.lora)
    assert y.grad_fn is None
    assert torch.equal(y, trained)


def test_int8_errors() -> None:
    spec = kk.ExpertSpec(2, 8, 4)
    gu, dn = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    with pytest.raises(kk.KernelDTypeError, match=r"weight_dtype must be one of .*got 'int9'"):
        kk.ExpertWeights.from_fused(spec, gu, dn, weight_dtype="int9")
    with pytest.raises(kk.KernelDTypeError, match=r"compute dtype\) must be torch.float32 or"):
        kk.ExpertWeights.from_fused(spec, gu, dn, weight_dtype="int8", dtype=torch.float64)
    bad = gu.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(kk.KernelInputError, match=r"NaN or inf"):
        kk.ExpertWeights.from_fused(spec, bad, dn, weight_dtype="int8")
    with pytest.raises(
        kk.KernelDTypeError, match=r"quantization_report\(\) needs weights quantised"
    ):
        kk.ExpertWeights.from_fused(spec, gu, dn).quantization_report()
    w8 = kk.ExpertWeights.from_fused(spec, gu, dn, weight_dtype="int8", dtype=torch.bfloat16)
    x = torch.randn(3, 8)
    ids = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(kk.KernelDTypeError, match=r"x has dtype torch.float32 but the expert"):
        kk.moe_experts_forward(x, ids, torch.ones(3, 1), w8)
