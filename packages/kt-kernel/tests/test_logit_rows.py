"""``logit_rows`` against a float64 oracle (``logsumexp``, the label's logit, softmax - onehot)
for bf16 and fp32 logits: odd and tiny vocabularies, row counts that are multiples of nothing,
ignored rows, huge, very negative and one-hot-like logits; on each ISA path (its own
subprocess, KT_KERNEL_ISA), on the PyTorch path (non-contiguous input), and its errors.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kt_kernel as kk

# (rows, vocab, logit scale, offset): row counts and vocabularies off every vector width and off
# the native sum's 2048-column block; offsets that would overflow exp without max-subtraction.
CASES = (
    (1, 1, 3.0, 0.0),
    (5, 1, 3.0, 0.0),
    (3, 2, 3.0, 0.0),
    (17, 7, 3.0, 0.0),
    (33, 31, 5.0, 0.0),
    (9, 1000, 3.0, 0.0),
    (4, 2047, 3.0, 0.0),
    (7, 4097, 8.0, 0.0),
    (3, 32000, 3.0, 0.0),
    (11, 257, 3.0, 1.0e4),
    (11, 257, 3.0, -1.0e4),
    (6, 31, 1.0e30, 0.0),
    (6, 129, 3.0e3, 0.0),
)


def _logits(n: int, v: int, scale: float, offset: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 7919 + v)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * scale + offset
    if scale > 1.0e3:
        # One clear maximum per row: a tie at the max of a huge row is not resolvable in fp32.
        top = x.argmax(dim=1)
        x[torch.arange(n), top] = x.abs().amax(dim=1) * 2
    return x.to(dtype)


def _labels(n: int, v: int, ignore_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + 31 * v)
    y = torch.randint(0, v, (n,), generator=g)
    drop = torch.rand(n, generator=g) < 0.25
    return torch.where(drop, torch.full_like(y, ignore_index), y)


def _oracle(x: torch.Tensor, y: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, ...]:
    """float64 lse, target and (softmax, softmax - onehot) of the given rows."""
    x64 = x.double()
    lse = torch.logsumexp(x64, dim=1)
    valid = y != ignore_index
    safe = torch.where(valid, y, 0)
    target = torch.where(valid, x64.gather(1, safe[:, None]).squeeze(1), 0.0)
    p = torch.exp(x64 - lse[:, None])
    grad = p.clone()
    grad[torch.arange(len(y)), safe] -= 1.0
    grad *= valid[:, None]
    return lse, target, p * valid[:, None], grad


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(v.double())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


def _check_case(
    name: str, x: torch.Tensor, y: torch.Tensor, ignore_index: int, got: kk.LogitRows
) -> Iterator[str]:
    lse, target, p, grad = _oracle(x, y, ignore_index)
    err = (got.lse.double() - lse).abs()
    if not bool((err <= 2e-6 * lse.abs() + 2e-6).all()):
        yield f"{name}: lse off by {float(err.max()):.3g}"
    if not torch.equal(got.target.double(), target):
        yield f"{name}: target differs"
    assert got.grad is not None
    if got.grad.dtype != x.dtype or got.grad.shape != x.shape:
        yield f"{name}: grad is {got.grad.dtype} {tuple(got.grad.shape)}"
        return
    # The fp32 computation's own error: lse (and so x - lse) is rounded to fp32, at most one
    # ulp of |lse| relative in exp, and the one-hot subtraction rounds at 1. Capped at the 1e4
    # offsets: the 1e30-scale rows have one dominant logit, p is exactly 0 or 1 in fp32 too.
    fp32 = p * (4e-6 + 1.2e-7 * lse.abs().clamp(max=1.1e4)[:, None]) + 1.2e-7
    if x.dtype == torch.bfloat16:
        ref = grad.to(torch.bfloat16).double()
        tol = _bf16_ulp(ref) + fp32
    else:
        ref, tol = grad, fp32
    bad = (got.grad.double() - ref).abs() > tol
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        yield (
            f"{name}: {int(bad.sum())} grad elements off, e.g. [{r}, {c}] "
            f"{float(got.grad[r, c])} vs {float(grad[r, c])}"
        )
    zero = y == ignore_index
    if bool(got.grad[zero].ne(0).any()):
        yield f"{name}: ignored rows have a nonzero grad"


def mismatches() -> list[str]:
    """Every disagreement between ``logit_rows`` and the float64 oracle over CASES."""
    out: list[str] = []
    for dtype in kk.LOGIT_ROWS_DTYPES:
        for n, v, scale, offset in CASES:
            for ignore_index in (-100, 0):
                x = _logits(n, v, scale, offset, dtype)
                y = _labels(n, v, ignore_index)
                name = f"{dtype} n={n} V={v} scale={scale} offset={offset} ignore={ignore_index}"
                got = kk.logit_rows(x, y, ignore_index=ignore_index)
                out.extend(_check_case(name, x, y, ignore_index, got))
                no_grad = kk.logit_rows(x, y, ignore_index=ignore_index, want_grad=False)
                if no_grad.grad is not None or not (
                    torch.equal(no_grad.lse, got.lse) and torch.equal(no_grad.target, got.target)
                ):
                    out.append(f"{name}: want_grad=False changes lse/target or returns a grad")
    return out


def _native() -> bool:
    return kk.backend_info().active == "native"


def test_matches_float64_oracle() -> None:
    assert mismatches() == []


def test_torch_path_matches_float64_oracle() -> None:
    # A transposed copy is not contiguous: the PyTorch formula answers, to the same contract.
    for dtype in kk.LOGIT_ROWS_DTYPES:
        for n, v, scale, offset in CASES:
            x = _logits(n, v, scale, offset, dtype).t().contiguous().t()
            y = _labels(n, v, -100)
            got = kk.logit_rows(x, y)
            bad = list(_check_case(f"torch {dtype} n={n} V={v}", x, y, -100, got))
            assert bad == []


def test_native_is_used_and_equals_torch_path_on_plain_rows() -> None:
    if not _native():
        pytest.skip("needs the native extension")
    x = _logits(5, 300, 3.0, 0.0, torch.float32)
    y = _labels(5, 300, -100)
    fast = kk.logit_rows(x, y)
    slow = kk.logit_rows(x.t().contiguous().t(), y)
    assert torch.allclose(fast.lse, slow.lse, rtol=1e-6, atol=1e-6)
    assert fast.grad is not None
    assert slow.grad is not None
    assert torch.allclose(fast.grad, slow.grad, rtol=1e-5, atol=1e-7)
    assert torch.ops.kt_kernel.logit_rows_isa() == kk.backend_info().isa


@pytest.mark.parametrize("contiguous", [True, False])
def test_label_out_of_range_names_the_row(contiguous: bool) -> None:
    x = torch.randn(4, 10)
    x = x if contiguous else x.t().contiguous().t()
    y = torch.tensor([1, -100, 10, 2])
    with pytest.raises(kk.KernelInputError, match=r"labels\[2\] = 10 is outside \[0, 10\)"):
        kk.logit_rows(x, y)
    with pytest.raises(kk.KernelInputError, match=r"labels\[0\] = -1 is outside"):
        kk.logit_rows(x, torch.tensor([-1, 0, 0, 0]))


def test_bad_dtypes_and_shapes() -> None:
    y = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(kk.KernelDTypeError, match=r"logits is torch\.float16"):
        kk.logit_rows(torch.randn(3, 5).half(), y)
    with pytest.raises(kk.KernelDTypeError, match=r"labels is torch\.int32"):
        kk.logit_rows(torch.randn(3, 5), y.int())
    with pytest.raises(kk.KernelInputError, match=r"labels must be \[n\] = \[3\], got \[4\]"):
        kk.logit_rows(torch.randn(3, 5), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(kk.KernelInputError, match="logits must be"):
        kk.logit_rows(torch.randn(3, 5, 2), y)


def test_empty_rows() -> None:
    got = kk.logit_rows(torch.empty(0, 7, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int64))
    assert got.lse.shape == (0,)
    assert got.grad is not None
    assert got.grad.shape == (0, 7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_each_narrower_isa_path_matches_oracle(isa: str) -> None:
    # Imported here: the child imports this module alone, outside the test package.
    from ._isa_child import mismatches_on_isa

    assert mismatches_on_isa("test_logit_rows", "logit_rows_isa", isa) == []


def test_out_receives_the_gradient_and_is_checked() -> None:
    for contiguous in (True, False):
        x = _logits(6, 301, 3.0, 0.0, torch.bfloat16)
        x = x if contiguous else x.t().contiguous().t()
        y = _labels(6, 301, -100)
        want = kk.logit_rows(x, y)
        buf = torch.full((6, 301), 7.0, dtype=torch.bfloat16)
        got = kk.logit_rows(x, y, out=buf)
        assert got.grad is not None
        assert got.grad.data_ptr() == buf.data_ptr()
        assert torch.equal(buf, want.grad)
        assert torch.equal(got.lse, want.lse)
    with pytest.raises(kk.KernelInputError, match=r"out must be a contiguous torch\.bfloat16"):
        kk.logit_rows(x, y, out=torch.empty(6, 301))
    with pytest.raises(kk.KernelInputError, match="not contiguous"):
        kk.logit_rows(x, y, out=torch.empty(301, 6, dtype=torch.bfloat16).t())
