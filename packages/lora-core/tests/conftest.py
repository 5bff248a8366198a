"""Shared fixtures for the lora-core tests."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    """Fix the global RNGs so any test data drawn from them is reproducible."""
    random.seed(0)
    torch.manual_seed(0)
