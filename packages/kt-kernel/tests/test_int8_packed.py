"""The int8-packed format: int8's values stored once in the layout its AMX products stream.

The layout against int8's ``q`` and scales element by element; for both integer packed
formats, row selection and fusing, the memory against their unpacked twins, and where their
own products run.
Its tile loader (against the Python ``dequantize``, bitwise), its products and the whole op
(against float64) run in test_bf16_packed (``PACKED``), and the per-format conformance suite
runs it by its registration.
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk


def _weights(n: int, k: int, experts: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, n, k, generator=gen)


def test_layout_holds_int8s_values_in_tile_order() -> None:
    w = _weights(21, 7)  # a partial block of 5 rows, an odd K
    packed, scale, shape = kk.Int8Packed().quantize(w)
    q, scale8 = kk.Int8PerChannel().quantize(w)
    assert packed.shape == (2, 2, 32 * 16 + 64)
    assert packed.dtype == torch.int8
    assert torch.equal(scale, scale8)
    assert shape.tolist() == [[21, 7], [21, 7]]
    for b in range(2):
        for p in range(4):
            for row in range(16):
                for h in range(2):
                    n, k = 16 * b + row, 2 * p + h
                    want = q[1, n, k] if n < 21 and k < 7 else 0
                    assert int(packed[1, b, 32 * p + 2 * row + h]) == int(want), (b, p, row, h)
    assert not packed[..., 32 * 4 :].any()  # pairs past K and the pad are zeros
    want = kk.Int8PerChannel().dequantize((q, scale8)).bfloat16()
    assert torch.equal(kk.Int8Packed().dequantize((packed, scale, shape)), want)


@pytest.mark.parametrize(
    ("packed", "base", "gate_rows", "up_rows", "k"),
    [("int8-packed", "int8", 16, 16, 8), ("int4-packed", "int4", 16, 24, 80)],
)
def test_select_rows_and_fuse_gate_up_keep_the_quantised_values(
    packed: str, base: str, gate_rows: int, up_rows: int, k: int
) -> None:
    f, fb = kk.FORMATS[packed](torch.bfloat16), kk.FORMATS[base](torch.bfloat16)
    gate, up = _weights(gate_rows, k, seed=1), _weights(up_rows, k, seed=2)
    fused = f.fuse_gate_up(f.quantize(gate), f.quantize(up))
    both = torch.cat([fb.dequantize(fb.quantize(gate)), fb.dequantize(fb.quantize(up))], 1)
    assert torch.equal(f.dequantize(fused), both)
    index = torch.arange(gate_rows + up_rows).flip(0)
    assert torch.equal(f.dequantize(f.select_rows(fused, index)), both[:, index])


@pytest.mark.parametrize("fmt", [kk.Int8Packed, kk.Int4Packed])
def test_own_products_run_exactly_where_amx_tiles_do(fmt: type[kk.Int8Packed]) -> None:
    native = kk.backend_info().active == "native"
    assert fmt.own_products_here() == (native and bool(torch.ops.kt_kernel.amx()))


def test_compute_dtypes_other_than_bf16_are_refused_by_name() -> None:
    with pytest.raises(kk.KernelDTypeError, match=r"'int8-packed'.*must be torch\.bfloat16"):
        kk.Int8Packed(torch.float32)


@pytest.mark.parametrize(("base", "packed"), [("int8", "int8-packed"), ("int4", "int4-packed")])
def test_memory_is_within_one_percent_of_the_unpacked_format(base: str, packed: str) -> None:
    spec = kk.ExpertSpec(4, 2048, 768)
    gate_up, down = torch.zeros(4, 2 * 768, 2048), torch.zeros(4, 2048, 768)
    bf16 = torch.bfloat16
    plain = kk.ExpertWeights.from_fused(spec, gate_up, down, dtype=bf16, weight_dtype=base)
    repacked = kk.ExpertWeights.from_fused(spec, gate_up, down, dtype=bf16, weight_dtype=packed)
    assert plain.nbytes < repacked.nbytes <= 1.01 * plain.nbytes
