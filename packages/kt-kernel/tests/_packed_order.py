"""Exact-order models of bf16-packed's vdpbf16ps products, and their bitwise check.

Kept apart from test_bf16_packed so that a child process (KT_KERNEL_AMX=0) can import it.
"""

from __future__ import annotations

import torch

import kt_kernel as kk

# (N, K): one block; odd blocks; odd N and K; 6 column pairs with the 12th column past K; real K
SHAPES = [(16, 2), (48, 256), (80, 70), (37, 129), (9, 5), (32, 11), (32, 2048)]
ROWS = [1, 3, 4, 5, 6, 11, 12, 13, 16, 29, 64]
AMX_ROWS = 16  # rows from which AMX tile products take over where the CPU has AMX
NN_WIDE_ROWS = 48  # rows from which dy W sums W's row pairs in order (nn_wide)


def weights(n: int, k: int, experts: int = 2, seed: int = 0) -> torch.Tensor:
    """Random bf16 expert weights ``[experts, n, k]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, n, k, generator=gen).to(torch.bfloat16)


def vdpbf16(acc: torch.Tensor, a_odd, b_odd, a_even, b_even) -> torch.Tensor:
    """One vdpbf16ps lane: the odd element's exact product first, then the even one's (fp32)."""
    acc = acc + a_odd.float() * b_odd.float()
    return acc + a_even.float() * b_even.float()


def model_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x W^T`` as the packed product sums it: per output, column pairs in order.

    An odd K ends with the last column alone (its pair's other half adds an exact zero).
    From NN_WIDE_ROWS rows, ``dy W`` sums the same way: ``model_nt(dy, W^T)``.
    """
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(w.shape[1] // 2):
        c = 2 * p
        acc = vdpbf16(acc, x[:, None, c + 1], w[None, :, c + 1], x[:, None, c], w[None, :, c])
    if w.shape[1] % 2:
        acc = acc + x[:, None, -1].float() * w[None, :, -1].float()
    return acc.to(torch.bfloat16)


def model_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dy W`` below NN_WIDE_ROWS rows: 16 lanes per column pair, then a fixed tree.

    Lane 2q + h holds column 2p + h and sums, block by block, rows 16b + 2q + 1 then 16b + 2q.
    Lanes i and i + 8 are added, then i and i + 4, then i and i + 2.
    """
    m, (n, k) = x.shape[0], w.shape
    rows = -(-n // 16) * 16  # zero rows up to whole blocks add exact zeros
    x = torch.cat([x, x.new_zeros(m, rows - n)], 1)
    w = torch.cat([w, w.new_zeros(rows - n, k)], 0)
    lanes = torch.zeros(m, k, 8)  # [row, column, q]
    for b in range(rows // 16):
        for q in range(8):
            i = 16 * b + 2 * q
            lanes[:, :, q] = vdpbf16(
                lanes[:, :, q], x[:, i + 1, None], w[None, i + 1], x[:, i, None], w[None, i]
            )
    # lane 2q + h of column pair p is lanes[:, 2p + h, q]
    h = lanes[..., 0:4] + lanes[..., 4:8]  # lanes i, i + 8 (q, q + 4)
    quarter = h[..., 0:2] + h[..., 2:4]  # then i, i + 4 (q, q + 2)
    return (quarter[..., 0] + quarter[..., 1]).to(torch.bfloat16)  # then i, i + 2 (q, q + 1)


def mismatches() -> list[str]:
    """The vdpbf16ps products (rows below AMX_ROWS where AMX tiles run) that differ from their
    exact-order model: both products, rows on both sides of NN_WIDE_ROWS."""
    ops = torch.ops.kt_kernel
    f = kk.Bf16Packed()
    gen = torch.Generator().manual_seed(5)
    bad = []
    for nn in (False, True):
        for n, k in SHAPES[:6]:
            parts = f.quantize(weights(n, k))
            w = f.dequantize(parts)[1]
            args = list(f.native_args(parts))
            for m in (*ROWS, NN_WIDE_ROWS - 1, NN_WIDE_ROWS, 97):
                if m >= AMX_ROWS and ops.amx():
                    continue  # AMX tiles sum in their own order: against float64 elsewhere
                x = torch.randn(m, n if nn else k, generator=gen).to(torch.bfloat16)
                got = ops.project(f.name, args, n, k, 1, x, nn)
                if not nn:
                    want = model_nt(x, w)
                elif m >= NN_WIDE_ROWS:
                    want = model_nt(x, w.t())
                else:
                    want = model_nn(x, w)
                if not torch.equal(got, want):
                    bad.append(f"{'dy W' if nn else 'x W^T'} N={n} K={k} rows={m}")
    return bad
