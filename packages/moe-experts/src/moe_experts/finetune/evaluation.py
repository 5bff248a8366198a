"""Batches as the loop sees them, the token-summed loss, and the evaluation pass."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["IGNORE_INDEX", "Batch", "count_targets", "evaluate", "take_rows", "token_loss_sum"]

IGNORE_INDEX = -100

# A batch is either packed rows ``[B, T + 1]`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``)
# or a mapping with ``input_ids [B, T]``, ``labels [B, T]`` (already shifted: ``labels[b, t]``
# is the token position t must predict, IGNORE_INDEX where no loss is taken) and optionally
# ``attention_mask [B, T]``.
Batch = torch.Tensor | Mapping[str, torch.Tensor]


def take_rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of a batch (a rank's slice or one micro-batch)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    return {k: v[start:stop] for k, v in batch.items()}


def _split(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch[:, :-1], batch[:, 1:], None
    return batch["input_ids"], batch["labels"], batch.get("attention_mask")


def count_targets(batch: Batch) -> int:
    """How many target tokens carry loss in ``batch``."""
    return int((_split(batch)[1] != IGNORE_INDEX).sum())


def token_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed cross-entropy over the batch's target tokens (a 0-d float32 tensor).

    Summing, and dividing once by the step's token count, makes accumulation and sharding
    across ranks give the same loss and gradients as one big batch.
    """
    inputs, labels, mask = _split(batch)
    kwargs: dict[str, Any] = {"input_ids": inputs}
    if mask is not None:
        kwargs["attention_mask"] = mask
    logits = model(**kwargs).logits
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch]) -> float:
    """Mean loss per target token over every evaluation batch (all ranks run all of them).

    Every rank evaluates the whole (small) evaluation set, so FSDP's collectives line up
    without splitting it and every rank gets the same number.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    try:
        for batch in batches:
            total += token_loss_sum(model, batch).double()
            count += count_targets(batch)
    finally:
        model.train(was_training)
    return float(total / count) if count else math.nan
