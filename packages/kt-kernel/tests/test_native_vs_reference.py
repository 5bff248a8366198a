"""Native kernel against the PyTorch reference: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk

FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). Both implementations round
# the gate/up pre-activation, h, the expert output and each LoRA intermediate to bf16
# (4-6 roundings in a chain) while every sum accumulates in fp32, so errors against an fp64
# oracle of a few 2e-3 are expected; 3e-2 (max-norm relative) is a safe bound, and the native
# error must also stay within 2x the reference's own bf16 error (+ 2e-3).
BF16_TOL = 3e-2


@pytest.mark.parametrize("layout", ["split", "fused", None])
@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_fp32_matches_reference(kt, layout: str | None, policy: str) -> None:
    p = kt.make_problem(rank=None if layout is None else 4, layout=layout or "split")
    ref = kt.run(p, "reference")
    nat = kt.run(p, "native", policy)
    assert ref.keys() == nat.keys()
    for name in ref:
        assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, name


@pytest.mark.timeout(60)
def test_fp32_matches_reference_tiled(kt) -> None:
    # 300 tokens all routed to expert 2 (plus spread slots): an expert spans several tiles.
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.full((300,), 2), torch.randint(3, 16, (300,), generator=gen)], 1)
    p = kt.make_problem(tokens=300, hidden=128, inter=96, experts=16, k=2, rank=8, ids=ids)
    ref = kt.run(p, "reference")
    for policy in ("save", "recompute"):
        nat = kt.run(p, "native", policy)
        for name in ref:
            assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, (policy, name)


@pytest.mark.parametrize("layout", ["split", "fused"])
def test_bf16_within_tolerance(kt, layout: str) -> None:
    p = kt.make_problem(
        tokens=64,
        hidden=128,
        inter=64,
        dtype=torch.bfloat16,
        layout=layout,
        lora_dtype=torch.float32,
    )
    # The oracle: the reference in float64 on exactly the same (bf16-valued) numbers.
    p64 = kt.make_problem(tokens=64, hidden=128, inter=64, dtype=torch.float64, layout=layout)
    p64.weights = kk.ExpertWeights.from_fused(
        p.spec, p.weights.gate_up, p.weights.down, dtype=torch.float64
    )
    with torch.no_grad():
        for (_, a), (_, b) in zip(
            p64.lora.named_parameters(), p.lora.named_parameters(), strict=False
        ):
            a.copy_(b.to(torch.bfloat16))
    p64.x, p64.ids, p64.w, p64.dy = p.x.double(), p.ids, p.w, p.dy.double()
    oracle = kt.run(p64, "reference")
    ref = kt.run(p, "reference")
    nat = kt.run(p, "native")
    for name in oracle:
        e_nat, e_ref = kt.rel_err(nat[name], oracle[name]), kt.rel_err(ref[name], oracle[name])
        assert e_nat < BF16_TOL, (name, e_nat)
        assert e_nat < 2 * e_ref + 2e-3, (name, e_nat, e_ref)
    assert nat["y"].dtype == torch.bfloat16
    assert nat["dx"].dtype == torch.bfloat16
    assert nat["dw"].dtype == torch.float32
    assert nat["gate_up_lora_a" if layout == "fused" else "gate_lora_a"].dtype == torch.float32


def _ids_const(tokens: int, k: int, expert: int) -> torch.Tensor:
    return torch.full((tokens, k), expert, dtype=torch.int64)


@pytest.mark.parametrize(
    "case",
    ["empty_experts", "one_expert", "k1", "t1", "e256", "t0", "int32_ids"],
)
def test_edge_cases(kt, case: str) -> None:
    kwargs: dict = {}
    if case == "empty_experts":
        kwargs = {"ids": torch.randint(0, 2, (37, 3)), "experts": 8}
    elif case == "one_expert":
        kwargs = {"ids": _ids_const(37, 2, 5), "k": 2}
    elif case == "k1":
        kwargs = {"k": 1}
    elif case == "t1":
        kwargs = {"tokens": 1, "k": 2}
    elif case == "e256":
        kwargs = {"experts": 256, "k": 8, "tokens": 40, "hidden": 32, "inter": 16}
    elif case == "t0":
        kwargs = {"tokens": 0, "ids": torch.zeros(0, 3, dtype=torch.int64)}
    p = kt.make_problem(**kwargs)
    if case == "int32_ids":
        p.ids = p.ids.to(torch.int32)
    if case == "t0":
        # No token: the reference's output does not depend on anything; the native op still
        # returns a differentiable empty output whose backward gives empty/zero gradients.
        nat = kt.run(p, "native")
        assert nat["y"].shape == (0, 64)
        assert nat["dx"].shape == (0, 64)
        assert nat["dw"].shape == (0, 3)
        assert torch.count_nonzero(nat["gate_lora_a"]) == 0
        return
    ref = kt.run(p, "reference")
    nat = kt.run(p, "native")
    for name in ref:
        assert nat[name].shape == ref[name].shape, name
        assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, name
    if case == "empty_experts":
        # Experts 2..7 received no token: their LoRA gradients are exactly zero.
        assert torch.count_nonzero(nat["gate_lora_a"][2:]) == 0
        assert torch.count_nonzero(nat["down_lora_b"][:2]) > 0


def test_non_contiguous_inputs(kt) -> None:
    p = kt.make_problem(tokens=20)
    ref = kt.run(p, "reference")
    wide = torch.zeros(20, 2 * p.spec.hidden_size)
    wide[:, ::2] = p.x
    x_nc = wide[:, ::2]
    assert not x_nc.is_contiguous()
    ids_nc = p.ids.t().contiguous().t()
    w_nc = p.w.t().contiguous().t()
    assert not ids_nc.is_contiguous()
    assert not w_nc.is_contiguous()
    p.ids, p.w = ids_nc, w_nc
    nat = kt.run(p, "native", x=x_nc)
    for name in ref:
        assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, name
    # LoRA factors given as non-contiguous views (as PEFT's rank-major lora_B unstacks).
    base = kt.make_problem(tokens=20, layout="fused")
    ref = kt.run(base, "reference")
    views = {}
    for name, t in base.lora.named_parameters():
        views[name] = torch.nn.Parameter(t.detach().transpose(0, -1).contiguous().transpose(0, -1))
    base.lora = kk.LoraBuffers.from_tensors(base.spec, 4, 8.0, "fused", views)
    nat = kt.run(base, "native")
    for name in ref:
        assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, name


def test_zero_routing_weights(kt) -> None:
    p = kt.make_problem()
    p.w = torch.zeros_like(p.w)
    ref = kt.run(p, "reference")
    nat = kt.run(p, "native")
    assert torch.count_nonzero(nat["y"]) == 0
    assert torch.count_nonzero(nat["dx"]) == 0
    assert torch.count_nonzero(nat["gate_lora_a"]) == 0
    # d topk_weights is still the expert output projected on dy: the router can learn.
    assert kt.rel_err(nat["dw"], ref["dw"]) < FP32_TOL
    assert nat["dw"].abs().max() > 0


def test_grad_accumulates_and_dx_optional(kt) -> None:
    p = kt.make_problem()
    once = kt.run(p, "native")
    lora = p.lora
    for _, t in lora.named_parameters():
        t.grad = None
    x = p.x.clone()  # no grad: the kernel skips dx but still gives LoRA and router grads
    w = p.w.clone().requires_grad_(True)
    for _ in range(2):
        kk.moe_experts_forward(x, p.ids, w, p.weights, lora, backend="native").backward(p.dy)
    for name, t in lora.named_parameters():
        assert kt.rel_err(t.grad, 2 * once[name]) < FP32_TOL, name
    assert kt.rel_err(w.grad, 2 * once["dw"]) < FP32_TOL


def test_reference_is_default_off_cpu_only_when_native_missing(kt) -> None:
    p = kt.make_problem()
    auto = kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, p.lora)
    nat = kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, p.lora, backend="native")
    if kk.backend_info().active == "native":
        assert torch.equal(auto, nat)


def test_inference_path_matches_autograd_path(kt) -> None:
    p = kt.make_problem()
    with torch.no_grad():
        infer = kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, p.lora, backend="native")
    train = kt.run(p, "native")["y"]
    assert torch.equal(infer, train)
