"""Packing whole conversations best-fit into rows, and splitting long ones at their turns."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moe_experts.finetune.chat import render_turns
from moe_experts.finetune.config import FinetuneArgs
from moe_experts.finetune.data import (
    IGNORE_INDEX,
    Example,
    PackedBatches,
    chat_demo_path,
    tokenize_samples,
)
from moe_experts.finetune.models import BUILTIN_MODELS
from moe_experts.finetune.packing import best_fit_decreasing, split_at_turns
from moe_experts.finetune.run import _read_samples
from moe_experts.finetune.tokenizer import build_byte_tokenizer
from moe_experts.isolation import DEMO_PADDING_COST

# In data order, the old greedy packing (a conversation that does not fit the rest of the row
# starts a new one) needs 5 rows of 10: [6] [5 4] [5 3] [7] [8 2]. 40 tokens fit exactly 4.
LENGTHS = [6, 5, 4, 5, 3, 7, 8, 2]


def _conversations(lengths: list[int], seed: int = 0) -> list[Example]:
    """Conversations with token ids unique across all of them (never 0, the padding id)."""
    g = torch.Generator().manual_seed(seed)
    examples, next_id = [], 1
    for n in lengths:
        ids = tuple(range(next_id, next_id + n))
        next_id += n
        train = [False, *(torch.rand(n - 1, generator=g) > 0.4).tolist()]
        examples.append(Example(ids, tuple(train), ()))
    return examples


def _all_rows(packed: PackedBatches):
    return replace(packed, batch_size=packed.rows.shape[0]).model_batch(0)


def _segments(packed: PackedBatches) -> dict[int, tuple[int, int, int]]:
    """First token id of each packed piece -> (row, start, length), from the position ids."""
    assert packed.positions is not None
    found = {}
    for r, (row, pos) in enumerate(
        zip(packed.rows.tolist(), packed.positions.tolist(), strict=True)
    ):
        t = 0
        while t < len(row):
            n = 1
            while t + n < len(row) and pos[t + n] == pos[t + n - 1] + 1:
                n += 1
            if row[t] != 0:
                found[row[t]] = (r, t, n)
            t += n
    return found


def test_best_fit_decreasing_places_the_fixed_lengths_optimally() -> None:
    assert best_fit_decreasing(LENGTHS, 10) == [[6, 7], [5, 4], [0, 2], [1, 3]]
    assert best_fit_decreasing([*LENGTHS, 9], 10) == [[8], [6, 7], [5, 4], [0, 2], [1, 3]]
    with pytest.raises(ValueError, match="item 1 has size 11"):
        best_fit_decreasing([3, 11], 10)


@pytest.mark.parametrize(
    ("lengths", "rows", "padding"),
    [
        (LENGTHS, 4, 0.0),  # 40 tokens in 4 rows of 10: no padding (greedy: 5 rows, 20%)
        ([*LENGTHS, 9], 5, 1 / 50),  # 49 tokens: 5 rows are the minimum, 1 pad token
        ([6, 6, 6, 4, 4, 4], 3, 0.0),  # greedy in order: [6] [6] [6 4] [4 4], 4 rows
    ],
)
def test_packing_rows_and_padding_are_the_optimum(lengths, rows, padding) -> None:
    examples = _conversations(lengths)
    packed = PackedBatches.from_examples(examples, seq_len=9, batch_size=2, seed=0)
    assert packed.rows.shape == (rows, 10)
    assert packed.pad_tokens == rows * 10 - sum(lengths)
    assert packed.padding_fraction == pytest.approx(padding, abs=1e-12)
    assert int((packed.rows == 0).sum()) == packed.pad_tokens

    # Every token of every conversation exactly once, each conversation whole in one row, in
    # order, with positions 0..n-1 and its own targets.
    packed_tokens = sorted(t for t in packed.rows.flatten().tolist() if t != 0)
    assert packed_tokens == sorted(t for ex in examples for t in ex.ids)
    segments = _segments(packed)
    assert len(segments) == len(examples)
    batch = _all_rows(packed)
    order = replace(packed, batch_size=packed.rows.shape[0])._indices(0)
    where = {row: i for i, row in enumerate(order)}
    for ex in examples:
        r, t, n = segments[ex.ids[0]]
        assert n == len(ex.ids)
        assert tuple(packed.rows[r, t : t + n].tolist()) == ex.ids
        assert tuple(packed.targets[r, t : t + n].tolist()) == ex.train
        # Labels equal the conversation's own: next token where trained, none after its end.
        alone = [ex.ids[i + 1] if ex.train[i + 1] else IGNORE_INDEX for i in range(n - 1)]
        labels = batch.labels[where[r], t : t + n].tolist()
        assert labels[: n - 1] == alone
        assert labels[n - 1 :] in ([], [IGNORE_INDEX])
    # Padding carries no loss.
    assert all(
        lab == IGNORE_INDEX
        for row, labs in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True)
        for tok, lab in zip(row, labs, strict=True)
        if tok == 0
    )


def test_packing_is_deterministic_and_batches_depend_on_the_seed() -> None:
    examples = _conversations([*LENGTHS, 9, 1, 7])
    a = PackedBatches.from_examples(examples, seq_len=9, batch_size=3, seed=5)
    b = PackedBatches.from_examples(examples, seq_len=9, batch_size=3, seed=5)
    assert torch.equal(a.rows, b.rows)
    assert torch.equal(a.model_batch(2).input_ids, b.model_batch(2).input_ids)
    c = PackedBatches.from_examples(examples, seq_len=9, batch_size=3, seed=6)
    assert torch.equal(a.rows, c.rows)  # the placement depends on the lengths only


def _tiny_model() -> torch.nn.Module:
    spec = dict(BUILTIN_MODELS["tiny-qwen3-moe"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model(spec.pop("model_type"), **spec)
    ).eval()


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )


def test_loss_of_a_packed_row_is_the_sum_of_its_conversations_alone() -> None:
    """No cross-contamination: each row's summed loss equals its conversations' run alone."""
    lengths = [9, 14, 5, 12, 7, 11, 4, 3]  # 65 tokens into rows of 24: 3 rows, padding at ends
    examples = _conversations(lengths, seed=1)
    packed = PackedBatches.from_examples(examples, seq_len=23, batch_size=1, seed=0)
    assert packed.rows.shape[0] == 3
    assert packed.pad_tokens == 3 * 24 - sum(lengths)
    batch = _all_rows(packed)
    order = replace(packed, batch_size=packed.rows.shape[0])._indices(0)
    segments = _segments(packed)
    by_first = {ex.ids[0]: ex for ex in examples}
    model = _tiny_model()
    with torch.no_grad():
        packed_logits = model(**batch.model_inputs(model)).logits
        plain_logits = model(input_ids=batch.input_ids).logits  # no boundaries
        crossing = 0.0
        for i, r in enumerate(order):
            members = [by_first[first] for first, (row, _, _) in segments.items() if row == r]
            assert len(members) >= 2
            alone = torch.zeros((), dtype=torch.float64)
            for ex in members:
                ids = torch.tensor([ex.ids])
                labels = torch.tensor(
                    [
                        [
                            ex.ids[k + 1] if ex.train[k + 1] else IGNORE_INDEX
                            for k in range(len(ex.ids) - 1)
                        ]
                    ]
                )
                alone += _loss_sum(model(input_ids=ids[:, :-1]).logits, labels).double()
            packed_loss = _loss_sum(packed_logits[i : i + 1], batch.labels[i : i + 1])
            torch.testing.assert_close(packed_loss.double(), alone, rtol=1e-5, atol=1e-5)
            crossing = max(
                crossing,
                abs(
                    float(_loss_sum(plain_logits[i : i + 1], batch.labels[i : i + 1]))
                    - float(alone)
                ),
            )
    # The comparison above can fail: attending across conversations changes the loss.
    assert crossing > 1e-2


def test_split_at_turns_fixed_cases() -> None:
    assert split_at_turns(100, [30, 55, 80], 40) == [(0, 30), (30, 55), (55, 80), (80, 100)]
    assert split_at_turns(100, [80, 30, 55], 60) == [(0, 55), (55, 100)]
    # A turn longer than a row (10..90) is cut at the row's length; the next turn stays whole.
    assert split_at_turns(100, [10, 90], 40) == [(0, 10), (10, 50), (50, 90), (90, 100)]
    assert split_at_turns(100, [], 40) == [(0, 40), (40, 80), (80, 100)]
    assert split_at_turns(30, [10], 40) == [(0, 30)]
    with pytest.raises(ValueError, match="width"):
        split_at_turns(5, [], 0)


EXCHANGES = [
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("And of big?", "The opposite of big is small."),
    ("And of fast?", "The opposite of fast is slow."),
]


def test_a_long_conversation_is_split_between_exchanges() -> None:
    tok = build_byte_tokenizer()
    messages = [
        {"role": r, "content": c} for q, a in EXCHANGES for r, c in (("user", q), ("assistant", a))
    ]
    ids, train, cuts = render_turns(tok, messages)
    assert len(cuts) == 2  # after the first and second reply (the third ends the text)
    for cut, (question, _) in zip(cuts, EXCHANGES[1:], strict=True):
        assert tok.decode(ids[cut:]).lstrip().startswith(f"<|user|>\n{question}")
    example = Example(tuple(ids), tuple(train), tuple(cuts))
    longest = max(b - a for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True))
    # Rows that hold the first 2 exchanges but not 3: split at the second boundary only.
    width = cuts[1]
    assert len(ids) - width <= width < len(ids)
    packed = PackedBatches.from_examples([example], seq_len=width - 1, batch_size=1, seed=0)
    texts = [tok.decode([t for t in row if t != 0]) for row in packed.rows.tolist()]
    assert len(texts) == 2
    joined = "".join(texts)
    for question, answer in EXCHANGES:
        # Each reply is in the same row as its question, whole.
        assert sum(question in t and answer in t for t in texts) == 1, texts
        assert joined.count(answer) == 1
    assert int(packed.targets.sum()) == sum(train)
    # The tightest rows that hold one exchange each: three pieces.
    narrow = PackedBatches.from_examples([example], seq_len=longest - 1, batch_size=1, seed=0)
    assert narrow.rows.shape[0] == 3
    assert sorted(int(n) for n in (narrow.rows != 0).sum(1)) == sorted(
        b - a for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)
    )


def test_a_single_turn_longer_than_a_row_is_still_cut() -> None:
    tok = build_byte_tokenizer()
    reply = "a very long reply " * 12
    ids, train, cuts = render_turns(
        tok, [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": reply}]
    )
    assert cuts == []
    packed = PackedBatches.from_examples(
        [Example(tuple(ids), tuple(train), ())], seq_len=63, batch_size=1, seed=0
    )
    n = len(ids)
    assert packed.rows.shape[0] == -(-n // 64)
    assert [t for row in packed.rows.tolist() for t in row][:n] == ids
    assert packed.pad_tokens == packed.rows.numel() - n
    # Each piece restarts its positions: the first row holds the prompt and the reply's start.
    assert packed.positions[:, 0].tolist() == [0] * packed.rows.shape[0]
    assert "Say it." in tok.decode(packed.rows[0].tolist())


class _SlowTokenizer:
    """The byte tokenizer without offsets, as a slow (Python) tokenizer is seen by chat.py."""

    is_fast = False

    def __init__(self, fast) -> None:
        self.fast = fast
        self.chat_template = fast.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.fast.apply_chat_template(*args, **kwargs)

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": self.fast(text, add_special_tokens=add_special_tokens)["input_ids"]}


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_turn_boundaries_agree_without_offsets(train_on_prompt: bool) -> None:
    """The piecewise path (no offset mapping) finds the same tokens, targets and boundaries."""
    tok = build_byte_tokenizer()
    messages = [
        {"role": r, "content": c} for q, a in EXCHANGES for r, c in (("user", q), ("assistant", a))
    ]
    fast = render_turns(tok, messages, train_on_prompt=train_on_prompt)
    assert render_turns(_SlowTokenizer(tok), messages, train_on_prompt=train_on_prompt) == fast
    assert len(fast[2]) == 2


def test_one_example_per_row_gives_each_piece_its_own_row() -> None:
    examples = _conversations(LENGTHS)
    text = Example(tuple(range(200, 223)), (True,) * 23)  # plain text: 3 pieces of <= 10
    packed = PackedBatches.from_examples(
        [*examples, text], seq_len=9, batch_size=2, seed=0, one_per_row=True
    )
    assert packed.rows.shape == (len(LENGTHS) + 3, 10)
    assert packed.pad_tokens == packed.rows.numel() - sum(LENGTHS) - 23
    rows = zip(packed.rows.tolist()[:-3], packed.positions.tolist()[:-3], examples, strict=True)
    for row, pos, ex in rows:
        n = len(ex.ids)
        assert tuple(row[:n]) == ex.ids
        assert pos == [*range(n), *[0] * (10 - n)]
        assert row[n:] == [0] * (10 - n)
    assert [r[:8] for r in packed.rows[-3:].tolist()] == [
        list(range(200, 208)),
        list(range(210, 218)),
        list(range(220, 223)) + [0] * 5,
    ]


def test_the_demo_padding_cost_is_measured_from_the_demo_data() -> None:
    """What the coverage report and README say one example per row costs on the chat demo."""
    args = FinetuneArgs(data=chat_demo_path(), seq_len=128, eval_split=0.1)  # the demo's
    samples, _ = _read_samples(args)
    examples = tokenize_samples(chat_demo_path(), samples, build_byte_tokenizer())
    for one_per_row, rows, padding in (
        (False, DEMO_PADDING_COST.shared_rows, DEMO_PADDING_COST.shared_padding),
        (True, DEMO_PADDING_COST.own_rows, DEMO_PADDING_COST.own_padding),
    ):
        packed = PackedBatches.from_examples(
            examples, seq_len=128, batch_size=8, seed=0, one_per_row=one_per_row
        )
        assert packed.rows.shape[0] == rows
        assert packed.padding_fraction == pytest.approx(padding, abs=5e-4)
