"""Cross-entropy over the LM head that never materialises the full ``[T, V]`` logits.

``transformers`` computes ``logits = lm_head(hidden)`` for every position, upcasts them to fp32
and runs ``cross_entropy``: at T=2048 and V=32000 that is a 256 MB fp32 tensor, a bf16 copy,
a log-softmax of the same size and its gradient. :func:`chunked_lm_cross_entropy` takes the
bf16 hidden states and the head weight instead, and per chunk of rows computes the bf16
logits, their fp32 log-sum-exp, the loss and at once the gradient of the hidden states (the
softmax minus the one-hot target, times the weight). Only ``[chunk, V]`` is ever alive and
the head runs the same two matmuls per row as the plain path; backward only scales the saved
gradient by the incoming one.

The loss equals ``cross_entropy(lm_head(hidden).float(), labels)`` up to fp32 rounding; the
gradients are those of that expression to the rounding of the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEFAULT_CHUNK", "IGNORE_INDEX", "ChunkedLossError", "chunked_lm_cross_entropy"]

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
DEFAULT_CHUNK = 1024  # rows per chunk: 1024 x 32000 fp32 is 128 MB, small next to the model


class ChunkedLossError(ValueError):
    """Bad arguments to :func:`chunked_lm_cross_entropy` (shape, dtype or chunk size)."""


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> None:
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ChunkedLossError(
            f"hidden's last dim {tuple(hidden.shape)} must equal weight's [V, H] "
            f"{tuple(weight.shape)}"
            "; pass the lm_head weight, not its transpose"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ChunkedLossError(
            f"labels {tuple(labels.shape)} must match hidden's leading dims "
            f"{tuple(hidden.shape[:-1])}; shift labels and hidden the same way"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ChunkedLossError(f"labels must be int64 token ids, got {labels.dtype}")
    if chunk < 1:
        raise ChunkedLossError(f"chunk_size must be a positive number of rows, got {chunk}")


class _ChunkedCE(torch.autograd.Function):
    """Summed cross-entropy whose hidden/weight gradients are computed during forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        ignore_index: int,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            y = labels[start : start + chunk]
            logits = (h @ weight.t()).float()  # same rounding as lm_head(h).float()
            lse = torch.logsumexp(logits, dim=-1)
            valid = y != ignore_index
            safe = torch.where(valid, y, 0).long()
            target = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - target, 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            # d(lse - target)/d logits = softmax - onehot, zero on ignored rows
            logits.sub_(lse[:, None]).exp_()
            logits.scatter_add_(1, safe[:, None], torch.full_like(lse, -1.0)[:, None])
            logits.mul_(valid[:, None])
            g = logits.to(hidden.dtype)
            if grad_h is not None:
                torch.matmul(g, weight, out=grad_h[start : start + chunk])
            if grad_w is not None:
                grad_w.addmm_(g.t().float(), h.float())
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        gh = saved.pop(0) * grad_out if ctx.has[0] else None
        gw = (saved.pop(0) * grad_out).to(ctx.weight_dtype) if ctx.has[1] else None
        return gh, gw, None, None, None


def chunked_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_targets: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight.T`` without the full logits.

    Args:
        hidden: ``[..., H]`` final hidden states (after the last norm), any float dtype; bf16
            stays bf16 through the head matmuls.
        weight: ``[V, H]`` LM-head weight (``model.lm_head.weight``); tied or frozen is fine.
        labels: ``[...]`` target ids already aligned with ``hidden`` (label ``t`` is the
            token after position ``t``); ``ignore_index`` marks positions without a target.
        num_targets: divisor of the summed loss; default the number of targets in ``labels``
            (data-parallel ranks pass ``global targets / world size``).
        chunk_size: rows per chunk; peak extra memory is about ``chunk_size * V * 6`` bytes.
        ignore_index: label value that contributes no loss and no gradient.

    Returns:
        A scalar fp32 tensor: summed loss over targets divided by ``num_targets`` (0, still
        with a graph, when there is no target).

    Raises:
        ChunkedLossError: shapes that do not fit, non-integer labels or a bad chunk size.
    """
    _check(hidden, weight, labels, chunk_size)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1)
    if num_targets is None:
        num_targets = int((flat_y != ignore_index).sum())
    total = _ChunkedCE.apply(flat_h, weight, flat_y, chunk_size, ignore_index)
    return total / max(num_targets, 1)
