"""``rms_norm`` against a float64 oracle and against the torch chains it replaces: every form
(weight after rounding, fp32 weight, ``1 + weight``, no weight), bf16 and fp32, widths off
every vector width, per-head shapes; forward, input and weight gradients; on each ISA path
(its own subprocess, KT_KERNEL_ISA), on the PyTorch path, and its errors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

import pytest
import torch

import kt_kernel as kk

# The module, not the function of the same name that kt_kernel exports.
rms_module = importlib.import_module("kt_kernel.rms_norm")

# (shape, form): widths 1, 3, 17 (off every vector), 128 (a head), 2048 (a hidden state).
SHAPES = ((1, 1), (5, 3), (7, 17), (3, 4, 128), (9, 2048))
# (round_first, offset, weighted)
FORMS = ((True, 0.0, True), (False, 0.0, True), (False, 1.0, True), (True, 0.0, False))
EPS = 1e-6


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, offset: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sum(shape) * 31 + int(offset))
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3.0).to(dtype)
    # Gemma-style weights sit near 0 (the module adds 1), the others near 1.
    w = (torch.randn(shape[-1], generator=g, dtype=torch.float64) * 0.5 + 1.0 - offset).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, dy


def _tol(dtype: torch.dtype) -> float:
    # bf16 outputs are rounded once (8 bits); the oracle rounds nothing.
    return 1.2e-2 if dtype == torch.bfloat16 else 2e-5


def _rel(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Relative error; against ``scale``'s norm where ``want`` is a cancellation (H = 1)."""
    denom = want.norm() if scale is None else torch.maximum(want.norm(), scale.norm())
    return float((got.double() - want).norm() / denom.clamp_min(1e-30))


def _case(
    shape: tuple[int, ...], dtype: torch.dtype, round_first: bool, offset: float, weighted: bool
) -> Iterator[str]:
    name = f"{dtype} {shape} round_first={round_first} offset={offset} weighted={weighted}"
    x, w, dy = _inputs(shape, dtype, offset)
    weight = w.clone().requires_grad_() if weighted else None
    xg = x.clone().requires_grad_()
    y = kk.rms_norm(xg, weight, EPS, offset=offset, round_first=round_first)
    y.backward(dy)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if weighted else None
    ref = kk.rms_norm_reference(x64, w64, EPS, offset=offset, round_first=round_first)
    ref.backward(dy.double())
    if y.dtype != dtype or y.shape != x.shape:
        yield f"{name}: output {y.dtype} {tuple(y.shape)}"
        return
    tol = _tol(dtype)
    # dx = rstd * dn - (a projection of it): the first term's size is the scale of its error.
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    first = rstd * dy.double() * (1.0 if w64 is None else w.double() + offset)
    for what, got, want, scale in (
        ("y", y.detach(), ref.detach(), None),
        ("dx", xg.grad, x64.grad, first),
        *((("dw", weight.grad, w64.grad, None),) if weight is not None and w64 is not None else ()),
    ):
        assert got is not None
        assert want is not None
        if (err := _rel(got, want, scale)) > tol:
            yield f"{name}: {what} relative error {err:.2e} > {tol:.0e}"


def mismatches() -> list[str]:
    """Every disagreement between ``rms_norm`` and the float64 oracle over SHAPES x FORMS."""
    out: list[str] = []
    for dtype in kk.RMS_NORM_DTYPES:
        for shape in SHAPES:
            for round_first, offset, weighted in FORMS:
                out.extend(_case(shape, dtype, round_first, offset, weighted))
    return out


def test_matches_float64_oracle() -> None:
    assert mismatches() == []


def test_torch_path_matches_float64_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rms_module, "native_module", lambda: None)
    assert mismatches() == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_each_narrower_isa_path_matches_oracle(isa: str) -> None:
    # Imported here: the child imports this module alone, outside the test package.
    from ._isa_child import mismatches_on_isa

    assert mismatches_on_isa("test_rms_norm", "rms_norm_isa", isa) == []


# The chains transformers' RMSNorm modules run (LlamaRMSNorm, GptOssRMSNorm, Qwen3NextRMSNorm),
# written out here: kt-kernel knows tensors, not models.
def _llama(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def _fp32_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (w * h).to(x.dtype)


def _one_plus(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * (1.0 + w.float())).type_as(x)


CHAINS: tuple[tuple[Callable[..., torch.Tensor], bool, float], ...] = (
    (_llama, True, 0.0),
    (_fp32_weight, False, 0.0),
    (_one_plus, False, 1.0),
)


@pytest.mark.parametrize(("chain", "round_first", "offset"), CHAINS)
def test_equals_the_torch_chain_it_replaces(
    chain: Callable[..., torch.Tensor], round_first: bool, offset: float
) -> None:
    """bf16 outputs bitwise but for rare one-ulp ties of the fp32 sum order; gradients close."""
    for dtype in kk.RMS_NORM_DTYPES:
        x, w, dy = _inputs((64, 2048), dtype, offset)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = chain(xa, w)
        got = kk.rms_norm(xb, w, EPS, offset=offset, round_first=round_first)
        want.backward(dy)
        got.backward(dy)
        assert xa.grad is not None
        assert xb.grad is not None
        if dtype == torch.bfloat16:
            assert float((got != want).float().mean()) <= 1e-4
            assert _rel(xb.grad, xa.grad.double()) < 1e-4
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)


def test_native_is_used_on_the_cpu() -> None:
    if kk.backend_info().active != "native":
        pytest.skip("needs the native extension")
    assert torch.ops.kt_kernel.rms_norm_isa() == kk.backend_info().isa
    x, w, _ = _inputs((4, 33), torch.float32, 0.0)
    y, rstd = torch.ops.kt_kernel.rms_norm_forward(x, w, EPS, 0.0, True)
    torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + EPS), rtol=1e-6, atol=0)
    torch.testing.assert_close(y, w * (x * rstd[:, None]), rtol=1e-6, atol=1e-6)


def test_non_contiguous_input_and_empty_rows() -> None:
    x, w, _ = _inputs((6, 40), torch.bfloat16, 0.0)
    strided = x.t().contiguous().t()
    assert torch.equal(kk.rms_norm(strided, w, EPS), kk.rms_norm(x, w, EPS))
    empty = kk.rms_norm(torch.empty(0, 8, dtype=torch.bfloat16), w[:8].contiguous(), EPS)
    assert empty.shape == (0, 8)


def test_bad_inputs_name_the_argument() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(kk.KernelDTypeError, match=r"x is torch\.float16"):
        kk.rms_norm(x.half(), None, EPS)
    with pytest.raises(kk.KernelInputError, match=r"float32 tensor of \[8\], got"):
        kk.rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(kk.KernelInputError, match=r"weight must be a torch\.float32"):
        kk.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(kk.KernelInputError, match=r"offset=1\.0 needs round_first=False"):
        kk.rms_norm(x, torch.ones(8), EPS, offset=1.0)
    with pytest.raises(kk.KernelInputError, match=r"x must be \[\.\.\., H\]"):
        kk.rms_norm(torch.randn(3, 0), None, EPS)
    with pytest.raises(ValueError, match="rms_norm_backward: rstd must be"):
        torch.ops.kt_kernel.rms_norm_backward(x, x, None, torch.ones(2), 0.0, True)
