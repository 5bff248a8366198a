"""``all_finite`` against ``torch.isfinite`` (in float64): every bit pattern of the 8- and 16-bit
floats, edge and random patterns of float32/float64, NaN and +-inf at the first, a middle and
the last element of tensors that are and are not multiples of the vector width and of the
native loop's 4096-element block, on each ISA path (its own subprocess, KT_KERNEL_ISA) and on
the PyTorch path (non-contiguous input).
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SIZES = (1, 2, 31, 64, 4095, 4096, 4097, 3 * 4096 + 5, 100_003)


def _oracle(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.to(torch.float64)).all())


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of an 8/16-bit float; edges and 4096 random ones of wider floats."""
    size = dtype.itemsize
    if size <= 2:
        n = 1 << (8 * size)
        bits = torch.arange(n, dtype=torch.int64)
        bits = torch.where(bits >= n // 2, bits - n, bits) if size == 2 else bits
        return bits.to(INTS[size]).view(dtype)
    finfo = torch.finfo(dtype)
    edges = torch.tensor(
        [
            finfo.max,
            -finfo.max,
            finfo.tiny,
            finfo.smallest_normal / 4,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
        ],
        dtype=dtype,
    )
    ints = INTS[size]
    raw = torch.randint(torch.iinfo(ints).min, torch.iinfo(ints).max, (4096,), dtype=ints)
    exp_ones = raw | (0x7FF0_0000_0000_0000 if size == 8 else 0x7F80_0000)
    return torch.cat([edges, raw.view(dtype), exp_ones.view(dtype)])


def _bad_values(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """NaN, +inf and -inf as ``dtype`` holds them (E4M3FN: its two NaNs, no inf)."""
    if dtype == torch.float8_e4m3fn:
        return {
            "nan": torch.tensor([0x7F], dtype=torch.uint8).view(dtype),
            "-nan": torch.tensor([0xFF], dtype=torch.uint8).view(dtype),
        }
    return {
        name: torch.tensor([v], dtype=dtype)
        for name, v in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf")))
    }


def _finite_base(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` finite values including the largest, the smallest subnormal and -0."""
    finfo = torch.finfo(dtype)
    t = (torch.randn(n, dtype=torch.float64) * 2).to(dtype)
    specials = torch.tensor([finfo.max, -finfo.max, -0.0, finfo.smallest_normal], dtype=dtype)
    t[: min(n, 4)] = specials[: min(n, 4)]
    return t


def mismatches() -> list[str]:
    """Every case where ``all_finite`` disagrees with the oracle (empty when none)."""
    torch.manual_seed(0)
    bad = []
    for dtype in kk.FINITE_DTYPES:
        for i, x in enumerate(_patterns(dtype)):
            one = x.reshape(1)
            if kk.all_finite(one) != _oracle(one):
                bad.append(f"{dtype} pattern {i}: {one.view(INTS[dtype.itemsize]).item():#x}")
        for n in SIZES:
            base = _finite_base(dtype, n)
            if not kk.all_finite(base) or not _oracle(base):
                bad.append(f"{dtype} n={n}: finite tensor refused")
            for name, value in _bad_values(dtype).items():
                for where in sorted({0, n // 2, n - 1}):
                    t = base.clone()
                    t[where] = value
                    if kk.all_finite(t) or _oracle(t):
                        bad.append(f"{dtype} n={n}: {name} at {where} not caught")
                    if kk.all_finite(t.view(1, n)) != _oracle(t):
                        bad.append(f"{dtype} n={n}: {name} at {where}, 2-d view")
    return bad


def test_matches_isfinite_on_the_selected_isa() -> None:
    assert mismatches() == []


def test_non_contiguous_input_takes_the_torch_path_and_agrees() -> None:
    torch.manual_seed(1)
    for dtype in kk.FINITE_DTYPES:
        base = _finite_base(dtype, 2 * 4097)
        for name, value in _bad_values(dtype).items():
            for where in (0, 4096, 2 * 4097 - 2):  # even: in t[::2], not in t[1::2]
                t = base.clone()
                t[where] = value
                assert not kk.all_finite(t[::2]), (dtype, name, where)
                assert kk.all_finite(t[1::2]), (dtype, name, where)  # the value is not in it


def test_other_dtypes_are_one_clear_error() -> None:
    for t in (torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.complex64)):
        with pytest.raises(kk.KernelDTypeError, match=rf"all_finite: t is {t.dtype}; expected"):
            kk.all_finite(t)


def test_empty_tensor_is_finite() -> None:
    for dtype in kk.FINITE_DTYPES:
        assert kk.all_finite(torch.empty(0, 3, dtype=dtype))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_each_narrower_isa_path_matches_isfinite(isa: str) -> None:
    # Imported here: the child imports this module alone, outside the test package.
    from ._isa_child import mismatches_on_isa

    assert mismatches_on_isa("test_finite", "all_finite_isa", isa) == []
