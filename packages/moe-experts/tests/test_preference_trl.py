"""One DPO/IPO/ORPO step of ours equals TRL's own trainers (fp32): loss, rewards, every gradient.

Ours: the built-in Qwen3-MoE checkpoint loaded with its experts on kt-kernel (as the CLI
loads it), LoRA on attention, routers and experts, pairs packed into rows. TRL: the same
checkpoint through transformers + PEFT (``target_parameters`` for routers and experts) with
the same LoRA values, its own tokenisation, padding and reference (``disable_adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is the oracle of preference training (moe-experts[test])")

import moe_experts
from lora_core import LoraConfig
from moe_experts.finetune.data import load_samples
from moe_experts.finetune.models import builtin_model_dir, load_model
from moe_experts.finetune.preference import (
    DPOObjective,
    ORPOObjective,
    reference_logps,
)
from moe_experts.finetune.preference_data import (
    PreferenceBatches,
    preference_demo_path,
    tokenize_pairs,
)

from .trl_oracle import our_grads_in_peft_layout, trl_step

SEQ_LEN = 255
TOL = {"rtol": 1e-5, "atol": 1e-5}
TEXT = [
    {"prompt": "Q: 2+2? A:", "chosen": " 4.", "rejected": " five, or so I think"},
    {"prompt": "Name a colour:", "chosen": " blue", "rejected": " a dog"},
    {"prompt": "Say hi.", "chosen": " Hi there!", "rejected": " No."},
    {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome, I believe."},
]


def _chat() -> list[dict]:
    lines = preference_demo_path().read_text().splitlines()
    return [json.loads(line) for line in lines[:4]]


def _implicit() -> list[dict]:
    return [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
        for r in _chat()
    ]


DATA = {"chat": _chat, "text": lambda: TEXT, "implicit": _implicit}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen3-MoE (random weights, byte tokenizer, chat template) on disk."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_EXPERTS_CACHE", str(tmp_path_factory.mktemp("cache")))
        return builtin_model_dir("tiny-qwen3-moe")


def _ours(model_dir: Path):
    loaded = load_model(str(model_dir), weight_dtype="fp32")
    lora = LoraConfig(
        enable=True,
        rank=4,
        alpha=8,
        init_seed=3,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.gate.weight"],
    )
    result = moe_experts.adapt_model(loaded.model, lora, weight_dtype="fp32")
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():  # non-zero B: policy != reference, and every A gets a gradient
        for name, p in result.named_optimizer_parameters:
            if name.endswith(("_b", "lora_B.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    loaded.model.train()
    return loaded, result


def _pairs(tmp_path: Path, records: list[dict], tokenizer) -> PreferenceBatches:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs, cut = tokenize_pairs(path, load_samples(path), tokenizer, max_tokens=SEQ_LEN + 1)
    assert cut == 0
    return PreferenceBatches(tuple(pairs), len(pairs), seed=0, seq_len=SEQ_LEN)


def _our_step(model, batches: PreferenceBatches, objective, grad_accum: int):
    whole = batches.chunks(len(batches.pairs))[0]
    totals = objective.totals(whole)
    micro = len(whole.pairs) // grad_accum
    loss = torch.zeros((), dtype=torch.float64)
    metrics: dict[str, float] = {}
    for m in range(grad_accum):
        parts = objective.loss(model, whole.select(m * micro, (m + 1) * micro), totals)
        parts.loss.backward()
        loss += parts.loss.detach().double()
        for k, v in parts.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    return float(loss), metrics


def _compare(ours_loss, ours_metrics, result, trl_loss, trl_metrics, pairs_of, names) -> None:
    torch.testing.assert_close(ours_loss, trl_loss, **TOL)
    for name in names:
        torch.testing.assert_close(ours_metrics[name], trl_metrics[name], **TOL, msg=name)
    grads = our_grads_in_peft_layout(result)
    assert len(grads) == len(pairs_of) > 0
    for fqn, g in grads.items():
        want = pairs_of[fqn].grad
        assert want is not None, fqn
        assert want.abs().sum() > 0, fqn
        torch.testing.assert_close(g, want, **TOL, msg=fqn)


DPO_CASES = [
    # (loss, beta, label smoothing, data, grad accumulation)
    ("sigmoid", 0.1, 0.0, "chat", 1),
    ("sigmoid", 0.1, 0.0, "chat", 2),
    ("sigmoid", 0.1, 0.0, "implicit", 1),
    ("sigmoid", 0.2, 0.25, "text", 2),
    ("ipo", 0.5, 0.0, "chat", 1),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("loss_type", "beta", "smoothing", "data", "accum"), DPO_CASES)
def test_dpo_step_equals_trl(model_dir, tmp_path, loss_type, beta, smoothing, data, accum) -> None:
    loaded, result = _ours(model_dir)
    records = DATA[data]()
    batches = _pairs(tmp_path, records, loaded.tokenizer)
    objective = DPOObjective(beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    loss, metrics = _our_step(loaded.model, batches, objective, accum)

    config: dict = {"beta": beta, "loss_type": loss_type}
    if smoothing:
        # TRL 1.x has no label smoothing on "sigmoid"; conservative DPO,
        # -(1-e) logsig(z) - e logsig(-z), is 2(1-e) sigmoid - (1-2e) robust(e) in its terms.
        config = {
            "beta": beta,
            "loss_type": ["sigmoid", "robust"],
            "loss_weights": [2 * (1 - smoothing), -(1 - 2 * smoothing)],
            "label_smoothing": smoothing,
        }
    trl_loss, trl_metrics, pairs_of = trl_step(
        model_dir, result, loaded.tokenizer, records, tmp_path / "trl", **config
    )
    assert abs(metrics["rewards/margins"]) > 1e-3  # the adapters really moved the policy
    _compare(
        loss,
        metrics,
        result,
        trl_loss,
        trl_metrics,
        pairs_of,
        [
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
        ],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("accum", [1, 2])
def test_orpo_step_equals_trl(model_dir, tmp_path, accum) -> None:
    """TRL's ORPO averages its NLL per micro-batch; ours over the step, so with accumulation
    ours equals TRL's one-batch step (and accumulation changes nothing, as for SFT)."""
    loaded, result = _ours(model_dir)
    batches = _pairs(tmp_path, TEXT, loaded.tokenizer)
    loss, metrics = _our_step(loaded.model, batches, ORPOObjective(lam=0.3), accum)
    trl_loss, trl_metrics, pairs_of = trl_step(
        model_dir, result, loaded.tokenizer, TEXT, tmp_path / "trl", method="orpo", beta=0.3
    )
    _compare(
        loss,
        metrics,
        result,
        trl_loss,
        trl_metrics,
        pairs_of,
        [
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
            "nll_loss",
            "log_odds_ratio",
            "log_odds_chosen",
        ],
    )


@pytest.mark.timeout(300)
def test_precomputed_reference_gives_the_same_step(model_dir, tmp_path) -> None:
    """Reference values computed up front (split over 2 simulated ranks' chunks) = on the fly."""
    loaded, result = _ours(model_dir)
    batches = _pairs(tmp_path, _chat(), loaded.tokenizer)
    ref = reference_logps(loaded.model, batches.chunks(1), len(batches.pairs))
    objective = DPOObjective()
    fly_loss, fly = _our_step(loaded.model, batches, objective, 1)
    fly_grads = {n: g.clone() for n, g in our_grads_in_peft_layout(result).items()}
    for p in result.parameters():
        p.grad = None
    pre_loss, pre = _our_step(loaded.model, batches.with_reference(ref), objective, 2)
    torch.testing.assert_close(pre_loss, fly_loss, **TOL)
    for k in fly:
        torch.testing.assert_close(pre[k], fly[k], **TOL, msg=k)
    for n, g in our_grads_in_peft_layout(result).items():
        torch.testing.assert_close(g, fly_grads[n], **TOL, msg=n)
