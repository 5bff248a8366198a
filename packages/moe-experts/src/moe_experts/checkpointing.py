"""Activation checkpointing of decoder layers, composed with the host kernel's own policy.

transformers' layer checkpointing (``torch.utils.checkpoint``, non-reentrant) drops each
decoder layer's activations after its forward and recomputes the layer in backward. Run
naively, that recompute would call the host kernel a second time. Here the kernel's call is
not part of it: :class:`moe_experts.hybrid.HostReplay` keeps each routed-experts output of
the forward (``[T, H]``, on the dense device) and the recompute gets it back, while the
kernel's backward runs on the graph it kept under its own save/recompute policy
(``policy="recompute"`` keeps only its inputs and routing). Everything else in the layer
(attention, norms, router, shared experts, hot experts) is recomputed.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from moe_experts.errors import WrapError
from moe_experts.hybrid import HostReplay

__all__ = ["enable_gradient_checkpointing", "replay_contexts"]


def replay_contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``torch.utils.checkpoint``'s ``context_fn``: record in the forward, replay in recompute."""
    replay = HostReplay()
    return replay.recording(), replay.replay()


def enable_gradient_checkpointing(model: nn.Module) -> int:
    """Recompute every decoder layer of ``model`` in backward; replay the host experts.

    Args:
        model: a transformers ``PreTrainedModel`` (wrapped or not).

    Returns:
        The number of layers that are now checkpointed.

    Raises:
        WrapError: the model does not support activation checkpointing.
    """
    kwargs = {"use_reentrant": False, "context_fn": replay_contexts}
    enable: Any = getattr(model, "activation_checkpointing_enable", None)
    legacy: Any = getattr(model, "gradient_checkpointing_enable", None)
    try:
        if enable is not None:  # transformers >= 5.24
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                legacy(gradient_checkpointing_kwargs=kwargs)
    except (AttributeError, ValueError) as exc:
        raise WrapError(
            f"{type(model).__name__} does not support activation checkpointing ({exc}); run "
            "without --gradient-checkpointing"
        ) from exc
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(
        1
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True
    )
