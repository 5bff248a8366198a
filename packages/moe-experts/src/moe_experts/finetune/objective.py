"""What a training step minimises: one :class:`Objective` per ``--method``.

The loop splits a step's global batch into micro-batches and ranks; an objective turns one
such part into its *contribution* to the step's loss, already divided by the normalisers of
the whole batch (:meth:`Objective.totals`), so that summing the contributions over
micro-batches and ranks gives the same loss and gradients whatever the accumulation and the
number of ranks. Metrics (TRL's ``rewards/chosen`` ...) are contributions in the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from moe_experts.finetune.data import Batch
from moe_experts.finetune.loss import token_loss_sum

__all__ = ["LossParts", "Objective", "TokenObjective", "add_totals"]


@dataclass
class LossParts:
    """A part's contribution: ``loss`` (differentiable, 0-d fp32) and detached ``metrics``."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """A training objective over batches of one kind (token rows, preference pairs)."""

    @property
    def method(self) -> str:
        """The ``--method`` it implements (``sft``, ``dpo``, ``orpo``)."""
        ...

    def totals(self, batch: Any) -> dict[str, float]:
        """The normalisers of a whole batch (additive over its parts), e.g. target tokens."""
        ...

    def loss(self, model: nn.Module, part: Any, totals: Mapping[str, float]) -> LossParts:
        """``part``'s contribution to the mean loss of the batch whose ``totals`` are given."""
        ...


def add_totals(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """The totals of two disjoint batches together (evaluation sums its chunks)."""
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}


@dataclass(frozen=True)
class TokenObjective:
    """``--method sft``: cross-entropy summed over target tokens, over the step's target count."""

    loss_mode: str = "chunked"  # "chunked" or "full", see finetune.loss.token_loss_sum
    method: str = "sft"

    def totals(self, batch: Batch) -> dict[str, float]:
        """``{"targets": tokens that carry loss}``."""
        return {"targets": float(batch.num_targets)}

    def loss(self, model: nn.Module, part: Batch, totals: Mapping[str, float]) -> LossParts:
        """Summed token loss of ``part`` divided by the whole batch's target tokens."""
        return LossParts(token_loss_sum(model, part, self.loss_mode) / max(totals["targets"], 1))
