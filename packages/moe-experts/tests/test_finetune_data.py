"""Data formats, response-only masks, packing boundaries and bad-record errors of ``--data``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_experts.finetune.chat import assistant_spans, render_conversation
from moe_experts.finetune.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    DataError,
    Example,
    PackedBatches,
    causal_lm_loss,
    chat_demo_path,
    load_examples,
    load_samples,
)
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import DATA_FORMATS, DataFormat, PreferencePair, Sample
from moe_experts.finetune.models import BUILTIN_MODELS
from moe_experts.finetune.tokenizer import build_byte_tokenizer

CHAT = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "6."},
)

# One record per format, written the way each format's users write it, and the sample it means.
RECORDS: dict[str, tuple[dict, Sample]] = {
    "text": ({"text": "a plain document"}, Sample(text="a plain document")),
    "messages": ({"messages": list(CHAT)}, Sample(messages=CHAT)),
    "alpaca": (
        {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
        Sample(
            messages=(
                {"role": "user", "content": "Add the numbers.\n\n2 and 2"},
                {"role": "assistant", "content": "4"},
            )
        ),
    ),
    "sharegpt": (
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "What is 2 plus 2?"},
                {"from": "gpt", "value": "4."},
                {"from": "human", "value": "And 3 plus 3?"},
                {"from": "gpt", "value": "6."},
            ]
        },
        Sample(messages=CHAT),
    ),
    # Preference pairs (--method dpo|orpo): an explicit prompt, or the shared leading turns.
    "preference": (
        {"prompt": list(CHAT[:2]), "chosen": [CHAT[2]], "rejected": [CHAT[4]]},
        Sample(pair=PreferencePair(CHAT[:2], CHAT[2:3], CHAT[4:5])),
    ),
    "preference_implicit": (
        {"chosen": list(CHAT[:3]), "rejected": [*CHAT[:2], CHAT[4]]},
        Sample(pair=PreferencePair(CHAT[:2], CHAT[2:3], CHAT[4:5])),
    ),
}

# A thinking-model template written for this test, behaving as Qwen3's does: the reply after the
# last user turn gets a <think> block, empty when the data has no reasoning.
THINKING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}"
    "{% set parts = m['content'].split('</think>') %}"
    "{% set reasoning = parts[0].split('<think>')[-1].strip() if parts | length > 1 else '' %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' "
    "+ parts[-1].strip() + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    """The built-in model's tokenizer (bytes, BOS/EOS/PAD, a small chat template)."""
    return build_byte_tokenizer()


def _trained_text(tok, ids: list[int], train: list[bool]) -> list[str]:
    """The trained tokens decoded, one string per contiguous run."""
    runs, cur = [], []
    for i, t in zip(ids, train, strict=True):
        if t:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def _write(path: Path, records: list) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=2))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_registry_is_one_table_of_formats() -> None:
    assert set(DATA_FORMATS) == set(RECORDS)
    for name, fmt in DATA_FORMATS.items():
        assert isinstance(fmt, DataFormat)
        assert fmt.name == name


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_format_is_detected_and_parsed(tmp_path: Path, name: str, suffix: str) -> None:
    record, expected = RECORDS[name]
    path = _write(tmp_path / f"data{suffix}", [record, record])
    assert load_samples(path) == [expected, expected]
    assert load_samples(path, name) == [expected, expected]


def test_txt_lines_are_text_documents(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\n  second line  \n")
    assert load_samples(path) == [Sample(text="first line"), Sample(text="second line")]


def test_forced_format_wins_over_detection(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "both.jsonl",
        [{"text": "plain", "messages": [{"role": "assistant", "content": "x"}]}],
    )
    assert load_samples(path) == [Sample(messages=({"role": "assistant", "content": "x"},))]
    assert load_samples(path, "text") == [Sample(text="plain")]
    with pytest.raises(FinetuneError, match="--data-format 'csv'"):
        load_samples(path, "csv")


def test_each_bad_record_is_one_line_naming_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    lines = [
        json.dumps(good),
        json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": 3}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps(good),
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_samples(path)
    assert info.value.lines == [
        f"{path}:2: messages field messages[0].role: 'robot' is not one of "
        "system, user, assistant, tool",
        f"{path}:3: field (line): not valid JSON (Expecting property name enclosed in double "
        "quotes at column 2)",
        f"{path}:4: messages field messages[0].content: expected a string, got int",
        f"{path}:5: messages field messages: the conversation has no non-empty assistant turn "
        "to train on",
    ]


def test_alpaca_and_sharegpt_fields_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", [{"instruction": "x", "output": ""}, {"instruction": "x"}])
    with pytest.raises(DataError) as info:
        load_samples(path)
    assert [line.split(": ")[1] for line in info.value.lines] == [
        "alpaca field output",
        "alpaca field output",
    ]
    path = _write(tmp_path / "s.json", [{"conversations": [{"from": "bot", "value": "x"}]}])
    with pytest.raises(DataError, match=r"s\.json:2: sharegpt field conversations\[0\]\.from"):
        load_samples(path)


def test_record_matching_no_format_lists_the_formats(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(FinetuneError, match=r"x\.jsonl:1: .*keys: completion, prompt.*alpaca"):
        load_samples(path)


def test_many_bad_records_are_capped(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [{"text": 1}] * 30)
    with pytest.raises(DataError) as info:
        load_samples(path)
    assert len(info.value.lines) == 21
    assert info.value.lines[-1] == "... and 10 more bad records"


def test_builtin_tokenizer_is_the_byte_tokenizer(tok) -> None:
    assert len(tok) == BUILTIN_MODELS["tiny-qwen3-moe"]["vocab_size"]
    text = "héllo, wörld <|user|>"
    assert tok(text)["input_ids"] + [tok.eos_token_id] == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize("name", ["messages", "alpaca", "sharegpt"])
def test_loss_only_on_replies_and_their_end_of_turn(tmp_path: Path, tok, name: str) -> None:
    record, sample = RECORDS[name]
    path = _write(tmp_path / "d.jsonl", [record])
    (ex,) = load_examples(path, tok)
    rendered = tok.apply_chat_template(list(sample.messages), tokenize=False)
    assert tok.decode(list(ex.ids)) == rendered  # the template's own rendering, token for token
    replies = [m["content"] + "</s>" for m in sample.messages if m["role"] == "assistant"]
    assert _trained_text(tok, list(ex.ids), list(ex.train)) == replies
    (everything,) = load_examples(path, tok, train_on_prompt=True)
    assert everything.ids == ex.ids
    assert all(everything.train)


def test_thinking_template_gets_no_loss_on_its_empty_think_block(tok) -> None:
    tok = build_byte_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    rendered, _ = assistant_spans(tok, messages)
    assert "<think>\n\n</think>\n\n4<|im_end|>" in rendered  # the template did insert it
    ids, train = render_conversation(tok, messages)
    assert _trained_text(tok, ids, train) == ["hello<|im_end|>", "4<|im_end|>"]
    # Reasoning that the data carries is part of the reply and is trained.
    messages[-1]["content"] = "<think>two and two</think>4"
    ids, train = render_conversation(tok, messages)
    assert _trained_text(tok, ids, train) == [
        "hello<|im_end|>",
        "<think>\ntwo and two\n</think>\n\n4<|im_end|>",
    ]


def test_template_that_rewrites_a_reply_names_file_line_and_field(tmp_path: Path) -> None:
    tok = build_byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    )
    record = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    )
    path = tmp_path / "c.jsonl"
    path.write_text(f"{record}\n\n{record}\n")
    with pytest.raises(DataError) as info:
        load_examples(path, tok)
    assert [line.split(": ", 2)[:2] for line in info.value.lines] == [
        [f"{path}:1", "field messages[1].content"],
        [f"{path}:3", "field messages[1].content"],
    ]


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path: Path, tok) -> None:
    plain = build_byte_tokenizer()
    plain.chat_template = None
    path = _write(tmp_path / "c.jsonl", [RECORDS["messages"][0]])
    with pytest.raises(FinetuneError, match="has no chat template"):
        load_examples(path, plain)


def test_shipped_chat_dataset_renders(tok) -> None:
    examples = load_examples(chat_demo_path(), tok)
    assert len(examples) >= 30
    for ex in examples:
        assert any(ex.train)
        assert not all(ex.train)


@pytest.mark.parametrize("prompt", ["What is the opposite of hot?", "What color is the sky?"])
def test_generate_prompt_is_the_training_prompt_of_the_demo(tok, prompt: str) -> None:
    """`moe-experts generate` feeds exactly the tokens training puts before the reply."""
    from moe_experts.finetune.generate import prompt_ids

    ids = prompt_ids(tok, prompt)
    examples = [
        ex for ex in load_examples(chat_demo_path(), tok) if list(ex.ids[: len(ids)]) == ids
    ]
    assert examples, f"the demo prompt {prompt!r} is not a training prompt of the demo data"
    for ex in examples:
        assert not any(ex.train[: len(ids)])
        assert ex.train[len(ids)]


def test_a_conversation_that_fits_a_row_is_never_cut(tok) -> None:
    """Packed chat rows hold whole conversations, each with all its reply targets."""
    examples = load_examples(chat_demo_path(), tok)
    seq_len = 128
    packed = PackedBatches.from_examples(examples, seq_len=seq_len, batch_size=1, seed=0)
    assert packed.targets is not None
    assert int(packed.targets.sum()) == sum(sum(ex.train) for ex in examples)
    rows = {tuple(r) for r in packed.rows.tolist()}
    fitting = [ex for ex in examples if len(ex.ids) <= seq_len + 1]
    assert len(fitting) >= 30
    for ex in fitting:
        # Each conversation that fits appears whole inside one row.
        assert any(
            any(row[i : i + len(ex.ids)] == ex.ids for i in range(len(row))) for row in rows
        ), tok.decode(list(ex.ids))


def _tiny_model():
    from transformers import AutoConfig

    spec = dict(BUILTIN_MODELS["tiny-qwen3-moe"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    return model.eval()


def test_packed_rows_keep_examples_apart_and_masked_tokens_carry_no_gradient() -> None:
    """Packing with attention boundaries: a packed row equals its examples run one by one."""
    g = torch.Generator().manual_seed(0)
    lengths = [7, 11, 5, 9]
    examples = []
    for n in lengths:
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        train = (torch.rand(n, generator=g) > 0.4).tolist()
        examples.append(Example(tuple(ids), tuple(train)))
    seq_len = sum(lengths) - 1
    packed = PackedBatches.from_examples(examples, seq_len=seq_len, batch_size=1, seed=0)
    batch = packed.model_batch(0)
    assert batch.position_ids.tolist() == [[p for n in lengths for p in range(n)][:-1]]

    model = _tiny_model()
    with torch.no_grad():
        logits = model(**batch.model_inputs(model)).logits
        crossing = model(input_ids=batch.input_ids).logits  # one causal sequence: no boundaries
        start = 0
        for n in lengths:
            alone = model(input_ids=batch.input_ids[:, start : start + n]).logits
            width = alone.shape[1]
            torch.testing.assert_close(
                logits[:, start : start + width], alone, rtol=1e-5, atol=1e-5
            )
            start += n
    # The check above can fail: without the boundaries the later examples do differ.
    assert not torch.allclose(crossing[:, lengths[0] :], logits[:, lengths[0] :], atol=1e-3)

    # Labels: the next token where it is a target of the same example, -100 elsewhere.
    expected = []
    flat_ids = [i for ex in examples for i in ex.ids]
    flat_train = [t for ex in examples for t in ex.train]
    starts = {sum(lengths[:k]) for k in range(len(lengths))}
    for t in range(seq_len):
        keep = flat_train[t + 1] and (t + 1) not in starts
        expected.append(flat_ids[t + 1] if keep else IGNORE_INDEX)
    assert batch.labels.tolist() == [expected]

    # The loss gradient at every masked position is exactly zero, and the parameter gradient
    # equals the one from the targets alone (per example, summed), so masked tokens add nothing.
    logits = model(**batch.model_inputs(model)).logits
    logits.retain_grad()
    loss = causal_lm_loss(logits, batch.labels)
    loss.backward()
    masked = batch.labels[0] == IGNORE_INDEX
    assert masked.any()
    assert (~masked).any()
    assert torch.count_nonzero(logits.grad[0, masked]) == 0
    packed_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    n_targets = batch.num_targets
    start = 0
    for n in lengths:
        labels = batch.labels[:, start : start + n]
        if (labels != IGNORE_INDEX).any():
            sub = model(input_ids=batch.input_ids[:, start : start + n]).logits
            part = (
                torch.nn.functional.cross_entropy(
                    sub.float().reshape(-1, sub.shape[-1]),
                    labels.reshape(-1),
                    reduction="sum",
                    ignore_index=IGNORE_INDEX,
                )
                / n_targets
            )
            part.backward()
        start += n
    torch.testing.assert_close(packed_grad, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_loss_is_zero_with_a_graph_when_nothing_is_a_target() -> None:
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((1, 3), IGNORE_INDEX))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.count_nonzero(logits.grad) == 0


def test_batches_are_a_pure_function_of_seed_and_step(tok) -> None:
    examples = load_examples(chat_demo_path(), tok)
    a = PackedBatches.from_examples(examples, seq_len=32, batch_size=4, seed=3)
    b = PackedBatches.from_examples(examples, seq_len=32, batch_size=4, seed=3)
    for step in (0, 5, 50):
        x, y = a.model_batch(step), b.model_batch(step)
        assert torch.equal(x.input_ids, y.input_ids)
        assert torch.equal(x.labels, y.labels)


def test_all_prompt_data_is_refused() -> None:
    examples = [Example((1, 2, 3, 4), (False,) * 4)] * 4
    with pytest.raises(FinetuneError, match="no tokens to train on"):
        PackedBatches.from_examples(examples, seq_len=4, batch_size=1, seed=0)


def test_finetune_all_is_curated() -> None:
    import moe_experts.finetune as ft

    assert sorted(ft.__all__) == sorted(
        [
            "BUILTIN_MODELS",
            "DATA_FORMATS",
            "EXPORT_FORMATS",
            "ByteTokenizer",
            "DataError",
            "DataFormat",
            "Example",
            "FinetuneArgs",
            "FinetuneError",
            "FinetuneSummary",
            "PackedBatches",
            "PeerLostError",
            "Sample",
            "TrainingDivergedError",
            "TrainingInterrupted",
            "export",
            "generate",
            "load_examples",
            "load_model",
            "load_samples",
            "load_texts",
            "run_finetune",
        ]
    )
    for name in ft.__all__:
        assert getattr(ft, name) is not None


def test_rank_losses_normalised_globally_average_to_the_global_mean() -> None:
    """Two data-parallel halves with unequal masking: their mean gradient is the global one."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (4, 6), generator=g)
    labels[0, :5] = IGNORE_INDEX  # rank 0 holds far fewer targets than rank 1
    causal_lm_loss(logits, labels).backward()
    expected = logits.grad.clone()
    logits.grad = None
    total = int((labels != IGNORE_INDEX).sum())
    halves = [causal_lm_loss(logits[i : i + 2], labels[i : i + 2], total / 2) for i in (0, 2)]
    (sum(halves) / 2).backward()
    torch.testing.assert_close(logits.grad, expected)
