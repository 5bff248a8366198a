"""``logit_rows``: per-row log-sum-exp, label logit and cross-entropy gradient of LM-head logits.

The elementwise half of a chunked LM-head loss. Given a chunk of logits ``[n, V]`` and its
labels, the native op (``torch.ops.kt_kernel.logit_rows``, ``csrc/logit_rows.cpp``) reads each
row once from memory and writes its gradient ``softmax - onehot`` once, where the equivalent
torch chain (fp32 copy, ``logsumexp``, ``sub_``, ``exp_``, ``scatter_add_``, cast back) streams
an fp32 ``[n, V]`` tensor through memory about six times. Without the extension, or for tensors
it does not take (not on the CPU, not contiguous), the same contract runs in PyTorch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kt_kernel._native import native_module
from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = ["LOGIT_ROWS_DTYPES", "LogitRows", "logit_rows"]

LOGIT_ROWS_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)


class LogitRows(NamedTuple):
    """What :func:`logit_rows` returns for ``n`` rows of ``V`` logits."""

    lse: torch.Tensor
    """``[n]`` fp32 log-sum-exp of each row."""
    target: torch.Tensor
    """``[n]`` fp32 logit at each row's label; 0 where the label is ``ignore_index``."""
    grad: torch.Tensor | None
    """``[n, V]`` ``softmax - onehot(label)`` in the logits' dtype (zero rows where ignored);
    ``None`` unless asked for."""


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dtype not in LOGIT_ROWS_DTYPES:
        raise KernelDTypeError(
            f"logit_rows: logits is {logits.dtype}; expected bfloat16 or float32"
        )
    if labels.dtype != torch.int64:
        raise KernelDTypeError(f"logit_rows: labels is {labels.dtype}; expected int64 token ids")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise KernelInputError(
            f"logit_rows: logits must be [n, V] with V >= 1, got {tuple(logits.shape)}"
        )
    if labels.shape != logits.shape[:1]:
        raise KernelInputError(
            f"logit_rows: labels must be [n] = [{logits.shape[0]}], got {list(labels.shape)}"
        )


def _check_range(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> None:
    vocab = logits.shape[1]
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise KernelInputError(
            f"logit_rows: labels[{row}] = {int(labels[row])} is outside [0, {vocab}) and is not "
            f"ignore_index ({ignore_index})"
        )


def _check_out(logits: torch.Tensor, out: torch.Tensor) -> None:
    if out.dtype != logits.dtype or out.shape != logits.shape or not out.is_contiguous():
        raise KernelInputError(
            f"logit_rows: out must be a contiguous {logits.dtype} tensor of "
            f"{list(logits.shape)}, got {out.dtype} {list(out.shape)}"
            + ("" if out.is_contiguous() else " (not contiguous)")
        )


def _logit_rows_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    want_grad: bool,
    out: torch.Tensor | None,
) -> LogitRows:
    # A copy even for fp32 input: the gradient is built in place.
    x = logits.to(torch.float32, copy=want_grad)
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    target = torch.where(valid, x.gather(1, safe[:, None]).squeeze(1), 0.0)
    if not want_grad:
        return LogitRows(lse, target, None)
    g = x.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, safe[:, None], torch.full_like(lse, -1.0)[:, None])
    g.mul_(valid[:, None])
    return LogitRows(lse, target, g.to(logits.dtype) if out is None else out.copy_(g))


def logit_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    want_grad: bool = True,
    out: torch.Tensor | None = None,
) -> LogitRows:
    """Per row of ``logits`` [n, V]: fp32 log-sum-exp, logit at ``labels`` [n], softmax - onehot.

    ``out`` (contiguous, the shape and dtype of ``logits``) receives the gradient instead of a
    new tensor: a loop over chunks reuses one buffer rather than paying for fresh pages.

    Raises:
        KernelDTypeError: ``logits`` is not bf16/fp32 or ``labels`` is not int64.
        KernelInputError: shapes that do not fit, or a label outside ``[0, V)`` that is not
            ``ignore_index`` (the message names the row).
    """
    _check(logits, labels)
    if out is not None and want_grad:
        _check_out(logits, out)
    else:
        out = None
    if (
        native_module() is not None
        and logits.device.type == "cpu"
        and labels.device.type == "cpu"
        and logits.is_contiguous()
        and (out is None or out.device.type == "cpu")
    ):
        try:
            lse, target, grad = torch.ops.kt_kernel.logit_rows(
                logits, labels, ignore_index, want_grad, out
            )
        except ValueError as exc:  # the op's own TORCH_CHECK_VALUE, e.g. a label out of range
            raise KernelInputError(str(exc).splitlines()[0]) from exc
        return LogitRows(lse, target, grad)
    _check_range(logits, labels, ignore_index)
    return _logit_rows_torch(logits, labels, ignore_index, want_grad, out)
