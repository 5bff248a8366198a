"""The native causal GQA attention against a float64 masked softmax, forward and backward.

Output and dq/dk/dv for T in {1, 17, 64, 300} (one block, a ragged tail, several query and key
blocks), D in {64, 128} (and an odd D), Hq/Hkv in {1, 4}, float32 and bfloat16; gradcheck on a
tiny float32 case; strided inputs as transformers passes them; every ISA cap in a subprocess;
one clear error per bad argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import kt_kernel as kk

pytestmark = pytest.mark.skipif(
    kk.backend_info().active != "native", reason="needs the compiled extension"
)


def reference64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, scale: float
) -> list[torch.Tensor]:
    """out, dq, dk, dv of softmax(masked q k^T * scale) v in float64 by autograd."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    t = q.shape[2]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v.repeat_interleave(rep, 1)
    out.backward(go.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, scale: float | None = None
) -> list[torch.Tensor]:
    """out, dq, dk, dv of kk.causal_attention (native backend)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = kk.causal_attention(q, k, v, scale, backend="native")
    out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]


def inputs(
    b: int, hq: int, hkv: int, t: int, d: int, dtype: torch.dtype, seed: int = 0
) -> list[torch.Tensor]:
    """q, k, v and an upstream gradient; q and k scaled up so the softmax is peaked."""
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(b, hq, t, d, generator=g)).to(dtype)
    k = (2 * torch.randn(b, hkv, t, d, generator=g)).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    go = torch.randn(b, hq, t, d, generator=g).to(dtype)
    return [q, k, v, go]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (the absolute difference when b is zero)."""
    diff = (a.double() - b).abs().max().item()
    scale = b.abs().max().item()
    return diff / scale if scale > 0 else diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rep", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 17, 64, 300])
def test_matches_float64(t: int, d: int, rep: int, dtype: torch.dtype) -> None:
    q, k, v, go = inputs(2 if t < 100 else 1, 2 * rep, 2, t, d, dtype)
    scale = d**-0.5
    got = native(q, k, v, go)
    want = reference64(q, k, v, go, scale)
    # bf16: inputs, P and dS are rounded to bf16 once each; torch's own bf16 SDPA is compared
    # below, so the bound is not looser than what the fused kernel it replaces achieves.
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype, name
        assert a.shape == b.shape, name
        assert max_rel(a, b) < tol, (name, max_rel(a, b))


def test_bf16_error_is_like_torch_sdpa() -> None:
    q, k, v, go = inputs(1, 8, 2, 300, 128, torch.bfloat16, seed=1)
    want = reference64(q, k, v, go, 128**-0.5)
    ours = native(q, k, v, go)
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, enable_gqa=True
    )
    out.backward(go)
    theirs = [out.detach(), qs.grad, ks.grad, vs.grad]
    for a, s, b in zip(ours, theirs, want, strict=True):
        err = (a.double() - b).norm() / b.norm()
        err_sdpa = (s.double() - b).norm() / b.norm()
        assert err < 1.5 * err_sdpa + 1e-3, (float(err), float(err_sdpa))


def test_odd_head_dim_and_custom_scale() -> None:
    q, k, v, go = inputs(1, 6, 3, 33, 65, torch.float32)
    got = native(q, k, v, go, scale=0.3)
    for a, b in zip(got, reference64(q, k, v, go, 0.3), strict=True):
        assert max_rel(a, b) < 2e-5


def test_strided_inputs_as_transformers_passes_them() -> None:
    # [B, T, H, D] projections transposed to [B, H, T, D]: a view, not a copy.
    q, k, v, go = inputs(1, 4, 2, 40, 64, torch.bfloat16)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous()
    for a, b in zip(native(qt, kt, vt, go), native(q, k, v, go), strict=True):
        assert torch.equal(a, b)


def test_reference_backend_and_auto() -> None:
    q, k, v, go = inputs(1, 4, 1, 20, 64, torch.float32)
    want = reference64(q, k, v, go, 64**-0.5)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = kk.causal_attention(qr, kr, vr, backend="reference")
    out.backward(go)
    for a, b in zip([out.detach(), qr.grad, kr.grad, vr.grad], want, strict=True):
        assert max_rel(a, b) < 2e-5
    auto = kk.causal_attention(q, k, v)
    assert torch.equal(auto, native(q, k, v, go)[0])


def test_gradcheck_float32() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 4, generator=g).requires_grad_()
    k = torch.randn(1, 1, 5, 4, generator=g).requires_grad_()
    v = torch.randn(1, 1, 5, 4, generator=g).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not double precision"
        assert torch.autograd.gradcheck(
            lambda a, b, c: kk.causal_attention(a, b, c, backend="native"),
            (q, k, v),
            eps=1e-2,
            atol=2e-3,
            rtol=2e-3,
        )


CHILD = r"""
import json, torch, kt_kernel as kk
g = torch.Generator().manual_seed(0)
q = 2 * torch.randn(1, 4, 70, 64, generator=g)
k = 2 * torch.randn(1, 2, 70, 64, generator=g)
v = torch.randn(1, 2, 70, 64, generator=g)
go = torch.randn(1, 4, 70, 64, generator=g)
res = {"isa": kk.backend_info().isa, "attention_isa": torch.ops.kt_kernel.attention_isa()}
for dt in (torch.float32, torch.bfloat16):
    xs = [x.to(dt).detach().requires_grad_() for x in (q, k, v)]
    out = kk.causal_attention(*xs, backend="native")
    out.backward(go.to(dt))
    r = [x.detach().double().requires_grad_() for x in xs]
    ref = kk.causal_attention_reference(*r)
    ref.backward(go.to(dt).double())
    res[str(dt)] = max(float((a.double() - b).abs().max() / b.abs().max())
                       for a, b in zip([out, *(x.grad for x in xs)],
                                       [ref, *(x.grad for x in r)]))
print(json.dumps(res))
"""


def _child(**env: str) -> dict:
    """CHILD's results in a fresh process with ``env`` added (ISA choices are read once)."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cap", ["avx512", "avx2", "scalar"])
def test_every_isa_cap(cap: str) -> None:
    res = _child(KT_KERNEL_ISA=cap)
    if res["isa"] != cap:
        pytest.skip(f"this CPU offers at most {res['isa']}")
    if cap != "avx512":
        assert res["attention_isa"] == "portable"
    assert res["torch.float32"] < 2e-5
    assert res["torch.bfloat16"] < 3e-2


@pytest.mark.parametrize("amx", ["1", "0"])
def test_amx_on_and_off(amx: str) -> None:
    # Where the CPU and the OS allow AMX the bf16 products run on its tiles (the 32-aligned
    # blocks; vdpbf16ps does the edges: T=70 leaves row, column and k remainders);
    # KT_KERNEL_AMX=0 keeps vdpbf16ps. Both against the float64 reference.
    res = _child(KT_KERNEL_AMX=amx)
    if amx == "0":
        assert res["attention_isa"] in ("avx512_bf16", "portable")
    elif res["attention_isa"] != "amx_bf16":
        pytest.skip(f"no AMX on this CPU or OS (the bf16 GEMM is {res['attention_isa']})")
    assert res["torch.float32"] < 2e-5
    assert res["torch.bfloat16"] < 1e-2


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda q, k, v: (q[0], k, v), kk.KernelInputError, "q must be 4-D"),
        (lambda q, k, v: (q, k[:, :, :5], v[:, :, :5]), kk.KernelInputError, "must match q"),
        (lambda q, k, v: (q, k, v[..., :8]), kk.KernelInputError, "k and v must have one"),
        (lambda q, k, v: (q[:, :3], k, v), kk.KernelInputError, "multiple of k's"),
        (lambda q, k, v: (q, k.double(), v), kk.KernelDTypeError, "k must be float32"),
        (lambda q, k, v: (q, k, v.bfloat16()), kk.KernelDTypeError, "v has dtype"),
        (lambda q, k, v: (q, k, v.to("meta")), kk.KernelDTypeError, "v is on meta"),
        (lambda q, k, v: (q, [1], v), kk.KernelInputError, "k must be a torch.Tensor"),
    ],
)
def test_bad_inputs_name_the_argument(change: object, error: type, match: str) -> None:
    q, k, v, _ = inputs(1, 4, 2, 8, 16, torch.float32)
    with pytest.raises(error, match=match):
        kk.causal_attention(*change(q, k, v))  # type: ignore[operator]


def test_bad_scale_and_backend() -> None:
    q, k, v, _ = inputs(1, 2, 1, 4, 8, torch.float32)
    with pytest.raises(kk.KernelInputError, match="scale must be a finite"):
        kk.causal_attention(q, k, v, float("nan"))
    with pytest.raises(kk.KernelInputError, match="backend must be"):
        kk.causal_attention(q, k, v, backend="flash")  # type: ignore[arg-type]


def test_native_entries_check_their_own_inputs() -> None:
    q, k, v, _ = inputs(1, 4, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of k's"):
        torch.ops.kt_kernel.attention_forward(q[:, :3], k, v, 0.25)
    out, lse = torch.ops.kt_kernel.attention_forward(q, k, v, 0.25)
    with pytest.raises(ValueError, match="lse must be"):
        torch.ops.kt_kernel.attention_backward(out, q, k, v, out, lse[:, :, :3], 0.25)
    with pytest.raises(TypeError, match="grad_out must be a CPU"):
        torch.ops.kt_kernel.attention_backward(out.double(), q, k, v, out, lse, 0.25)
