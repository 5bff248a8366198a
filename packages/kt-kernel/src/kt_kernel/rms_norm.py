"""``rms_norm``: a decoder's RMSNorm, forward and backward, in one fused pass per row.

transformers' RMSNorm modules upcast to fp32 and run ``pow``, ``mean``, ``rsqrt``, two
multiplies and two casts as separate ops, and autograd walks saved fp32 copies of the row
again in backward: about a dozen passes over fp32 tensors per norm, a memory-bound cost of
the same size as a whole attention layer's elementwise work. The native ops
(``torch.ops.kt_kernel.rms_norm_forward`` / ``rms_norm_backward``, ``csrc/rms_norm.cpp``) keep
only the per-row ``1/rms`` and read each input once per direction. Without the extension, or
off the CPU, the same contract runs in PyTorch.

With ``n = x * rsqrt(mean(x^2) + eps)`` in fp32 and ``S`` the dtype of ``x``, the forms are:

- ``round_first=True``: ``S(S(n) * weight)``, the Llama form (Qwen, DeepSeek-V3, GLM, Mixtral);
- ``round_first=False``: ``S(n * (weight + offset))`` in fp32 (GPT-OSS, Gemma-4; Qwen3-Next
  and Qwen3.5 with ``offset=1``);
- ``weight=None``: ``S(n)``.
"""

from __future__ import annotations

from typing import Any

import torch

from kt_kernel._native import native_module
from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = ["RMS_NORM_DTYPES", "rms_norm", "rms_norm_reference"]

RMS_NORM_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)


def _check(x: torch.Tensor, weight: torch.Tensor | None, round_first: bool, offset: float) -> None:
    if x.dtype not in RMS_NORM_DTYPES:
        raise KernelDTypeError(f"rms_norm: x is {x.dtype}; expected bfloat16 or float32")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise KernelInputError(f"rms_norm: x must be [..., H] with H >= 1, got {tuple(x.shape)}")
    if weight is not None and (weight.shape != x.shape[-1:] or weight.dtype != x.dtype):
        raise KernelInputError(
            f"rms_norm: weight must be a {x.dtype} tensor of [{x.shape[-1]}], got "
            f"{weight.dtype} {list(weight.shape)}"
        )
    if round_first and offset != 0.0:
        raise KernelInputError(
            f"rms_norm: offset={offset} needs round_first=False (the fp32 weight form)"
        )


def _native_ok(*tensors: torch.Tensor | None) -> bool:
    return native_module() is not None and all(t is None or t.device.type == "cpu" for t in tensors)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1/rms`` of each row of ``x`` ``[rows, H]`` in fp32, as transformers computes it."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def _scale_torch(
    n: torch.Tensor, weight: torch.Tensor | None, offset: float, round_first: bool, dtype: Any
) -> torch.Tensor:
    if weight is None:
        return n.to(dtype)
    if round_first:
        return weight * n.to(dtype)
    return (n * (weight.float() + offset)).to(dtype)


def _dn(
    dy: torch.Tensor, weight: torch.Tensor | None, offset: float, round_first: bool
) -> torch.Tensor:
    """fp32 gradient at the normalised row, rounded where autograd's chain rounds it."""
    if weight is None:
        return dy.float()
    if round_first:
        return (dy * weight).float()
    return dy.float() * (weight.float() + offset)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        offset: float,
        round_first: bool,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        w = None if weight is None else weight.contiguous()
        if _native_ok(rows, w):
            y, rstd = torch.ops.kt_kernel.rms_norm_forward(rows, w, eps, offset, round_first)
        else:
            rstd = _rstd(rows, eps)
            y = _scale_torch(rows.float() * rstd[:, None], w, offset, round_first, x.dtype)
        ctx.save_for_backward(rows, w, rstd)
        ctx.conf = (offset, round_first, x.shape)
        out: torch.Tensor = y.view(x.shape)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, w, rstd = ctx.saved_tensors
        offset, round_first, shape = ctx.conf
        g = dy.reshape(rows.shape).contiguous()
        dx = dw = None
        n: torch.Tensor | None = None  # the fp32 normalised rows, built once for dx and dw
        if ctx.needs_input_grad[0]:
            if _native_ok(rows, w, g):
                dx = torch.ops.kt_kernel.rms_norm_backward(g, rows, w, rstd, offset, round_first)
            else:
                dn = _dn(g, w, offset, round_first)
                n = rows.float() * rstd[:, None]
                dot = (dn * n).mean(-1, keepdim=True)
                dx = (rstd[:, None] * (dn - n * dot)).to(rows.dtype)
            dx = dx.view(shape)
        if ctx.needs_input_grad[1] and w is not None:
            if n is None:
                n = rows.float() * rstd[:, None]
            if round_first:
                n = n.to(rows.dtype).float()
            dw = (g.float() * n).sum(0).to(w.dtype)
        return dx, dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    round_first: bool = True,
) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., H]`` over its last dimension; differentiable in x and weight.

    Raises:
        KernelDTypeError: ``x`` is not bf16/fp32.
        KernelInputError: ``weight`` is not ``[H]`` in ``x``'s dtype, or ``offset`` is given
            with ``round_first``.
    """
    _check(x, weight, round_first, offset)
    # torch: Function.apply is unannotated
    y: torch.Tensor = _RmsNorm.apply(x, weight, float(eps), float(offset), round_first)  # type: ignore[no-untyped-call]
    return y


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    round_first: bool = True,
) -> torch.Tensor:
    """float64 oracle of :func:`rms_norm` with no intermediate rounding (differentiable)."""
    x64 = x.double()
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return n
    return n * (weight.double() + (0.0 if round_first else offset))
