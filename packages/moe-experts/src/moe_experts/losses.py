"""Cross-entropy over the LM head that never materialises the full ``[T, V]`` logits.

``transformers`` computes ``logits = lm_head(hidden)`` for every position, upcasts them to fp32
and runs ``cross_entropy``: at T=2048 and V=32000 that is a 256 MB fp32 tensor, a bf16 copy,
a log-softmax of the same size and its gradient. :func:`chunked_lm_cross_entropy` takes the
bf16 hidden states and the head weight instead, and per chunk of rows computes the bf16
logits, their fp32 log-sum-exp, the loss and at once the gradient of the hidden states (the
softmax minus the one-hot target, times the weight). Only ``[chunk, V]`` is ever alive and
the head runs the same two matmuls per row as the plain path; backward only scales the saved
gradient by the incoming one. The per-row elementwise work (log-sum-exp, label logit,
softmax - onehot) is one fused pass of :func:`kt_kernel.logit_rows` over each chunk's logits,
which reads each row once and writes its gradient once.

The loss equals ``cross_entropy(lm_head(hidden).float(), labels)`` up to fp32 rounding; the
gradients are those of that expression to the rounding of the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from kt_kernel import LOGIT_ROWS_DTYPES, LogitRows, logit_rows

__all__ = [
    "DEFAULT_CHUNK",
    "IGNORE_INDEX",
    "ChunkedLossError",
    "chunked_lm_cross_entropy",
    "chunked_token_logprobs",
]

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
DEFAULT_CHUNK = 1024  # rows per chunk: 1024 x 32000 fp32 is 128 MB, small next to the model
# chunked_token_logprobs scores every row; its labels are checked to be ids, so never this.
_NO_IGNORE = -1


class ChunkedLossError(ValueError):
    """Bad arguments to :func:`chunked_lm_cross_entropy` (shape, dtype or chunk size)."""


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    ignore_index: int | None = None,
) -> None:
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
    vocab = weight.shape[0]
    bad = (labels < 0) | (labels >= vocab)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ChunkedLossError(
            f"labels{list(at)} = {int(labels[at])} is not a token id of the {vocab}-row head"
            + ("" if ignore_index is None else f" nor ignore_index ({ignore_index})")
        )


class _Rows:
    """``kt_kernel.logit_rows`` over a loop of chunks, writing every gradient into one buffer.

    A fresh ``[chunk, V]`` tensor per chunk costs page faults and the kernel's zeroing each
    time, about as long as the fused op itself; each gradient is consumed before the next chunk.
    """

    def __init__(self, ignore_index: int, grad: bool) -> None:
        self.ignore_index, self.grad = ignore_index, grad
        self.buf: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> LogitRows:
        # The head matmul's output dtype is the one lm_head(h) has; fp16/fp64 go through fp32,
        # where the torch chain computed them too.
        if logits.dtype not in LOGIT_ROWS_DTYPES:
            logits = logits.float()
        out = None
        if self.grad and self.buf is not None and self.buf.dtype == logits.dtype:
            out = self.buf[: logits.shape[0]]
        rows = logit_rows(
            logits, labels.long(), ignore_index=self.ignore_index, want_grad=self.grad, out=out
        )
        if self.buf is None or (rows.grad is not None and len(rows.grad) > len(self.buf)):
            self.buf = rows.grad
        return rows


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
        per_chunk = _Rows(ignore_index, grad_h is not None or grad_w is not None)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            y = labels[start : start + chunk]
            # h @ W.T rounds as lm_head(h) does; d(lse - target)/d logits = softmax - onehot,
            # zero on ignored rows
            rows = per_chunk(h @ weight.t(), y)
            total += torch.where(y != ignore_index, rows.lse - rows.target, 0.0).sum()
            if rows.grad is None:
                continue
            g = rows.grad.to(hidden.dtype)
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
    _check(hidden, weight, labels, chunk_size, ignore_index)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1)
    if num_targets is None:
        num_targets = int((flat_y != ignore_index).sum())
    # torch: Function.apply is unannotated
    total: torch.Tensor = _ChunkedCE.apply(flat_h, weight, flat_y, chunk_size, ignore_index)  # type: ignore[no-untyped-call]
    return total / max(num_targets, 1)


class _ChunkedLogProbs(torch.autograd.Function):
    """Per-row ``log softmax(h @ W.T)[label]``; d/dh kept from forward, d/dW recomputed."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        need_h = ctx.needs_input_grad[0]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        # -d logp / d h for each row (the gradient at an upstream weight of -1), [N, H]: the
        # fused op gives softmax - onehot = -d logp / d logits, and backward folds the sign
        # into its scale rather than negating a [chunk, V] tensor.
        grad_h = torch.empty_like(hidden) if need_h else None
        per_chunk = _Rows(_NO_IGNORE, grad_h is not None)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            y = labels[start : start + chunk]
            rows = per_chunk(h @ weight.t(), y)
            out[start : start + chunk] = rows.target - rows.lse
            if grad_h is not None and rows.grad is not None:
                torch.matmul(rows.grad.to(hidden.dtype), weight, out=grad_h[start : start + chunk])
        ctx.save_for_backward(hidden, weight, labels, *(() if grad_h is None else (grad_h,)))
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, *kept = ctx.saved_tensors
        neg = -grad_out  # kept holds -d logp / d h; negating [N] is exact
        gh = kept[0] * neg.to(hidden.dtype)[:, None] if kept else None
        gw = None
        if ctx.needs_input_grad[1]:  # a trained head (LoRA on lm_head): one more pass
            gw32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            per_chunk = _Rows(_NO_IGNORE, True)
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start : start + ctx.chunk]
                y = labels[start : start + ctx.chunk]
                # fp32 logits give an fp32 softmax - onehot, as precise as the torch chain was;
                # the row scale goes on the small [chunk, H] side of the product.
                rows = per_chunk((h @ weight.t()).float(), y)
                assert rows.grad is not None
                hs = h.float() * neg[start : start + ctx.chunk, None].float()
                gw32.addmm_(rows.grad.t(), hs)
            gw = gw32.to(weight.dtype)
        return gh, gw, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Log-probability of each row's label under ``hidden @ weight.T``, never the full logits.

    The per-token form of :func:`chunked_lm_cross_entropy` for losses that weigh tokens
    differently (DPO sums them per sequence): the gradient of the hidden states is computed
    during the forward, a chunk of rows at a time, and scaled by each row's incoming
    gradient in backward; a trained head weight gets its gradient from a second pass.

    Args:
        hidden: ``[N, H]`` final hidden states of the scored positions only.
        weight: ``[V, H]`` LM-head weight.
        labels: ``[N]`` int64 token ids (every row is scored; select the rows beforehand).
        chunk_size: rows per chunk; peak extra memory is about ``chunk_size * V * 4`` bytes.

    Returns:
        ``[N]`` fp32 log-probabilities, equal to
        ``log_softmax(lm_head(hidden).float())[label]`` up to fp32 rounding.

    Raises:
        ChunkedLossError: shapes that do not fit, non-integer labels or a bad chunk size.
    """
    _check(hidden, weight, labels, chunk_size)
    if hidden.dim() != 2:
        raise ChunkedLossError(f"hidden must be [N, H] rows, got {tuple(hidden.shape)}")
    out: torch.Tensor = _ChunkedLogProbs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, labels, chunk_size
    )
    return out
