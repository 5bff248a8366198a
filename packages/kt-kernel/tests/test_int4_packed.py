"""The int4-packed format: int4's values stored once in the layout its AMX products stream.

The layout against int4's ``q`` and group scales element by element, the products of every
group size, and both integer packed formats' tile loaders at any offset on both ISA paths.
Memory, row selection and fusing, and where the products run are checked with int8-packed's
(test_int8_packed); the loader, products and whole op against float64 in test_bf16_packed
(``PACKED``); and the per-format conformance suite runs it by its registration.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kt_kernel as kk
from kt_kernel.formats_int4 import unpack_int4


def _weights(n: int, k: int, experts: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, n, k, generator=gen)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_layout_holds_int4s_values_in_tile_order(group_size: int) -> None:
    n, k = 21, 70  # a partial block of 5 rows, 35 column pairs (3 tile steps)
    w = _weights(n, k)
    packed, scale, shape = kk.Int4Packed(group_size=group_size).quantize(w)
    packed4, scale4 = kk.Int4Grouped(group_size=group_size).quantize(w)
    q = unpack_int4(packed4, n)
    ng = -(-k // group_size)
    assert packed.shape == (2, 2, 16 * 48 + 64)
    assert packed.dtype == torch.uint8
    assert scale.shape == (2, 2, 16 * ng)
    assert scale.dtype == torch.bfloat16
    assert shape.tolist() == [[n, k], [n, k]]
    for b in range(2):
        for p in range(48):
            for row in range(16):
                for h in range(2):
                    r, c = 16 * b + row, 2 * p + h
                    byte = int(packed[1, b, 16 * p + 2 * (row % 8) + h])
                    nibble = (byte >> 4 if row >= 8 else byte) & 0xF
                    want = int(q[1, r, c]) if r < n and c < k else 0
                    assert nibble - 8 == want, (b, p, row, h)
        for g in range(ng):
            for row in range(16):
                r = 16 * b + row
                want = float(scale4[1, r, g]) if r < n else 0.0
                assert float(scale[1, b, 16 * g + row]) == want
    assert not packed[..., 16 * 48 :].any()  # the pad ending each block
    want = kk.Int4Grouped(group_size=group_size).dequantize((packed4, scale4))
    f = kk.Int4Packed(group_size=group_size)
    assert torch.equal(f.dequantize((packed, scale, shape)), want)
    assert torch.equal(f.row_steps((packed, scale, shape)), scale4.float().amax(-1))


def test_bad_options_are_refused_by_name() -> None:
    with pytest.raises(kk.KernelDTypeError, match=r"'int4-packed'.*must be torch\.bfloat16"):
        kk.Int4Packed(torch.float32)
    with pytest.raises(kk.KernelInputError, match="group_size must be one of"):
        kk.Int4Packed(group_size=48)


@pytest.mark.parametrize("group_size", [32, 128])
def test_products_of_every_group_size_are_int4s(group_size: int) -> None:
    """The native products of G = 32 and 128 (64 runs in test_bf16_packed) against int4's."""
    if kk.backend_info().active != "native":
        pytest.skip("needs the native extension")
    ops = torch.ops.kt_kernel
    f, f4 = kk.Int4Packed(group_size=group_size), kk.Int4Grouped(group_size=group_size)
    n, k = 80, 300
    parts = f.quantize(_weights(n, k, seed=3))
    w = f.dequantize(parts)[1].double()
    args = list(f.native_args(parts))
    assert torch.equal(w, f4.dequantize(f4.quantize(_weights(n, k, seed=3)))[1].double())
    gen = torch.Generator().manual_seed(4)
    for m in (5, 32, 80):
        for nn in (False, True):
            x = torch.randn(m, n if nn else k, generator=gen).to(torch.bfloat16)
            ref = x.double() @ (w if nn else w.t())
            got = ops.project(f.name, args, n, k, 1, x, nn).double()
            assert float((got - ref).abs().max() / ref.abs().max()) < 1e-2, (m, nn)


def mismatches() -> list[str]:
    """Tiles of both integer packed formats whose bf16 loader values differ from dequantize.

    With AVX512_BF16 the loader widens and transposes whole blocks; tiles start at any row and
    column and end anywhere, including inside a block and a 32-column chunk.
    """
    if kk.backend_info().active != "native":
        return []
    bad = []
    formats = [kk.Int8Packed(), kk.Int4Packed(group_size=32), kk.Int4Packed(group_size=128)]
    for f in formats:
        for n, k in [(21, 7), (48, 70), (33, 129)]:
            parts = f.quantize(_weights(n, k, seed=n + k))
            args = list(f.native_args(parts))
            full = f.dequantize(parts, torch.bfloat16)
            for row0, col0 in itertools.product((0, 1, 16, n - 1), (0, 5, 16, 31, 32, k - 1)):
                if row0 >= n or col0 >= k:
                    continue
                for rows, cols in [(n - row0, k - col0), (1, 1), (min(3, n - row0), 40)]:
                    cols = min(cols, k - col0)
                    got = torch.ops.kt_kernel.dequantize_tile(
                        f.name, args, n, k, row0, col0, rows, cols, torch.bfloat16
                    )
                    want = full[:, row0 : row0 + rows, col0 : col0 + cols]
                    if not torch.equal(got, want):
                        bad.append(f"{f!r} {n}x{k} at ({row0}, {col0}) size ({rows}, {cols})")
    return bad


def test_tile_loader_is_dequantize_at_any_offset() -> None:
    assert mismatches() == []


def test_tile_loader_is_dequantize_on_avx2() -> None:
    """The scalar loader (no AVX512_BF16) gives the same tiles."""
    from ._isa_child import mismatches_on_isa

    assert mismatches_on_isa("test_int4_packed", "isa", "avx2") == []
