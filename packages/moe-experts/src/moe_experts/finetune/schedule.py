"""Learning-rate schedules: a pure function of the step, so a resumed run continues exactly."""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at"]


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# name -> factor of the peak lr after warm-up, given progress in [0, 1).
SCHEDULES = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def lr_at(step: int, *, peak: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Warm-up rises linearly to ``peak`` over ``warmup_steps`` steps (step 0 already gets
    ``peak / warmup_steps``); then ``schedule`` decays it, linear and cosine towards 0 at
    ``total_steps``.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * SCHEDULES[schedule](min(progress, 1.0))
