"""Shared fixtures: fixed seeds and small hand-built AdaptationResults."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lora_core import LoraConfig
from lora_core.contracts import (
    AdaptationResult,
    ComponentVersion,
    PeftExport,
    PeftTensorLayout,
)


@pytest.fixture(autouse=True)
def _fixed_seeds() -> Iterator[None]:
    random.seed(0)
    torch.manual_seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    return


def make_result(
    *, with_config: bool = True, rank_local: bool = True, experts: bool = True, extra: bool = True
) -> AdaptationResult:
    """A result with dense, stacked-expert, export-less and rank-local parameters."""
    params: list[tuple[str, nn.Parameter]] = [
        ("layer.q_proj.lora_A.weight", nn.Parameter(torch.randn(4, 8))),
        ("layer.q_proj.lora_B.weight", nn.Parameter(torch.randn(8, 4))),
    ]
    exports = {
        "layer.q_proj.lora_A.weight": PeftExport("base_model.model.layer.q_proj.lora_A.weight"),
        "layer.q_proj.lora_B.weight": PeftExport("base_model.model.layer.q_proj.lora_B.weight"),
    }
    if experts:
        params += [
            ("moe.experts.gate_up_proj.lora_A", nn.Parameter(torch.randn(3, 4, 8))),
            ("moe.experts.gate_up_proj.lora_B", nn.Parameter(torch.randn(3, 6, 4))),
        ]
        exports["moe.experts.gate_up_proj.lora_A"] = PeftExport(
            "base_model.model.moe.experts.lora_A.weight", PeftTensorLayout.EXPERT_STACKED_A
        )
        exports["moe.experts.gate_up_proj.lora_B"] = PeftExport(
            "base_model.model.moe.experts.lora_B.weight", PeftTensorLayout.EXPERT_STACKED_B
        )
    if extra:
        params.append(("moe.lora_experts.0.weight", nn.Parameter(torch.randn(5, 3).bfloat16())))
    rl: list[str] = []
    if rank_local:
        params.append(("router.rank_bias", nn.Parameter(torch.randn(6))))
        rl.append("router.rank_bias")
    ownership = {n: ("rank_local" if n in rl else "replicated") for n, _ in params}
    return AdaptationResult.create(
        adapted_layers=["layer.q_proj"],
        named_optimizer_parameters=params,
        ownership=ownership,
        producer=ComponentVersion("lora-core", "0.1.0"),
        lora_config=LoraConfig(enable=True, rank=4, alpha=8, target_modules=("q_proj",))
        if with_config
        else None,
        rank_local_names=rl,
        peft_exports=exports,
        peft_target_modules=["layer.q_proj"],
        peft_target_parameters=["moe.experts.gate_up_proj"] if experts else [],
    )


@pytest.fixture
def result() -> AdaptationResult:
    """A fresh mixed AdaptationResult."""
    return make_result()


@pytest.fixture(scope="session")
def result_factory():
    """The :func:`make_result` builder, for tests that need several results."""
    return make_result
