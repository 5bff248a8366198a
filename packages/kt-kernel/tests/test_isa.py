"""KT_KERNEL_ISA caps every native loop; each path (avx512, avx2, scalar) matches the oracle.

The cap is read once per process, so each ISA runs in its own subprocess. Every format and
activation runs under each cap: fp32 within 1e-5 of the reference on the dequantised weights,
bf16 within the bf16 bound, and every format's tile loader gives bitwise the values of its
Python ``dequantize`` (the loaders' contract: one rounding from fp32, identical on every ISA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kt_kernel as kk

CHILD = r"""
import json, torch, kt_kernel as kk
torch.manual_seed(0)
out = {"isa": kk.backend_info().isa, "int8_isa": kk.int8_isa(), "errors": {}, "tiles": {}}
acts = {"swiglu": kk.SwiGLU(), "clamped_swiglu": kk.ClampedSwiGLU(1.702, 2.0),
        "swiglu_limit": kk.SwiGLULimit(2.0), "gelu_tanh_gated": kk.GeluTanhGated()}
E, H, I, T = 5, 128, 128, 30  # multiples of 128: block/group formats tile them exactly
for fmt, factory in kk.FORMATS.items():
    for dtype in factory.compute_dtypes:
        for name, act in acts.items():
            if dtype == torch.bfloat16 and name in ("clamped_swiglu", "swiglu_limit"):
                # A bf16 pre-activation within one rounding of the clamp edge may fall on
                # either side in two correct implementations (the derivative jumps there);
                # the clamps run per ISA in fp32 here and in bf16 in test_conformance, whose
                # limits sit in a gap of the pre-activations.
                continue
            spec = kk.ExpertSpec(E, H, I, activation=act)
            w = kk.ExpertWeights.from_fused(
                spec, torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5,
                dtype=dtype, weight_dtype=fmt,
                gate_up_bias=0.3 * torch.randn(E, 2 * I), down_bias=0.1 * torch.randn(E, H))
            lora = kk.LoraBuffers(spec, 4, 8.0, "fused")
            with torch.no_grad():
                for _, p in lora.named_parameters():
                    p.normal_(0, 0.2)
            x = torch.randn(T, H).to(dtype)
            ids = torch.rand(T, E).topk(2, -1).indices
            tw = torch.rand(T, 2)
            dy = torch.randn(T, H).to(dtype)
            res = []
            for weights, backend in ((w, "native"), (w.dequantized(), "reference")):
                xg, wg = x.clone().requires_grad_(), tw.clone().requires_grad_()
                for p in lora.parameters():
                    p.grad = None
                y = kk.moe_experts_forward(xg, ids, wg, weights, lora, backend=backend)
                y.backward(dy)
                res.append([y, xg.grad, wg.grad] + [p.grad.clone() for p in lora.parameters()])
            worst = max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
                        for a, b in zip(*res))
            out["errors"][f"{fmt}/{str(dtype)[6:]}/{name}"] = worst
    for dtype in factory.compute_dtypes:
        f = factory(dtype)
        parts = f.quantize(torch.randn(3, 40, 256))
        ref = f.dequantize(parts)
        args = list(f.native_args(parts))
        tile = torch.ops.kt_kernel.dequantize_tile
        same = torch.equal(tile(f.name, args, 40, 256, 0, 0, 40, 256, dtype), ref)
        same &= torch.equal(tile(f.name, args, 40, 256, 0, 32, 40, 96, dtype), ref[:, :, 32:128])
        same &= torch.equal(tile(f.name, args, 40, 256, 16, 0, 24, 256, dtype), ref[:, 16:])
        out["tiles"][f"{fmt}/{str(dtype)[6:]}"] = bool(same)
print(json.dumps(out))
"""

FP32_TOL = 1e-5
BF16_TOL = 3e-2


def _run(isa: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("KT_KERNEL_ISA", None)
    if isa is not None:
        env["KT_KERNEL_ISA"] = isa
    return subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )


def _features() -> tuple[str, ...]:
    return kk.backend_info().cpu_features


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_each_isa_path_matches_the_oracle(isa: str) -> None:
    feats = _features()
    if not feats and kk.backend_info().active != "native":
        pytest.skip("needs the native extension")
    if isa == "avx512" and "avx512f" not in feats:
        pytest.skip("this CPU has no AVX-512")
    if isa == "avx2" and "avx2" not in feats:
        pytest.skip("this CPU has no AVX2")
    out = _run(isa)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["isa"] == isa
    expected_int8 = {"scalar": {"scalar"}, "avx2": {"avx2"}, "avx512": {"avx512", "avx512_bf16"}}
    assert res["int8_isa"] in expected_int8[isa]
    if isa == "avx512" and "avx512bf16" in feats:
        assert res["int8_isa"] == "avx512_bf16"
    assert all(res["tiles"].values()), res["tiles"]
    for case, err in res["errors"].items():
        tol = FP32_TOL if "/float32/" in case else BF16_TOL
        assert err < tol, (case, err)


def test_unknown_isa_value_is_one_clear_error() -> None:
    if kk.backend_info().active != "native":
        pytest.skip("needs the native extension")
    env = dict(os.environ, KT_KERNEL_ISA="sse9")
    code = (
        "import torch, kt_kernel as kk\n"
        "try:\n"
        "    kk.backend_info()\n"
        "except ValueError as exc:\n"
        "    print(str(exc).splitlines()[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "KT_KERNEL_ISA must be avx512, avx2 or scalar, got 'sse9'" in out.stdout
