"""The evaluation pass over a held-out set (the loss itself is ``loss.token_loss_sum``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_experts.finetune.data import Batch
from moe_experts.finetune.loss import token_loss_sum

__all__ = ["evaluate", "token_loss_sum"]


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], loss: str = "chunked") -> float:
    """Mean loss per target token over every evaluation batch (all ranks run all of them).

    Every rank evaluates the whole (small) evaluation set, so FSDP's collectives line up
    without splitting it and every rank gets the same number.

    Args:
        model: the causal LM.
        batches: the evaluation set, in micro-batch sized chunks.
        loss: ``"chunked"`` or ``"full"`` (see :func:`moe_experts.finetune.loss.token_loss_sum`).

    Returns:
        The mean loss, or NaN when the set has no target token.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    try:
        for batch in batches:
            total += token_loss_sum(model, batch, loss).double().cpu()
            count += batch.num_targets
    finally:
        model.train(was_training)
    return float(total / count) if count else math.nan
