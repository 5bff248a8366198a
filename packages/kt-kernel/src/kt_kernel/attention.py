"""Causal self-attention with grouped KV heads: the native flash-style op and its reference.

Tensors only: ``q [B, Hq, T, D]`` and ``k, v [B, Hkv, T, D]`` (``Hq`` a multiple of ``Hkv``),
every query ``t`` attending to keys ``0..t``. The native op (``torch.ops.kt_kernel.
attention_forward`` / ``attention_backward``) keeps the per-row log-sum-exp and recomputes the
probabilities in backward; :func:`causal_attention_reference` is plain PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, cast

import torch

from kt_kernel._native import native_module
from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = ["AttentionBackend", "causal_attention", "causal_attention_reference"]

AttentionBackend = Literal["auto", "native", "reference"]
_DTYPES = (torch.float32, torch.bfloat16)


def _validate(q: object, k: object, v: object, scale: object, backend: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise KernelInputError(
                f"{name} must be 4-D [batch, heads, tokens, head_dim], got shape {list(t.shape)}"
            )
    q, k, v = cast(torch.Tensor, q), cast(torch.Tensor, k), cast(torch.Tensor, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise KernelDTypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
        if t.dtype != q.dtype:
            raise KernelDTypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; cast it")
        if t.device != q.device:
            raise KernelDTypeError(f"{name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise KernelInputError(
            f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}"
        )
    if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise KernelInputError(
            f"k [B, Hkv, T, D] must match q [B, Hq, T, D] in B, T and D, got q "
            f"{list(q.shape)} and k {list(k.shape)}"
        )
    if k.shape[1] < 1 or q.shape[1] % k.shape[1] != 0:
        raise KernelInputError(f"q's heads ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise KernelInputError(f"scale must be a finite float or None, got {scale!r}")
    if backend not in ("auto", "native", "reference"):
        raise KernelInputError(f"backend must be 'auto', 'native' or 'reference', got {backend!r}")


class _NativeCausalAttention(torch.autograd.Function):
    """The native forward (output + log-sum-exp) and the recomputing native backward."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        out: torch.Tensor
        out, lse = torch.ops.kt_kernel.attention_forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.kt_kernel.attention_backward(grad_out, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None


# torch's Function.apply is unannotated (returns Any); this is its typed view for our Function.
_native_causal_attention: Callable[..., torch.Tensor] = _NativeCausalAttention.apply


def causal_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal GQA attention in plain PyTorch (torch's SDPA), differentiable by autograd.

    Args:
        q: ``[B, Hq, T, D]`` queries.
        k: ``[B, Hkv, T, D]`` keys; ``Hq`` is a multiple of ``Hkv``.
        v: ``[B, Hkv, T, D]`` values.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.

    Returns:
        ``[B, Hq, T, D]`` outputs in ``q``'s dtype.
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    *,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Causal self-attention with grouped KV heads, forward and backward.

    The native op stacks the query heads that share a KV head into one block, runs its GEMMs
    on AVX512_BF16 where the CPU has it (fp32 accumulation, fp32 softmax) and recomputes the
    probabilities in backward from the saved log-sum-exp. Inputs may be strided views (the
    last dimension contiguous avoids a copy); the output is contiguous.

    Args:
        q: ``[B, Hq, T, D]`` queries, float32 or bfloat16.
        k: ``[B, Hkv, T, D]`` keys; ``Hq`` is a multiple of ``Hkv``; same dtype and device.
        v: ``[B, Hkv, T, D]`` values.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        backend: ``"auto"`` (native when the extension is loaded and the tensors are on the
            CPU, else reference), ``"native"`` or ``"reference"``.

    Returns:
        ``[B, Hq, T, D]`` attention outputs, differentiable in ``q``, ``k`` and ``v``.

    Raises:
        KernelInputError: a shape, the scale or the backend is wrong (the message names it).
        KernelDTypeError: a dtype or device is wrong, or ``backend="native"`` cannot run.
    """
    _validate(q, k, v, scale, backend)
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    native_ok = native_module() is not None and q.device.type == "cpu"
    if backend == "native" and not native_ok:
        raise KernelDTypeError(
            "backend='native' needs the compiled extension and CPU tensors; use backend='auto'"
        )
    if backend == "reference" or not native_ok:
        return causal_attention_reference(q, k, v, s)
    return _native_causal_attention(q, k, v, s)
