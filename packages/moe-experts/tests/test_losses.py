"""chunked_lm_cross_entropy equals torch's cross_entropy over the full logits, gradients too."""

from __future__ import annotations

import pytest
import torch

from moe_experts import ChunkedLossError, chunked_lm_cross_entropy
from moe_experts.losses import chunked_token_logprobs


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_targets: float | None = None,
) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )
    n = num_targets if num_targets is not None else int((labels != -100).sum())
    return total / max(n, 1)


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 19, 24, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(70, 24, generator=g) * 0.4).to(dtype).requires_grad_()
    labels = torch.randint(0, 70, (2, 19), generator=g)
    labels[0, :3] = -100
    labels[1, 7] = -100
    return hidden, weight, labels


def _grads(loss: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss * 3.0, xs))  # a non-unit upstream gradient


@pytest.mark.parametrize("chunk", [1, 5, 38, 1024])
def test_fp32_matches_cross_entropy(chunk: int) -> None:
    hidden, weight, labels = _inputs(torch.float32)
    ours = chunked_lm_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    ref = _reference(hidden, weight, labels)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(ours, hidden, weight), _grads(ref, hidden, weight), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_loss_matches_upcast_logits_and_grads_within_bf16() -> None:
    hidden, weight, labels = _inputs(torch.bfloat16, seed=1)
    ours = chunked_lm_cross_entropy(hidden, weight, labels, chunk_size=8)
    ref = _reference(hidden, weight, labels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    got = _grads(ours, hidden, weight)
    want = _grads(ref, hidden, weight)
    for a, b in zip(got, want, strict=False):
        assert a.dtype == torch.bfloat16
        scale = b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= 2e-2 * scale


def test_frozen_weight_and_num_targets_divisor() -> None:
    hidden, weight, labels = _inputs(torch.float32, seed=2)
    weight = weight.detach()
    ours = chunked_lm_cross_entropy(hidden, weight, labels, num_targets=7.5, chunk_size=4)
    ref = _reference(hidden, weight, labels, num_targets=7.5)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        _grads(ours, hidden)[0], _grads(ref, hidden)[0], rtol=1e-5, atol=1e-7
    )


def test_all_ignored_gives_zero_with_graph_and_zero_grad() -> None:
    hidden, weight, _ = _inputs(torch.float32)
    labels = torch.full((2, 19), -100)
    loss = chunked_lm_cross_entropy(hidden, weight, labels)
    assert loss.item() == 0.0
    (gh,) = torch.autograd.grad(loss, hidden)
    assert torch.count_nonzero(gh) == 0


def test_no_grad_forward_matches() -> None:
    hidden, weight, labels = _inputs(torch.float32)
    with torch.no_grad():
        ours = chunked_lm_cross_entropy(hidden, weight, labels, chunk_size=3)
    torch.testing.assert_close(ours, _reference(hidden, weight, labels).detach())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight": torch.zeros(24, 70)}, "lm_head weight"),
        ({"labels": torch.zeros(2, 18, dtype=torch.long)}, "labels"),
        ({"labels": torch.zeros(2, 19)}, "int64"),
        ({"chunk_size": 0}, "chunk_size"),
        (
            {"labels": torch.full((2, 19), 70)},
            r"labels\[0, 0\] = 70 is not a token id of the 70-row head nor ignore_index",
        ),
    ],
)
def test_bad_inputs_name_the_argument(kwargs: dict, match: str) -> None:
    hidden, weight, labels = _inputs(torch.float32)
    args = {"hidden": hidden, "weight": weight, "labels": labels, **kwargs}
    chunk = args.pop("chunk_size", 16)
    with pytest.raises(ChunkedLossError, match=match):
        chunked_lm_cross_entropy(args["hidden"], args["weight"], args["labels"], chunk_size=chunk)


def test_bf16_token_logprobs_match_upcast_log_softmax_with_trained_head() -> None:
    hidden, weight, labels = _inputs(torch.bfloat16, seed=3)
    h, y = hidden.detach().reshape(-1, 24).requires_grad_(), labels.reshape(-1).clamp(min=0)
    up = torch.randn(len(y), generator=torch.Generator().manual_seed(4))
    got = chunked_token_logprobs(h, weight, y, chunk_size=7)
    want = (h @ weight.t()).float().log_softmax(-1).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad((got * up).sum(), (h, weight)),
        torch.autograd.grad((want * up).sum(), (h, weight)),
        strict=True,
    ):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


def test_token_logprobs_label_outside_the_head_names_the_row() -> None:
    hidden, weight, _ = _inputs(torch.float32)
    y = torch.zeros(19, dtype=torch.long)
    y[4] = -100
    with pytest.raises(
        ChunkedLossError, match=r"labels\[4\] = -100 is not a token id of the 70-row head$"
    ):
        chunked_token_logprobs(hidden[0], weight, y)
