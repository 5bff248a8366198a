"""The token-summed loss of a batch, and the evaluation pass over a held-out set."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_experts.finetune.data import IGNORE_INDEX, Batch

__all__ = ["evaluate", "token_loss_sum"]


def token_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed cross-entropy over the batch's target tokens (a 0-d float32 tensor).

    Summing, and dividing once by the step's target count, makes accumulation and sharding
    across ranks give the same loss and gradients as one big batch.
    """
    logits = model(**batch.model_inputs()).logits
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
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
            count += batch.num_targets
    finally:
        model.train(was_training)
    return float(total / count) if count else math.nan
