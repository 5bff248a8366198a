"""Golden values per activation: 3 tokens, float64, checked against numbers computed by hand.

The expected values below were computed ONCE, outside this package, by a scalar float64
program that uses only Python's ``math`` module (no torch, no kt-kernel code): for each
(token, slot) it forms the gate/up pre-activations ``GU[e] @ x + GUB[e]``, applies the
activation formula written out with ``math.exp``/``math.tanh`` and ``min``/``max`` clamps, the
down projection plus ``DNB[e]``, and sums ``w * output`` per token. ``dx`` and ``dw`` (d
topk_weights, for upstream gradient ``DY``) come from the hand-derived derivatives of each
formula, which that program checked against central finite differences (h = 1e-6, agreement
< 1e-6). Clamp limits (1.7) lie away from every pre-activation (nearest is 1.75), and some
gate and up values are clamped. Both the native op and the reference must match in float64.
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk

X = [[0.5, -1.0], [2.0, 0.25], [-1.5, 1.0]]
IDS = [[0, 1], [1, 0], [0, 1]]
W = [[0.75, 0.25], [0.5, 0.5], [0.125, 1.0]]
GU = [
    [[1.0, 2.0], [-1.5, 0.5], [0.5, -1.0], [2.0, 1.0]],
    [[-2.0, 1.0], [3.0, 0.5], [1.0, 1.5], [-0.5, 2.5]],
]
DN = [[[1.0, -0.5], [0.25, 2.0]], [[-1.0, 0.5], [1.5, 1.0]]]
GUB = [[0.5, -0.25, 0.125, -1.0], [0.25, 0.5, -0.5, 1.0]]
DNB = [[0.1, -0.2], [0.3, 0.05]]
DY = [[1.0, -2.0], [0.5, 1.5], [-1.0, 0.25]]

ACTIVATIONS = {
    "swiglu": kk.SwiGLU(),
    "clamped_swiglu": kk.ClampedSwiGLU(alpha=1.702, limit=1.7),
    "swiglu_limit": kk.SwiGLULimit(limit=1.7),
    "gelu_tanh_gated": kk.GeluTanhGated(),
}

# name: (y [3, 2], dx [3, 2], d topk_weights [3, 2])
GOLDEN = {
    "swiglu": (
        [
            [-0.5953827966382184, -0.18717832107228438],
            [2.687082315031514, 1.7334080525181383],
            [2.474300280650713, -5.323581602132304],
        ],
        [
            [4.8000885828843876, 0.5008541595339968],
            [0.14142586009297675, 13.713026519298912],
            [8.739251219070761, 8.547095779706346],
        ],
        [
            [-0.916269512884777, 1.8647039206797325],
            [7.124859863308913, 0.7624466092770164],
            [-5.9673415964590255, -3.0592779816264106],
        ],
    ),
    "clamped_swiglu": (
        [
            [-0.25703569492073797, -0.43382651677459405],
            [2.3869675313644545, 1.5518626234589188],
            [-0.5006925332394597, 0.9102902740121492],
        ],
        [
            [1.68084856087687, 0.5296288945710643],
            [-0.17555500565499027, 2.7498911026281676],
            [2.2693016933114936, 3.5820735095359924],
        ],
        [
            [0.31688247204522535, 1.4918219383781244],
            [4.762980144664155, 2.279575257077056],
            [-0.7819644025128278, 0.8260106520566005],
        ],
    ),
    "swiglu_limit": (
        [
            [-0.5877180359239029, -0.17184879964365368],
            [1.1965632731795235, 0.17701005841824974],
            [0.948229075903778, -1.8754874744122652],
        ],
        [
            [4.511572965275598, 1.640806133984754],
            [0.18880741772074544, 2.312875083176806],
            [2.1998565098096283, 3.4185721903172546],
        ],
        [
            [-0.9162695128847768, 1.7727267921079477],
            [1.4919525450368045, 0.23564090339746813],
            [-1.4798733305269371, -1.2321167781909772],
        ],
    ),
    "gelu_tanh_gated": (
        [
            [-0.3839144324040838, -0.6006225228874587],
            [2.5486054746205555, 2.3143215388703573],
            [2.7312350859802317, -5.071507314714039],
        ],
        [
            [4.139468744739663, -0.9067265387042324],
            [-0.15987816466445626, 14.20294975590619],
            [8.588528833940277, 8.706715985300873],
        ],
        [
            [-0.061108410045761424, 3.4526476836206186],
            [7.469071851443123, 2.0224982397885043],
            [-6.323243778537714, -3.2087064423415272],
        ],
    ),
}


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_float64(name: str, backend: str) -> None:
    spec = kk.ExpertSpec(2, 2, 2, activation=ACTIVATIONS[name])
    f64 = torch.float64
    weights = kk.ExpertWeights.from_fused(
        spec,
        torch.tensor(GU, dtype=f64),
        torch.tensor(DN, dtype=f64),
        gate_up_bias=torch.tensor(GUB, dtype=f64),
        down_bias=torch.tensor(DNB, dtype=f64),
    )
    x = torch.tensor(X, dtype=f64, requires_grad=True)
    w = torch.tensor(W, dtype=f64, requires_grad=True)
    y = kk.moe_experts_forward(x, torch.tensor(IDS), w, weights, backend=backend)
    y.backward(torch.tensor(DY, dtype=f64))
    y_exp, dx_exp, dw_exp = (torch.tensor(v, dtype=f64) for v in GOLDEN[name])
    torch.testing.assert_close(y.detach(), y_exp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, dx_exp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, dw_exp, rtol=1e-12, atol=1e-12)
