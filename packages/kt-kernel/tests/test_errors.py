"""Bad input raises an error naming the argument, the expected and the received value."""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk


def _call(p, **over):
    args = {"x": p.x, "topk_ids": p.ids, "topk_weights": p.w, "weights": p.weights, "lora": p.lora}
    args.update(over)
    return kk.moe_experts_forward(**args)


@pytest.mark.parametrize(
    ("override", "exc", "pattern"),
    [
        (
            {"x": torch.zeros(37, 63)},
            kk.KernelInputError,
            r"x must have shape \[T, 64\].*\[37, 63\]",
        ),
        (
            {"x": torch.zeros(37, 64, dtype=torch.float64)},
            kk.KernelDTypeError,
            r"x has dtype torch.float64 but the expert weights are torch.float32",
        ),
        (
            {"topk_ids": torch.zeros(36, 3, dtype=torch.long)},
            kk.KernelInputError,
            r"topk_ids must have shape \[T=37, k>=1\], got \[36, 3\]",
        ),
        (
            {"topk_ids": torch.zeros(37, 3)},
            kk.KernelDTypeError,
            r"topk_ids must be an integer tensor, got torch.float32",
        ),
        (
            {"topk_ids": torch.full((37, 3), 8)},
            kk.KernelInputError,
            r"topk_ids must lie in \[0, num_experts=8\), got id 8",
        ),
        ({"topk_ids": torch.full((37, 3), -1)}, kk.KernelInputError, r"got id -1"),
        (
            {"topk_weights": torch.zeros(37, 2)},
            kk.KernelInputError,
            r"topk_weights must have the shape of topk_ids \[37, 3\], got \[37, 2\]",
        ),
        (
            {"topk_weights": torch.zeros(37, 3, dtype=torch.long)},
            kk.KernelDTypeError,
            r"topk_weights must be a floating-point tensor, got torch.int64",
        ),
        ({"weights": "w"}, kk.KernelInputError, r"weights must be an ExpertWeights, got str"),
        ({"lora": 3}, kk.KernelInputError, r"lora must be a LoraBuffers or None, got int"),
    ],
)
def test_bad_forward_arguments(kt, override, exc, pattern) -> None:
    p = kt.make_problem()
    with pytest.raises(exc, match=pattern):
        _call(p, **override)


def test_bad_options_and_mismatched_lora(kt) -> None:
    p = kt.make_problem()
    with pytest.raises(kk.KernelInputError, match=r"policy must be 'save' or 'recompute', got 'x'"):
        kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, policy="x")  # type: ignore[arg-type]
    with pytest.raises(kk.KernelInputError, match=r"backend must be"):
        kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, backend="gpu")  # type: ignore[arg-type]
    other = kk.LoraBuffers(kk.ExpertSpec(8, 64, 16), 4)
    with pytest.raises(kk.KernelInputError, match=r"lora.spec .* does not match weights.spec"):
        kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, other)


def test_bad_specs_and_buffers(kt) -> None:
    with pytest.raises(
        kk.KernelInputError, match=r"ExpertSpec.hidden_size must be a positive int, got 0"
    ):
        kk.ExpertSpec(2, 0, 4)
    with pytest.raises(kk.KernelInputError, match=r"ExpertSpec.activation must be one of"):
        kk.ExpertSpec(2, 4, 4, activation="gelu")
    spec = kk.ExpertSpec(2, 4, 3)
    with pytest.raises(
        kk.KernelInputError, match=r"gate_up must have shape \[2, 6, 4\], got \[2, 3, 4\]"
    ):
        kk.ExpertWeights.from_fused(spec, torch.zeros(2, 3, 4), torch.zeros(2, 4, 3))
    with pytest.raises(
        kk.KernelInputError, match=r"down must have shape \[2, 4, 3\], got \[2, 3, 4\]"
    ):
        kk.ExpertWeights.from_split(
            spec, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
        )
    with pytest.raises(kk.KernelDTypeError, match=r"for int8 storage pass weight_dtype='int8'"):
        kk.ExpertWeights.from_fused(spec, torch.zeros(2, 6, 4), torch.zeros(2, 4, 3), dtype="int8")
    with pytest.raises(kk.KernelInputError, match=r"rank must be a positive int, got 0"):
        kk.LoraBuffers(spec, 0)
    with pytest.raises(kk.KernelInputError, match=r"layout must be 'split' or 'fused', got 'x'"):
        kk.LoraBuffers(spec, 2, layout="x")  # type: ignore[arg-type]
    src = dict(kk.LoraBuffers(spec, 2).named_parameters())
    src["gate_lora_b"] = torch.nn.Parameter(torch.zeros(2, 2, 3))
    with pytest.raises(
        kk.KernelInputError, match=r"gate_lora_b must have shape \[2, 3, 2\], got \[2, 2, 3\]"
    ):
        kk.LoraBuffers.from_tensors(spec, 2, 2.0, "split", src)


def test_native_backend_on_request_raises_when_not_cpu_or_missing(kt) -> None:
    p = kt.make_problem()
    if kk.backend_info().native_available:
        kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, backend="native")
    else:
        with pytest.raises(kk.KernelInputError, match="needs the compiled extension"):
            kk.moe_experts_forward(p.x, p.ids, p.w, p.weights, backend="native")
