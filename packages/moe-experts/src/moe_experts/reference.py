"""The reference model of preference training: the same model with every adapter switched off.

:func:`adapters_disabled` composes lora-core's switch (dense ``LoRALinear``, router
``LoRAParameter``) with the one of each :class:`~moe_experts.KernelExperts` (expert LoRA in
kt-kernel buffers or adopted from PEFT, and the extra LoRA experts), plus PEFT's own layers
when the model carries any. Inside it the model computes its frozen base: the kernel runs its
no-LoRA path (no LoRA buffers are passed, so no LoRA product is computed at all), so DPO's
reference log-probabilities need no second copy of the experts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn

from moe_experts.kernel_experts import KernelExperts

__all__ = ["adapters_disabled"]


@contextmanager
def _experts_off(model: nn.Module) -> Iterator[None]:
    experts = [m for m in model.modules() if isinstance(m, KernelExperts)]
    before = [m.adapter_enabled for m in experts]
    for m in experts:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m, state in zip(experts, before, strict=True):
            m.adapter_enabled = state


@contextmanager
def _peft_off(model: nn.Module) -> Iterator[None]:
    """PEFT tuner layers (a model adopted with its PEFT LoRA) off, restored afterwards."""
    if importlib.util.find_spec("peft") is None:
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [bool(m.disable_adapters) for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m, off in zip(layers, before, strict=True):
            m.enable_adapters(not off)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen base: every dense, router, expert and extra-expert LoRA off.

    Expert LoRA is skipped, not zeroed: the kernel is called without LoRA buffers and the
    extra LoRA experts are not run. Everything is switched back on exit, also on an error.

    Args:
        model: a model prepared by :func:`moe_experts.adapt_model` (or wrap/adapt and
            ``lora_core.enable_lora_training``), possibly a PEFT model it adopted.

    Raises:
        lora_core.AdapterStateError: a lora-core adapter is merged into its base weight.
    """
    import lora_core

    with ExitStack() as stack:
        stack.enter_context(lora_core.adapters_disabled(model))
        stack.enter_context(_experts_off(model))
        stack.enter_context(_peft_off(model))
        yield
