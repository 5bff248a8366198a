"""DPO and ORPO objectives, with the adapter-free model as DPO's reference (TRL's formulas).

DPO (``--method dpo``) compares the policy's summed response log-probabilities with the
reference model's, where the reference is the same model under
:func:`moe_experts.adapters_disabled` (the frozen base: no second copy of the experts). With
``--precompute-reference`` the reference values are computed once before training
(:mod:`moe_experts.finetune.reference_store`). Losses, per pair, with
``Δ = (π_c - ref_c) - (π_r - ref_r)``:

- ``sigmoid``: ``-(1 - ε) log σ(βΔ) - ε log σ(-βΔ)`` (``ε`` = ``--label-smoothing``, the
  conservative DPO of Mitchell 2023; ``ε = 0`` is TRL's ``sigmoid``);
- ``ipo``: ``(Δ_c/n_c - Δ_r/n_r - 1/(2β))²`` with each side's log-ratio averaged over its
  response tokens, as TRL's ``ipo``.

ORPO (``--method orpo``, no reference) is TRL's ``ORPOTrainer``: the NLL of the chosen
sequence (prompt and response, per token) minus ``λ log σ(log-odds)`` of the two sides'
per-token average response log-probabilities.

Every number is a sum over the part's pairs (tokens for ORPO's NLL) divided by the whole
step's count, so accumulation and ranks do not change the result; metrics carry TRL's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_experts.finetune.data import IGNORE_INDEX
from moe_experts.finetune.loss import final_hidden, full_logits_reason, on_model_device
from moe_experts.finetune.objective import LossParts
from moe_experts.finetune.preference_data import PackedPairs, PairBatch

__all__ = [
    "DPO_LOSSES",
    "METRICS",
    "DPOObjective",
    "ORPOObjective",
    "reference_logps",
    "sequence_logps",
]

DPO_LOSSES = ("sigmoid", "ipo")
# TRL's metric names, logged per step and (prefixed eval_) per evaluation.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def _scored_logps(
    model: nn.Module, packed: PackedPairs, mode: str, *, response_only: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p [N], sequence [N], is_response [N])`` over the scored label positions."""
    batch = on_model_device(model, packed.batch)
    mask = packed.response if response_only else packed.batch.labels != IGNORE_INDEX
    # Scored on the model's device (a GPU for --device cuda); the sums are taken on the host.
    mask = mask.to(batch.labels.device)
    labels = batch.labels[mask]
    if mode == "chunked" and full_logits_reason(model) is None:
        from moe_experts.losses import chunked_token_logprobs

        hidden, weight = final_hidden(model, batch)
        logps = chunked_token_logprobs(hidden[mask], weight, labels)
    else:
        logits = model(**batch.model_inputs(model)).logits
        logps = logits[mask].float().log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    host = packed.segments.device
    mask = mask.to(host)
    return logps.to(host), packed.segments[mask], packed.response[mask]


def sequence_logps(model: nn.Module, packed: PackedPairs, mode: str = "chunked") -> torch.Tensor:
    """Summed response log-probabilities of the ``2P`` sequences (chosen first), ``[2P]`` fp32.

    Args:
        model: the causal LM (adapters on or off).
        packed: a micro-batch's packed pairs.
        mode: ``"chunked"`` (the head in chunks, never the full logits, where the model
            allows it) or ``"full"``.
    """
    logps, seg, _ = _scored_logps(model, packed, mode, response_only=True)
    return logps.new_zeros(2 * packed.num_pairs).index_add(0, seg, logps)


def _reference(model: nn.Module, part: PairBatch, packed: PackedPairs, mode: str) -> torch.Tensor:
    if part.reference is not None:
        return torch.cat([part.reference[:, 0], part.reference[:, 1]]).float()
    import moe_experts

    with torch.no_grad(), moe_experts.adapters_disabled(model):
        return sequence_logps(model, packed, mode)


def _pair_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    n: float,
) -> dict[str, torch.Tensor]:
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    values = (c, r, c - r, (c > r).float(), chosen_logps.detach(), rejected_logps.detach())
    return {k: v.double().sum() / n for k, v in zip(METRICS, values, strict=True)}


@dataclass(frozen=True)
class DPOObjective:
    """``--method dpo``: the sigmoid (optionally label-smoothed) or IPO loss of TRL."""

    beta: float = 0.1
    loss_type: str = "sigmoid"  # a name in DPO_LOSSES
    label_smoothing: float = 0.0
    loss_mode: str = "chunked"
    method: str = "dpo"

    def __post_init__(self) -> None:
        """Refuse an unknown loss (the CLI checks its choices first)."""
        if self.loss_type not in DPO_LOSSES:
            raise ValueError(f"dpo loss {self.loss_type!r}: expected one of {DPO_LOSSES}")

    def totals(self, batch: PairBatch) -> dict[str, float]:
        """``{"pairs": P}``: the loss is a mean over pairs."""
        return {"pairs": float(batch.num_targets)}

    def loss(self, model: nn.Module, part: PairBatch, totals: Mapping[str, float]) -> LossParts:
        """``part``'s share of the mean DPO loss and of TRL's reward metrics."""
        packed = part.packed()
        ref = _reference(model, part, packed, self.loss_mode)  # first: no graph is kept
        policy = sequence_logps(model, packed, self.loss_mode)
        chosen, rejected = policy.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if self.loss_type == "ipo":
            lengths = packed.response_lengths.clamp(min=1.0)
            n_chosen, n_rejected = lengths.chunk(2)
            delta = chosen_ratio / n_chosen - rejected_ratio / n_rejected
            per_pair = (delta - 1 / (2 * self.beta)) ** 2
        else:
            z = self.beta * (chosen_ratio - rejected_ratio)
            eps = self.label_smoothing
            per_pair = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        n = max(totals["pairs"], 1.0)
        metrics = _pair_metrics(
            self.beta * chosen_ratio, self.beta * rejected_ratio, chosen, rejected, n
        )
        return LossParts(per_pair.sum() / n, metrics)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, branching at ``-ln 2`` against cancellation."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


@dataclass(frozen=True)
class ORPOObjective:
    """``--method orpo``: chosen NLL minus ``λ log σ(log-odds)``, as TRL's ``ORPOTrainer``."""

    lam: float = 0.1  # --orpo-lambda; TRL's ORPOConfig.beta
    loss_mode: str = "chunked"
    method: str = "orpo"

    def totals(self, batch: PairBatch) -> dict[str, float]:
        """Pairs (the odds-ratio term) and scored chosen tokens (the NLL term)."""
        return {"pairs": float(batch.num_targets), "chosen_tokens": float(batch.chosen_tokens)}

    def loss(self, model: nn.Module, part: PairBatch, totals: Mapping[str, float]) -> LossParts:
        """``part``'s share of the ORPO loss and of TRL's ORPO metrics."""
        packed = part.packed()
        logps, seg, response = _scored_logps(model, packed, self.loss_mode, response_only=False)
        p = packed.num_pairs
        sums = logps.new_zeros(2 * p).index_add(0, seg[response], logps[response])
        avg = sums / packed.response_lengths.clamp(min=1.0)
        chosen, rejected = avg.chunk(2)
        nll = -logps[seg < p].sum()
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        n = max(totals["pairs"], 1.0)
        tokens = max(totals["chosen_tokens"], 1.0)
        loss = nll / tokens - self.lam * ratio.sum() / n
        metrics = _pair_metrics(self.lam * chosen, self.lam * rejected, chosen, rejected, n)
        metrics["nll_loss"] = nll.detach().double() / tokens
        metrics["log_odds_ratio"] = ratio.detach().double().sum() / n
        metrics["log_odds_chosen"] = log_odds.detach().double().sum() / n
        return LossParts(loss, metrics)


@torch.no_grad()
def reference_logps(
    model: nn.Module,
    chunks: list[PairBatch],
    total: int,
    *,
    mode: str = "chunked",
    rank: int = 0,
    world: int = 1,
) -> torch.Tensor:
    """Reference (adapter-free) log-probabilities of every pair, ``[total, 2]`` fp32.

    Under torchrun each rank computes every ``world``-th chunk and the results are summed
    across ranks; every rank runs the same number of forwards (a rank without a chunk of its
    own repeats one), so FSDP's collectives line up.

    Args:
        model: the adapted model (its adapters are switched off here).
        chunks: the pairs in chunks (each with its ``index`` into the ``total`` pairs).
        total: the number of pairs the chunks cover.
        mode: as in :func:`sequence_logps`.
        rank, world: this process's place in the process group.
    """
    import torch.distributed as dist

    import moe_experts

    out = torch.zeros(total, 2, dtype=torch.float32)
    # The model's mode is kept: the on-the-fly reference runs in training mode too.
    with moe_experts.adapters_disabled(model):
        rounds = -(-len(chunks) // world)
        for r in range(rounds):
            k = r * world + rank
            chunk = chunks[min(k, len(chunks) - 1)]
            values = sequence_logps(model, chunk.packed(), mode).float()
            if k < len(chunks):
                c, rj = values.chunk(2)
                out[list(chunk.index)] = torch.stack([c, rj], dim=1)
    if world > 1:
        dist.all_reduce(out)
    return out
