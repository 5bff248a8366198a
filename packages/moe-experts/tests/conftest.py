"""Shared fixtures: fixed seeds and one tiny saved-and-reloaded model per supported family."""

from __future__ import annotations

import copy
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from moe_experts.testing import TINY_FAMILIES, tiny_model

FAMILIES = TINY_FAMILIES


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def saved_models(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[type[PreTrainedModel], Path]]:
    """Build each tiny model once with random weights and save_pretrained it to a temp dir."""
    out = {}
    for family in FAMILIES:
        torch.manual_seed(1234)
        model = tiny_model(family)
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(path)
        out[family] = (type(model), path)
    return out


@pytest.fixture(scope="session")
def loaded_models(
    saved_models: dict[str, tuple[type[PreTrainedModel], Path]],
) -> dict[str, PreTrainedModel]:
    """Load every saved model back through from_pretrained (the real loading code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            f: cls.from_pretrained(p, dtype=torch.float32).eval()
            for f, (cls, p) in saved_models.items()
        }


@pytest.fixture
def fresh(loaded_models: dict[str, PreTrainedModel]):
    """Return a function giving an independent deep copy of a family's loaded model."""

    def make(family: str) -> PreTrainedModel:
        return copy.deepcopy(loaded_models[family])

    return make


def token_batch(vocab: int = 96, batch: int = 2, seq: int = 9, seed: int = 7) -> torch.Tensor:
    """A fixed batch of token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)
