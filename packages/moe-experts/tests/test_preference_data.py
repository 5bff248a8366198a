"""Preference records: detection, one error line per bad record, TRL's tokenisation, packing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import moe_experts
from moe_experts.finetune.data import DataError, load_samples
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.models import BUILTIN_MODELS
from moe_experts.finetune.preference import sequence_logps
from moe_experts.finetune.preference_data import (
    PairBatch,
    PairExample,
    PreferenceBatches,
    check_preference_samples,
    preference_demo_path,
    tokenize_pairs,
)
from moe_experts.finetune.tokenizer import build_byte_tokenizer
from moe_experts.losses import chunked_token_logprobs


def _write(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


U = [{"role": "user", "content": "hi"}]
A = [{"role": "assistant", "content": "hello"}]
B = [{"role": "assistant", "content": "go away"}]


def test_both_shapes_are_detected_and_split_at_the_shared_prefix(tmp_path) -> None:
    explicit = load_samples(_write(tmp_path, [{"prompt": U, "chosen": A, "rejected": B}]))
    implicit = load_samples(_write(tmp_path, [{"chosen": U + A, "rejected": U + B}]))
    assert explicit[0].pair == implicit[0].pair
    assert explicit[0].pair.conversational
    text = load_samples(_write(tmp_path, [{"prompt": "Q", "chosen": " a", "rejected": " b"}]))
    assert text[0].pair is not None
    assert not text[0].pair.conversational


@pytest.mark.parametrize(
    ("record", "field", "why"),
    [
        ({"prompt": "Q", "chosen": " a"}, "rejected", "is missing"),
        ({"prompt": "Q", "chosen": "  ", "rejected": " b"}, "chosen", "is empty"),
        ({"prompt": U, "chosen": A, "rejected": [{"role": "assistant", "content": ""}]},
         "rejected[0]", "is empty or not an assistant turn"),
        ({"prompt": U, "chosen": "a", "rejected": B}, "chosen", "expected a non-empty list"),
        ({"chosen": U + A}, "rejected", "is missing"),
        ({"chosen": U + A, "rejected": U}, "rejected", "no turn after the shared prompt"),
        ({"chosen": A, "rejected": B}, "chosen[0]", "share no leading turn"),
    ],
)  # fmt: skip
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, record, field, why) -> None:
    good = {"prompt": "Q", "chosen": " a", "rejected": " b"}
    if "prompt" not in record:
        good = {"chosen": U + A, "rejected": U + B}
    path = _write(tmp_path, [good, record, good])
    with pytest.raises(DataError) as info:
        load_samples(path)
    assert len(info.value.lines) == 1
    line = info.value.lines[0]
    assert line.startswith(f"{path}:2: ")
    assert f"field {field}: " in line
    assert why in line


def test_the_cli_prints_one_error_line_for_a_missing_side(tmp_path) -> None:
    path = _write(tmp_path, [{"prompt": "Q", "chosen": " a", "rejected": " b"}, {"prompt": "Q"}])
    proc = subprocess.run(
        [sys.executable, "-m", "moe_experts.finetune", "--method", "dpo", "--data", str(path),
         "--output", str(tmp_path / "out"), "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: {path}:2: preference field chosen: is missing: a preference "
                      "record needs both sides"]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "records", "why"),
    [
        ("sft", [{"prompt": "Q", "chosen": " a", "rejected": " b"}], "--method dpo or"),
        ("dpo", [{"messages": U + A}], "needs preference records"),
    ],
)
def test_the_method_and_the_records_must_agree(tmp_path, method, records, why) -> None:
    path = _write(tmp_path, records)
    with pytest.raises(FinetuneError, match=why):
        check_preference_samples(path, load_samples(path), method)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--beta", "0.2"], "--beta applies to --method dpo"),
        (["--method", "orpo", "--precompute-reference"], "applies to --method dpo"),
        (["--method", "dpo", "--orpo-lambda", "0.5"], "applies to --method orpo"),
        (["--method", "dpo", "--dpo-loss", "ipo", "--label-smoothing", "0.1"],
         "applies to --dpo-loss sigmoid"),
        (["--method", "dpo", "--label-smoothing", "0.5"], "must be in [0, 0.5)"),
        (["--method", "kto"], "expected one of sft, dpo, orpo"),
    ],
)  # fmt: skip
def test_method_settings_are_checked_before_the_model_loads(tmp_path, flags, why) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moe_experts.finetune", *flags, "--output", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode in (1, 2), proc.stderr
    assert why in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tokenisation_is_trls() -> None:
    """Chat pairs: the three renderings split where they stop agreeing (TRL's rule)."""
    tok = build_byte_tokenizer()
    samples = load_samples(preference_demo_path())
    pairs, cut = tokenize_pairs(preference_demo_path(), samples[:2], tok, max_tokens=512)
    assert cut == 0
    first = samples[0].pair
    full = tok.apply_chat_template([*first.prompt, *first.chosen], tokenize=True)["input_ids"]
    prompt = tok.apply_chat_template(list(first.prompt), add_generation_prompt=True)["input_ids"]
    assert list(pairs[0].prompt) == list(prompt)
    assert list(pairs[0].prompt + pairs[0].chosen) == list(full)
    assert tok.decode(pairs[0].chosen) == "The opposite of hot is cold.</s>\n"
    short, cut = tokenize_pairs(preference_demo_path(), samples[:2], tok, max_tokens=60)
    assert cut == 2
    assert all(len(p.prompt) + len(p.chosen) == 60 for p in short)
    with pytest.raises(DataError, match="leaves no room for a response"):
        tokenize_pairs(preference_demo_path(), samples[:1], tok, max_tokens=len(prompt))


def test_chunked_token_logprobs_equal_log_softmax_with_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=gen)
    up = torch.randn(37, generator=gen)
    got = chunked_token_logprobs(h, w, y, chunk_size=8)
    (got * up).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    want = (h @ w.t()).log_softmax(-1).gather(1, y[:, None]).squeeze(1)
    (want * up).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)


def test_packed_pairs_score_each_sequence_as_if_alone() -> None:
    """Packed rows (best-fit, position_ids restarting) = one sequence per row = each alone."""
    spec = dict(BUILTIN_MODELS["tiny-qwen3-moe"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    moe_experts.wrap(model, weight_dtype="fp32")
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, 256, (n,), generator=gen).tolist())

    pairs = tuple(
        PairExample(ids(p), ids(c), ids(r)) for p, c, r in [(5, 9, 3), (12, 2, 7), (4, 6, 6)]
    )
    packed = PairBatch(pairs, seq_len=31).packed()
    assert packed.batch.input_ids.shape[0] < 6  # several sequences really share a row
    alone = PairBatch(pairs, seq_len=31, one_per_row=True).packed()
    assert alone.batch.input_ids.shape[0] == 6
    with torch.no_grad():
        got = sequence_logps(model, packed)
        rows = sequence_logps(model, alone)
        for i, p in enumerate(pairs):
            for j, side in enumerate((p.chosen, p.rejected)):
                seq = torch.tensor([p.prompt + side])
                lp = model(seq).logits[0, len(p.prompt) - 1 : -1].float().log_softmax(-1)
                want = lp.gather(1, torch.tensor(side)[:, None]).sum()
                k = i + j * len(pairs)
                torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(rows[k], want, rtol=1e-5, atol=1e-5)


def test_one_sequence_per_row_reaches_every_batch() -> None:
    """``one_per_row`` (a family that cannot keep packed sequences apart) holds for the steps'
    batches, their micro-batches and the evaluation/reference chunks alike."""
    pairs = tuple(PairExample((5, 6), (7,), (8, 9)) for _ in range(4))
    for one_per_row, rows in ((True, 4), (False, 1)):
        batches = PreferenceBatches(pairs, 2, seed=0, seq_len=15, one_per_row=one_per_row)
        step = batches.model_batch(3)
        for batch in (step, step.select(0, 2), batches.chunks(2)[1]):
            assert batch.one_per_row is one_per_row
            assert batch.packed().batch.input_ids.shape[0] == rows
