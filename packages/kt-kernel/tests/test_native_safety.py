"""The native ops validate their own inputs: a direct call with inconsistent tensors raises a
Python exception naming the argument (never a segfault or an out-of-bounds read).

``torch.ops.kt_kernel.*`` is reachable from any code in the process, without the Python
validation of :func:`kt_kernel.moe_experts_forward` in front of it. Each case runs in one
subprocess so that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

# Each case: (name, python expression evaluated in the child, expected exception type name,
# a substring the message must contain). The child defines good arguments `a` (a dict) and
# `call(**overrides)` / `bwd(**overrides)` that call the native ops with them replaced.
CASES = [
    ("x_too_few_rows", "call(x=x[:5])", "ValueError", "topk_ids has 37 rows but x has 5"),
    ("w_too_few_rows", "call(w=w[:30])", "ValueError", "topk_weights must have the shape"),
    ("w_wrong_dtype", "call(w=w.double())", "TypeError", "topk_weights must be"),
    ("ids_too_large", "call(ids=ids.clone().fill_(8))", "IndexError", "topk_ids must lie in"),
    ("ids_negative", "call(ids=ids.clone().fill_(-1))", "IndexError", "topk_ids must lie in"),
    ("ids_float", "call(ids=ids.float())", "TypeError", "topk_ids must be an integer"),
    ("x_1d", "call(x=x[0])", "ValueError", "x must be a 2-D"),
    ("gate_up_experts", "call(gu=[gu[:7]])", "ValueError", "gate_up part 0 (weight)"),
    ("down_experts", "call(dn=[dn[:7]])", "ValueError", "down part 0 (weight)"),
    ("down_transposed", "call(dn=[dn.transpose(1, 2).contiguous()])", "ValueError", "down part 0"),
    ("gate_up_dtype", "call(gu=[gu.double()])", "TypeError", "dense gate_up/down must have"),
    ("num_experts_lies", "call(E=9)", "ValueError", "gate_up part 0 (weight)"),
    ("inter_lies", "call(I=33)", "ValueError", "gate_up part 0 (weight)"),
    (
        "lora_experts",
        "call(lora=[l[:7] if i == 0 else l for i, l in enumerate(lora)])",
        "ValueError",
        "lora[0] (gate_lora_a)",
    ),
    (
        "lora_rank",
        "call(lora=lora[:3] + [lora[3][:, :, :3]] + lora[4:])",
        "ValueError",
        "lora[3] (up_lora_b)",
    ),
    ("lora_count", "call(lora=lora[:5])", "ValueError", "lora must hold 6 tensors"),
    ("lora_dtype", "call(lora=[l.double() for l in lora])", "TypeError", "lora[0] (gate_lora_a)"),
    ("bias_shape", "call(gub=torch.zeros(8, 63))", "ValueError", "gate_up_bias must have shape"),
    ("down_bias_dtype", "call(dnb=torch.zeros(8, 64).double())", "TypeError", "down_bias must be"),
    ("activation", "call(act=7)", "ValueError", "activation must be an id in [0, 4)"),
    (
        "activation_params",
        "call(act=1, params=[1.0])",
        "ValueError",
        "activation_params for clamped_swiglu",
    ),
    ("format", "call(fmt='int3')", "ValueError", "unknown weight format 'int3'"),
    ("tile_rows", "call(tile=17)", "ValueError", "tile_rows must be a positive multiple"),
    (
        "int8_scale",
        "call(fmt='int8', gu=[q8, s8[:, :5]], dn=dn8)",
        "ValueError",
        "gate_up part 1 (scale)",
    ),
    (
        "int8_q_dtype",
        "call(fmt='int8', gu=[q8.float(), s8], dn=dn8)",
        "TypeError",
        "gate_up part 0 (q)",
    ),
    ("dy_rows", "bwd(dy=x[:5])", "ValueError", "dy must have the shape of x"),
    ("saved_pos", "bwd(saved=[saved[0], saved[1][:3], saved[2]])", "ValueError", "saved[1] (pos)"),
    (
        "saved_perm",
        "bwd(saved=[saved[0].clone().fill_(10**9), saved[1], saved[2]])",
        "ValueError",
        "saved[0] (perm)",
    ),
    (
        "saved_offsets",
        "bwd(saved=[saved[0], saved[1], saved[2][:4]])",
        "ValueError",
        "saved[2] (offsets)",
    ),
    (
        "saved_gu",
        "bwd(saved=saved_full[:3] + [saved_full[3][:, :5]] + saved_full[4:])",
        "ValueError",
        "saved[3]",
    ),
    (
        "tile_range",
        "ops.dequantize_tile('int8', [q8, s8], 64, 64, 60, 0, 8, 64, torch.float32)",
        "ValueError",
        "out of range of [64, 64]",
    ),
    # Index arithmetic that wraps int64: `col0 + cols` or `row0 + rows` near 2**63 once passed
    # the bounds check (a segfault for columns, a tile read from outside the storage for rows).
    *[
        (
            f"tile_{axis}_overflow_{fmt}",
            f"ops.dequantize_tile('{fmt}', parts['{fmt}'], 64, 64, {start}, torch.float32)",
            "ValueError",
            "out of range of [64, 64]",
        )
        for fmt in ("int8", "int4_g32", "fp8", "mxfp4", "dense")
        for axis, start in (
            ("col", "0, 2**63 - 1, 1, 1"),
            ("row", "2**63 - 1, 0, 1, 64"),
            ("row_len", "1, 0, 2**63 - 1, 64"),
            ("col_len", "0, 8, 1, 2**63 - 8"),
        )
    ],
    *[
        (
            f"tile_shape_overflow_{fmt}",
            f"ops.dequantize_tile('{fmt}', parts['{fmt}'], {n}, 0, 1, 1, torch.float32)",
            "ValueError",
            "",
        )
        for fmt in ("int4_g32", "fp8", "mxfp4")
        for n in ("2**63 - 1, 64, 0", "64, 2**63 - 1, 0", "-64, 64, 0")
    ],
    (
        "project_n_negative",
        "ops.project('int8', [q8, s8], -64, 64, 0, x, False)",
        "ValueError",
        "n and k must be >= 0",
    ),
    (
        "project_k_huge",
        "ops.project('int4_g32', parts['int4_g32'], 64, 2**63 - 1, 0, x, False)",
        "ValueError",
        "parts part 0 (packed)",
    ),
    (
        "project_expert_huge",
        "ops.project('int8', [q8, s8], 64, 64, 2**63 - 1, x, False)",
        "IndexError",
        "expert must lie in",
    ),
    # tile_rows near INT64_MAX: `b + tile_rows` wrapped (segfault); it is one task per expert.
    ("tile_rows_huge_forward", "same(call(tile=2**63 - 16)[0], call()[0])", "no error", ""),
    ("tile_rows_huge_backward", "same(bwd(dy=dy, tile=2**63 - 16), bwd(dy=dy))", "no error", ""),
    (
        "tile_rows_huge_int8",
        "same(call(fmt='int8', gu=[q8, s8], dn=dn8, tile=2**63 - 8)[0],"
        " call(fmt='int8', gu=[q8, s8], dn=dn8)[0])",
        "no error",
        "",
    ),
    ("inter_overflow", "call(I=2**62 + 16)", "ValueError", "intermediate_size must be > 0 and"),
    # saved[3] is read through raw row pointers: an expanded view of the right shape was read
    # past its one-row storage.
    (
        "saved_gu_expanded",
        "bwd(saved=saved_full[:3] + [saved_full[3][:1].expand_as(saved_full[3])] + saved_full[4:])",
        "ValueError",
        "saved[3] (gate_up pre-activations) must be a contiguous",
    ),
    ("num_threads_wraps", "ops.set_num_threads(2**32 + 1)", "ValueError", "at most 1024"),
    ("num_threads_huge", "ops.set_num_threads(2**63 - 1)", "ValueError", "at most 1024"),
    (
        "gemv_rows_huge",
        "(ops.set_gemv_rows(2**63 - 1), project_all(), ops.set_gemv_rows(-1))",
        "no error",
        "",
    ),
    (
        "attention_lse_rows",
        "ops.attention_backward(ao, aq, ake, ake, ao, alse[:, :, :3], 0.5)",
        "ValueError",
        "lse must be",
    ),
    # Stride-0 (expanded) heads are read in place, never past their storage.
    ("attention_expanded_kv", "same(attn(ake), attn(ake.contiguous()))", "no error", ""),
]

CHILD = r"""
import json, sys, torch, kt_kernel as kk
from kt_kernel.formats import quantize_per_channel
ops = torch.ops.kt_kernel
torch.manual_seed(0)
x = torch.randn(37, 64)
ids = torch.rand(37, 8).topk(3, -1).indices
w = torch.rand(37, 3)
gu, dn = torch.randn(8, 64, 64), torch.randn(8, 64, 32)
q8, s8 = quantize_per_channel(gu)
dn8 = list(quantize_per_channel(dn))
lora = [torch.randn(8, 4, 64), torch.randn(8, 32, 4), torch.randn(8, 4, 64),
        torch.randn(8, 32, 4), torch.randn(8, 4, 32), torch.randn(8, 64, 4)]

def call(x=x, ids=ids, w=w, fmt="dense", gu=[gu], dn=[dn], gub=None, dnb=None, E=8, I=32,
         act=0, params=[], lora=lora, tile=256):
    if fmt == "int8" and tile == 256:
        tile = 512
    return ops.forward(x, ids, w, fmt, gu, dn, gub, dnb, E, I, act, params, lora, 0.5, False,
                       False, tile)

_, saved = call()
_, saved_full = ops.forward(x, ids, w, "dense", [gu], [dn], None, None, 8, 32, 0, [],
                            lora, 0.5, False, True, 256)

def bwd(dy=None, saved=saved, tile=256):
    dy = torch.randn(37, 64) if dy is None else dy
    return ops.backward(dy, x, ids, w, "dense", [gu], [dn], None, None, 8, 32, 0, [],
                        lora, 0.5, False, saved, True, tile)

def same(a, b):
    a, b = (a, b) if isinstance(a, (tuple, list)) else ([a], [b])
    for u, v in zip(a, b):
        u, v = (u, v) if isinstance(u, (tuple, list)) else ([u], [v])
        for s, t in zip(u, v):
            if not torch.allclose(s, t, rtol=1e-5, atol=1e-5):
                raise AssertionError("results differ")

dy = torch.randn(37, 64)
parts = {"int8": [q8, s8], "dense": [gu]}
for name, fmt in (("int4_g32", kk.Int4Grouped(torch.float32, group_size=32)),
                  ("fp8", kk.Fp8Block(torch.float32)), ("mxfp4", kk.Mxfp4(torch.float32))):
    parts[name] = list(fmt.native_args(fmt.quantize(gu)))

def project_all():
    for name, p in parts.items():
        for nn in (False, True):
            ops.project(name, p, 64, 64, 3, x[:5] if name != "dense" else x[:5], nn)

aq = torch.randn(2, 4, 9, 8)
ake = torch.randn(1, 1, 9, 8).expand(2, 2, 9, 8)
ao, alse = ops.attention_forward(aq, ake, ake, 0.5)

def attn(kv):
    out, lse = ops.attention_forward(aq, kv, kv, 0.5)
    return [out, lse, *ops.attention_backward(out, aq, kv, kv, out, lse, 0.5)]

bwd()  # the good arguments work
results = {}
for name, expr in json.loads(sys.argv[1]):
    print("case", name, file=sys.stderr, flush=True)  # names the case a crash died in
    try:
        eval(expr)
        results[name] = ["no error", ""]
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        results[name] = [type(exc).__name__, str(exc).splitlines()[0]]
print(json.dumps(results))
"""


@pytest.mark.skipif(kk.backend_info().active != "native", reason="needs the native extension")
def test_native_ops_reject_inconsistent_inputs_without_crashing() -> None:
    cases = json.dumps([[name, expr] for name, expr, _, _ in CASES])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, cases], capture_output=True, text=True, env=env, timeout=120
    )
    started = [line for line in out.stderr.splitlines() if line.startswith("case ")]
    assert out.returncode == 0, f"child died with {out.returncode} in {started[-1:]}: " + "\n".join(
        line for line in out.stderr.splitlines()[-40:] if not line.startswith("case ")
    )
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for name, _, exc_type, needle in CASES:
        got_type, msg = results[name]
        assert got_type == exc_type, (name, got_type, msg)
        # An empty needle: the type alone is the claim (the checker's message names the part).
        assert needle in msg, (name, msg)


def test_extension_module_exposes_no_unchecked_entry_points() -> None:
    mod = kk._native.native_module()
    if mod is None:
        pytest.skip("needs the native extension")
    assert [n for n in dir(mod) if not n.startswith("__")] == []


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("name", ["gate_lora_a", "down_lora_b"])
def test_lora_buffer_swapped_through_data_is_named(kt, backend: str, name: str) -> None:
    p = kt.make_problem()
    t = getattr(p.lora, name)
    bad = list(t.shape)
    bad[1] += 1
    t.data = torch.zeros(bad)
    with pytest.raises(kk.KernelInputError, match=rf"LoRA buffer {name} has shape"):
        kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, p.lora, backend=backend)
