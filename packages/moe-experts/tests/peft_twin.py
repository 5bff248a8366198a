"""Build a transformers + PEFT ``target_parameters`` twin carrying the same expert LoRA values."""

from __future__ import annotations

import peft
import torch
from torch import nn

from lora_core.contracts import AdaptationResult, PeftTensorLayout
from moe_experts import peft_mapping


def peft_param_name(export_key: str, adapter: str = "default") -> str:
    """PEFT's in-memory parameter name for a saved adapter key (the adapter name is dropped)."""
    return export_key.removesuffix(".weight") + f".{adapter}.weight"


def to_peft_layout(t: torch.Tensor, layout: PeftTensorLayout) -> torch.Tensor:
    """Our ``[E, r, in]`` / ``[E, out, r]`` tensor in PEFT's stacked layout."""
    if layout is PeftTensorLayout.EXPERT_STACKED_A:
        return peft_mapping.stack_lora_a(t)
    if layout is PeftTensorLayout.EXPERT_STACKED_B:
        return peft_mapping.stack_lora_b(t)
    return t


def peft_twin(
    base: nn.Module, result: AdaptationResult
) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """Apply PEFT to ``base`` with our rank/alpha/targets and copy our LoRA values in.

    Returns:
        The PEFT model and ``our fqn -> PEFT Parameter`` for every exported tensor.
    """
    cfg = result.lora_config
    assert cfg is not None
    pm = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,
            target_modules=[],
            target_parameters=list(result.peft_target_parameters),
        ),
    )
    named = dict(pm.named_parameters())
    pairs = {}
    with torch.no_grad():
        for fqn, p in result.named_optimizer_parameters:
            export = result.peft_exports[fqn]
            q = named[peft_param_name(export.key)]
            q.copy_(to_peft_layout(p, export.layout))
            pairs[fqn] = q
    return pm, pairs
