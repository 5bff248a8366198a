"""The op's bf16 LoRA products on the kernel's own routines (lora_products.cpp): AVX512_BF16, and
AMX-BF16 tiles from 16 rows where the CPU has AMX (a child with KT_KERNEL_AMX=0 runs without).

Every output of forward + backward (y, dx, the routing-weight gradient and each LoRA factor
gradient) is checked against the float64 oracle with the routines on and with them off (ATen's
products, ``torch.ops.kt_kernel.set_lora_products``), on both LoRA layouts, both policies,
odd sizes and ranks, ranks above 32 and experts with no rows or one row. Where the CPU has no
AVX512_BF16 the routines are off and these tests skip; the conformance and forced-ISA suites
run the ATen products there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

OP_BF16_TOL = 3e-2  # the whole op in bf16: test_conformance's bound
# (H, I, E, rank, layout, tokens, top_k, policy)
CASES = [
    (96, 80, 4, 4, "fused", 40, 2, "save"),
    (97, 81, 5, 3, "split", 41, 2, "recompute"),  # odd H, I and rank
    (256, 192, 8, 16, "split", 64, 2, "save"),
    (64, 48, 4, 40, "fused", 30, 2, "recompute"),  # rank above 32: several column blocks
    (64, 48, 6, 33, "split", 3, 1, "save"),  # experts with no row and with one row
    (2048, 96, 4, 16, "fused", 24, 2, "save"),  # H = 2048: rows at a 4 KiB stride
]


def _products_run() -> bool:
    """Whether the routines can run here (switched on, whatever an earlier test left)."""
    if kk.backend_info().active != "native":
        return False
    torch.ops.kt_kernel.set_lora_products(1)
    return bool(torch.ops.kt_kernel.lora_products())


@pytest.fixture(autouse=True)
def _default_switch():
    yield
    if kk.backend_info().active == "native":
        torch.ops.kt_kernel.set_lora_products(-1)


def _problem(
    h: int,
    i: int,
    e: int,
    rank: int,
    layout: str,
    tokens: int,
    k: int,
    seed: int = 0,
    weight_dtype: str = "bf16",
):
    gen = torch.Generator().manual_seed(seed)
    spec = kk.ExpertSpec(e, h, i)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    weights = kk.ExpertWeights.from_fused(
        spec, gate_up, down, dtype=torch.bfloat16, weight_dtype=weight_dtype
    )
    lora = kk.LoraBuffers(spec, rank, 2.0 * rank, layout, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, e, generator=gen).topk(k, -1).indices
    tw = torch.rand(tokens, k, generator=gen)
    dy = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
    return weights, lora, x, ids, tw, dy


def _run(weights, lora, x, ids, tw, dy, backend: str, policy: str) -> list[torch.Tensor]:
    xg, wg = x.clone().requires_grad_(), tw.clone().requires_grad_()
    for p in lora.parameters():
        p.grad = None
    y = kk.moe_experts_forward(xg, ids, wg, weights, lora, policy=policy, backend=backend)
    y.backward(dy)
    return [t.detach() for t in [y, xg.grad, wg.grad, *[p.grad for p in lora.parameters()]]]


def _reference(weights, lora, x, ids, tw, dy, policy: str) -> list[torch.Tensor]:
    spec = weights.spec
    deq = weights.dequantized()
    w64 = kk.ExpertWeights.from_fused(
        spec, deq.gate_up.double(), deq.down.double(), dtype=torch.float64
    )
    lora64 = kk.LoraBuffers(spec, lora.rank, lora.alpha, lora.layout, dtype=torch.float64)
    with torch.no_grad():
        for (_, a), (_, b) in zip(lora64.named_parameters(), lora.named_parameters(), strict=True):
            a.copy_(b)
    return _run(w64, lora64, x.double(), ids, tw.double(), dy.double(), "reference", policy)


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_ours_against_aten(problem, aten_problem, policy: str) -> None:
    """The op with the kernel's LoRA products on `problem`, and with ATen's on `aten_problem`
    (the same values), each against the float64 oracle: ours within the op's bound and no
    worse than ATen's (one fp32 sum per output, rounded once, against ATen's bf16 GEMMs)."""
    ref = _reference(*problem, policy)
    ops = torch.ops.kt_kernel
    ops.set_lora_products(0)
    aten = _run(*aten_problem, "native", policy)
    ops.set_lora_products(1)
    ours = _run(*problem, "native", policy)
    names = ["y", "dx", "d_weights"] + [n for n, _ in problem[1].named_parameters()]
    for name, a, b, r in zip(names, ours, aten, ref, strict=True):
        e_ours, e_aten = _err(a, r), _err(b, r)
        assert e_ours < OP_BF16_TOL, (name, e_ours)
        assert e_ours <= 1.25 * e_aten + 2e-3, (name, e_ours, e_aten)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[4]}-r{c[3]}-H{c[0]}-{c[7]}" for c in CASES])
def test_op_matches_the_float64_oracle_as_closely_as_atens_products(case) -> None:
    if not _products_run():
        pytest.skip("the kernel's LoRA products need AVX512_BF16")
    *shape, policy = case
    problem = _problem(*shape)
    _check_ours_against_aten(problem, problem, policy)


# bf16-packed experts (the products of the format's own routines, AMX from 16 rows): rows per
# expert from under 16 to several AMX row tiles ending in a half tile, so the LoRA products read
# whole row tiles of x in place and the rest from a padded copy; ranks 4, 16 and 40.
PACKED_CASES = [
    *CASES,
    (256, 192, 4, 16, "fused", 150, 2, "save"),
    (128, 96, 4, 40, "split", 100, 2, "recompute"),
    (2048, 96, 4, 16, "fused", 70, 2, "recompute"),
]


@pytest.mark.parametrize(
    "case", PACKED_CASES, ids=[f"{c[4]}-r{c[3]}-H{c[0]}-T{c[5]}-{c[7]}" for c in PACKED_CASES]
)
def test_packed_experts_with_the_products_match_the_oracle(case) -> None:
    """bf16-packed experts with the kernel's LoRA products against float64, and as close to it
    as the same values stored dense with ATen's LoRA products."""
    if not _products_run():
        pytest.skip("the kernel's LoRA products need AVX512_BF16")
    *shape, policy = case
    packed = _problem(*shape, weight_dtype="bf16-packed")
    _check_ours_against_aten(packed, (packed[0].dequantized(), *packed[1:]), policy)


def test_products_are_bitwise_across_thread_counts() -> None:
    if not _products_run():
        pytest.skip("the kernel's LoRA products need AVX512_BF16")
    problem = _problem(256, 192, 8, 16, "split", 64, 2, seed=5)
    got = {}
    try:
        for threads in (1, 3):
            kk.set_num_threads(threads)
            got[threads] = _run(*problem, "native", "save")
    finally:
        kk.set_num_threads(None)
    for a, b in zip(got[1], got[3], strict=True):
        assert torch.equal(a, b)


def test_switch_environment_and_default() -> None:
    if not _products_run():
        pytest.skip("the kernel's LoRA products need AVX512_BF16")
    ops = torch.ops.kt_kernel
    ops.set_lora_products(0)
    assert not ops.lora_products()
    ops.set_lora_products(-1)  # the default: on
    assert ops.lora_products()
    code = "import torch, kt_kernel; print(torch.ops.kt_kernel.lora_products())"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "KT_KERNEL_LORA_PRODUCTS": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want, value


_CHILD = """
import sys, torch
sys.path.insert(0, {here!r})
import test_lora_products as t
torch.ops.kt_kernel.set_lora_products(1)
problem = t._problem(*t.CASES[2][:7], seed=7)
got = t._run(*problem, "native", "save")
torch.save({{"got": got, "amx": torch.ops.kt_kernel.amx()}}, sys.argv[1])
"""


@pytest.mark.timeout(300)
def test_amx_tiles_and_avx512_agree_with_the_oracle_in_children() -> None:
    """The same problem with AMX tiles (where the CPU has them) and with KT_KERNEL_AMX=0."""
    if not _products_run():
        pytest.skip("the kernel's LoRA products need AVX512_BF16")
    here = os.path.dirname(__file__)
    out = {}
    for name, extra in (("default", {}), ("no_amx", {"KT_KERNEL_AMX": "0"})):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kt_lora_{os.getpid()}_{name}.pt")
        run = subprocess.run(
            [sys.executable, "-c", _CHILD.format(here=here), path],
            env={**os.environ, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = torch.load(path)
        os.remove(path)
    assert out["default"]["amx"] == torch.ops.kt_kernel.amx()
    assert not out["no_amx"]["amx"]
    problem = _problem(*CASES[2][:7], seed=7)
    ref = _reference(*problem, "save")
    for name in out:
        for a, r in zip(out[name]["got"], ref, strict=True):
            assert _err(a, r) < OP_BF16_TOL, (name, _err(a, r))
