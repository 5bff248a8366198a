"""The evaluation pass over a held-out set, with the run's objective (``finetune.objective``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from moe_experts.finetune.loss import token_loss_sum
from moe_experts.finetune.objective import Objective, TokenObjective, add_totals

__all__ = ["evaluate", "token_loss_sum"]


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Sequence[Any], objective: Objective | str = "chunked"
) -> tuple[float, dict[str, float]]:
    """Mean loss (and metrics) over every evaluation batch (all ranks run all of them).

    Every rank evaluates the whole (small) evaluation set, so FSDP's collectives line up
    without splitting it and every rank gets the same numbers.

    Args:
        model: the causal LM.
        batches: the evaluation set, in micro-batch sized chunks.
        objective: the run's :class:`~moe_experts.finetune.objective.Objective`, or for
            token data ``"chunked"``/``"full"`` (see ``finetune.loss.token_loss_sum``).

    Returns:
        ``(loss, metrics)``: the mean over the whole set (NaN when it has nothing to score)
        and the objective's metrics (TRL's ``rewards/chosen`` ... for preference methods).
    """
    run: Objective = TokenObjective(objective) if isinstance(objective, str) else objective
    totals: dict[str, float] = {}
    for batch in batches:
        totals = add_totals(totals, run.totals(batch))
    if not batches or not any(totals.values()):
        return math.nan, {}
    was_training = model.training
    model.eval()
    loss = torch.zeros((), dtype=torch.float64)
    metrics: dict[str, torch.Tensor] = {}
    try:
        for batch in batches:
            parts = run.loss(model, batch, totals)
            loss += parts.loss.detach().double().cpu()
            for key, value in parts.metrics.items():
                metrics[key] = (
                    metrics.get(key, torch.zeros((), dtype=torch.float64))
                    + value.detach().double().cpu()
                )
    finally:
        model.train(was_training)
    return float(loss), {k: float(v) for k, v in metrics.items()}
