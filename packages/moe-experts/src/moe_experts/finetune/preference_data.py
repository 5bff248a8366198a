"""Preference pairs as tokens, batched by pair and packed per micro-batch (``--method dpo|orpo``).

A pair is tokenised the way TRL's ``DPOTrainer`` does it: conversational pairs through the
model's chat template (the prompt with the generation prompt, and prompt + each response in
full; the responses start where the three renderings stop agreeing), plain-text pairs with the
tokenizer's own special tokens and EOS appended to each response. Prompt + response is cut to a
row (``--seq-len`` + 1 tokens) at its end, as TRL's ``max_length`` with ``keep_start`` does.

An optimizer step takes ``--batch-size`` *pairs*; each micro-batch of each rank is a run of
whole pairs, so a pair's two sides always meet in the same forward. Its ``2P`` sequences
(chosen ``0..P-1``, rejected ``P..2P-1``, TRL's order) are packed into rows with
:func:`~moe_experts.finetune.packing.best_fit_decreasing`, ``position_ids`` restarting at 0
for each: the same :class:`~moe_experts.finetune.data.Batch` as supervised fine-tuning, whose
``model_inputs(model)`` keeps them apart the way the family's
:attr:`~moe_experts.MoEArchitecture.packing` says. ``one_per_row=True`` (a family that cannot
keep them apart, as for :meth:`~moe_experts.finetune.data.PackedBatches.from_examples`) gives
each sequence a row of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moe_experts.finetune.data import IGNORE_INDEX, MAX_REPORTED, Batch, DataError, epoch_order
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import PreferencePair, RecordError, Sample

__all__ = [
    "PackedPairs",
    "PairBatch",
    "PairExample",
    "PreferenceBatches",
    "check_preference_samples",
    "preference_demo_path",
    "tokenize_pairs",
]


@dataclass(frozen=True)
class PairExample:
    """One tokenised pair: shared prompt ids and each response's ids (responses get the loss)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    line: int = field(default=0, compare=False)


def preference_demo_path() -> Path:
    """The small preference file shipped inside the package (chat pairs, explicit prompt)."""
    from importlib import resources

    return Path(str(resources.files("moe_experts.finetune").joinpath("preference_demo.jsonl")))


def check_preference_samples(path: Path, samples: Sequence[Sample], method: str) -> None:
    """Refuse a file whose records do not fit ``--method``: pairs for dpo/orpo, none for sft.

    Raises:
        FinetuneError: naming the file, what it holds and the fix.
    """
    pairs = sum(s.pair is not None for s in samples)
    if method == "sft" and pairs:
        raise FinetuneError(
            f"{path}: holds preference pairs (chosen/rejected); train on them with "
            "--method dpo or --method orpo"
        )
    if method != "sft" and pairs < len(samples):
        raise FinetuneError(
            f"{path}: --method {method} needs preference records "
            '({"prompt", "chosen", "rejected"} or {"chosen": [...], "rejected": [...]}), '
            "but the file holds text or conversations; use --method sft for them"
        )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return [int(i) for i in ids]


def _chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]], *, generation: bool) -> list[int]:
    from moe_experts.finetune.chat import ChatTemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the tokenizer of the model ({type(tokenizer).__name__}) has no chat template, so "
            "conversational preference pairs cannot be rendered; use a model whose tokenizer "
            'has one, or write the pairs as strings ({"prompt": "...", "chosen": "...", ...})'
        )
    try:
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, add_generation_prompt=generation
        )
    except Exception as exc:  # jinja raises template-defined errors of many types
        raise RecordError("prompt", f"the model's chat template rejected it: {exc}") from exc
    return _ids(out)


def _pair_ids(tokenizer: Any, pair: PreferencePair) -> tuple[list[int], list[int], list[int]]:
    """``(prompt + chosen, prompt + rejected, prompt alone)`` token ids, as TRL renders them."""
    prompt, chosen, rejected = pair.prompt, pair.chosen, pair.rejected
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        eos = getattr(tokenizer, "eos_token", None) or ""
        sides = [r if r.endswith(eos) else r + eos for r in (chosen, rejected)]
        return (
            _ids(tokenizer(prompt + sides[0])),
            _ids(tokenizer(prompt + sides[1])),
            _ids(tokenizer(prompt)),
        )
    if isinstance(prompt, str) or isinstance(chosen, str) or isinstance(rejected, str):
        raise RecordError("chosen", "prompt, chosen and rejected must all be strings or lists")
    return (
        _chat_ids(tokenizer, [*prompt, *chosen], generation=False),
        _chat_ids(tokenizer, [*prompt, *rejected], generation=False),
        _chat_ids(tokenizer, prompt, generation=True),
    )


def tokenize_pairs(
    path: Path, samples: Sequence[Sample], tokenizer: Any, *, max_tokens: int
) -> tuple[list[PairExample], int]:
    """Tokenise preference samples read from ``path``; cut each sequence to ``max_tokens``.

    Returns:
        ``(pairs, cut)``: the tokenised pairs in file order, and how many had a response cut.

    Raises:
        DataError: one ``file:line:`` line per pair whose prompt leaves no room for a response,
            or whose response renders to no token.
        FinetuneError: the tokenizer has no chat template for conversational pairs.
    """
    pairs: list[PairExample] = []
    problems: list[str] = []
    cut = 0
    for sample in samples:
        if sample.pair is None:
            continue
        try:
            chosen, rejected, prompt = _pair_ids(tokenizer, sample.pair)
        except RecordError as exc:
            problems.append(f"{path}:{sample.line}: field {exc.field}: {exc.message}")
            continue
        # Where the renderings stop agreeing: a template may render the prompt alone (with
        # its generation header) unlike the same turns followed by a reply.
        n = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
        sides = {"chosen": chosen[n:], "rejected": rejected[n:]}
        empty = [side for side, ids in sides.items() if not ids]
        if empty:
            problems.append(
                f"{path}:{sample.line}: field {empty[0]}: renders to no token after the prompt"
            )
            continue
        if n >= max_tokens:
            problems.append(
                f"{path}:{sample.line}: field prompt: is {n} tokens, which leaves no room for a "
                f"response in a row of {max_tokens} tokens; raise --seq-len above {n}"
            )
            continue
        room = max_tokens - n
        cut += any(len(ids) > room for ids in sides.values())
        pairs.append(
            PairExample(
                tuple(prompt[:n]),
                tuple(sides["chosen"][:room]),
                tuple(sides["rejected"][:room]),
                sample.line,
            )
        )
    if problems:
        raise DataError(problems[:MAX_REPORTED], len(problems))
    return pairs, cut


@dataclass(frozen=True)
class PackedPairs:
    """The rows of one micro-batch's ``2P`` sequences, and where each scored token belongs.

    ``batch.labels`` carries the next token wherever it belongs to the same sequence (prompt
    included, for ORPO's NLL term); ``segments`` gives that label's sequence (chosen of pair
    ``i`` is ``i``, its rejected ``P + i``; -1 elsewhere) and ``response`` whether it is a
    response token (the DPO log-probability sums).
    """

    batch: Batch  # [R, L] input_ids, labels, position_ids
    segments: torch.Tensor  # [R, L] int64
    response: torch.Tensor  # [R, L] bool
    num_pairs: int

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[2P]`` float: response tokens per sequence (IPO's normaliser)."""
        seg = self.segments[self.response]
        return torch.zeros(2 * self.num_pairs).index_add_(0, seg, torch.ones(seg.shape))


def _pack_rows(
    sequences: list[tuple[list[int], int]], width: int, one_per_row: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Place ``(ids, prompt_len)`` sequences into rows: ``(rows of sequence indices, sizes)``."""
    from moe_experts.finetune.packing import best_fit_decreasing

    sizes = [len(ids) for ids, _ in sequences]
    if one_per_row:
        bins = [[i] for i in range(len(sequences))]
    else:
        bins = [sorted(b) for b in best_fit_decreasing(sizes, width)]
    return bins, [[sizes[i] for i in b] for b in bins]


@dataclass(frozen=True)
class PairBatch:
    """Whole preference pairs of one step, micro-batch or rank: what an objective consumes."""

    pairs: tuple[PairExample, ...]
    seq_len: int
    one_per_row: bool = False  # the family cannot keep sequences sharing a row apart
    # [P, 2] fp32 reference log-probabilities (chosen, rejected), when precomputed.
    reference: torch.Tensor | None = None
    index: tuple[int, ...] = ()  # each pair's position in its file's pair list

    def select(self, start: int, stop: int) -> PairBatch:
        """Pairs ``start:stop`` (a micro-batch, or one rank's share of it)."""
        ref = None if self.reference is None else self.reference[start:stop]
        return replace(
            self, pairs=self.pairs[start:stop], reference=ref, index=self.index[start:stop]
        )

    @property
    def num_targets(self) -> int:
        """The pairs: the unit the preference losses average over."""
        return len(self.pairs)

    @property
    def num_tokens(self) -> int:
        """Tokens of both sides of every pair (prompt twice)."""
        return sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in self.pairs)

    @property
    def chosen_tokens(self) -> int:
        """Scored tokens of the chosen sequences, prompt included (ORPO's NLL normaliser)."""
        return sum(len(p.prompt) + len(p.chosen) - 1 for p in self.pairs)

    def packed(self, pad_id: int = 0) -> PackedPairs:
        """The ``2P`` sequences in rows of at most ``seq_len + 1`` tokens (see module doc)."""
        n = len(self.pairs)
        seqs = [(list(p.prompt) + list(p.chosen), len(p.prompt)) for p in self.pairs]
        seqs += [(list(p.prompt) + list(p.rejected), len(p.prompt)) for p in self.pairs]
        bins, sizes = _pack_rows(seqs, self.seq_len + 1, self.one_per_row)
        width = max((sum(s) for s in sizes), default=2)
        shape = (len(bins), width)
        ids = torch.full(shape, pad_id, dtype=torch.long)
        pos = torch.zeros(shape, dtype=torch.long)
        seg = torch.full(shape, -1, dtype=torch.long)  # sequence of the token itself
        resp = torch.zeros(shape, dtype=torch.bool)
        for r, members in enumerate(bins):
            at = 0
            for j in members:
                tokens, prompt_len = seqs[j]
                k = len(tokens)
                ids[r, at : at + k] = torch.tensor(tokens)
                pos[r, at : at + k] = torch.arange(k)
                seg[r, at : at + k] = j
                resp[r, at + prompt_len : at + k] = True
                at += k
        # Label t is token t+1, scored where t+1 continues the same sequence.
        same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
        labels = torch.where(same, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))
        batch = Batch(ids[:, :-1], labels, pos[:, :-1].contiguous())
        return PackedPairs(
            batch, torch.where(same, seg[:, 1:], -1), same & resp[:, 1:], num_pairs=n
        )


@dataclass(frozen=True)
class PreferenceBatches:
    """The training pairs; step ``s`` takes ``batch_size`` pairs, a pure function of (seed, s).

    Pairs are drawn from a permutation per epoch seeded by ``seed + epoch`` (as
    :class:`~moe_experts.finetune.data.PackedBatches` draws rows), so a resumed run sees the
    pairs it would have seen.
    """

    pairs: tuple[PairExample, ...]
    batch_size: int
    seed: int
    seq_len: int
    one_per_row: bool = False  # as PairBatch.one_per_row
    reference: torch.Tensor | None = None  # [N, 2] fp32, when precomputed

    def _indices(self, step: int) -> list[int]:
        return epoch_order(step, self.batch_size, len(self.pairs), self.seed)

    def _take(self, idx: Sequence[int]) -> PairBatch:
        ref = None if self.reference is None else self.reference[list(idx)]
        return PairBatch(
            tuple(self.pairs[i] for i in idx), self.seq_len, self.one_per_row, ref, tuple(idx)
        )

    def model_batch(self, step: int) -> PairBatch:
        """The global :class:`PairBatch` of optimizer step ``step`` (0-based)."""
        return self._take(self._indices(step))

    def chunks(self, size: int) -> list[PairBatch]:
        """Every pair once, in file order, ``size`` pairs a chunk (evaluation, reference)."""
        n = len(self.pairs)
        return [self._take(range(i, min(i + size, n))) for i in range(0, n, size)]

    def with_reference(self, reference: torch.Tensor) -> PreferenceBatches:
        """The same pairs carrying precomputed ``[N, 2]`` reference log-probabilities."""
        if tuple(reference.shape) != (len(self.pairs), 2):
            raise ValueError(
                f"reference log-probs have shape {tuple(reference.shape)}; expected "
                f"({len(self.pairs)}, 2)"
            )
        return replace(self, reference=reference)

    def fingerprint(self) -> str:
        """A digest of every pair's tokens: precomputed references belong to exactly these."""
        h = hashlib.sha256()
        for p in self.pairs:
            for part in (p.prompt, p.chosen, p.rejected):
                h.update(len(part).to_bytes(4, "little"))
                h.update(b"".join(int(t).to_bytes(4, "little") for t in part))
        return h.hexdigest()
