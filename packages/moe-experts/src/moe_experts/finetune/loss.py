"""The token-summed loss of a batch: chunked over the LM head, or from the model's full logits.

``--loss chunked`` (the default) runs the model with its ``lm_head`` taken out for the call,
so the forward returns the last hidden state ``[B, L, H]`` instead of fp32-bound ``[B, L, V]``
logits, and :func:`moe_experts.chunked_lm_cross_entropy` computes the loss and its gradients
from the hidden state and the head weight a chunk of rows at a time. The head is taken out of
the *root* module's forward (not bypassed by calling the decoder alone) so that FSDP2's root
hooks still gather the embedding, final norm and head; FSDP2 keeps the root's parameters
gathered after its forward, so the head weight read afterwards is the full one.

Only a head that is exactly ``hidden @ W.T`` can be replaced: an ``nn.Linear`` without bias,
or a ``lora_core.LoRALinear`` around one (its adapted weight ``W + scaling * B @ A``, so the
LoRA factors still get their gradients) whose dropout is off. Families that change the logits
after the head (soft-capping, a logit scale) and any other head use the full logits, as
:func:`full_logits_reason` says.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from moe_experts.finetune.data import IGNORE_INDEX, Batch

__all__ = ["final_hidden", "full_logits_reason", "head_weight", "on_model_device", "token_loss_sum"]

# Config fields of families whose logits are not plain ``lm_head(hidden)`` (Gemma's
# soft-capping, Cohere's logit_scale, Granite's logits_scaling); 1.0 or None leaves them so.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class _Passthrough(nn.Module):
    """Stands in for ``lm_head`` during the forward: the "logits" are the hidden states."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return ``hidden`` ``[..., H]`` unchanged."""
        return hidden


def _configs(model: nn.Module) -> list[object]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def full_logits_reason(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be chunked over its head, or None when it can.

    Args:
        model: a Hugging Face causal LM (possibly LoRA-adapted, possibly FSDP-sharded).

    Returns:
        A short reason (for a log line), or None when ``lm_head(h) == h @ W.T`` exactly.
    """
    from lora_core import LoRALinear

    for config in _configs(model):
        for name in _LOGIT_TRANSFORMS:
            value = getattr(config, name, None)
            if value is not None and value != 1.0:
                return f"the model's config sets {name}={value} (the logits are transformed)"
    head = getattr(model, "lm_head", None)
    if isinstance(head, LoRALinear):
        if head.training and not isinstance(head.dropout, nn.Identity):
            return "lm_head's LoRA has dropout (it cannot be folded into one weight)"
        head = head.base_layer
    if type(head) is not nn.Linear:
        return f"lm_head is {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "lm_head has a bias"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def head_weight(head: nn.Module) -> torch.Tensor:
    """The ``[V, H]`` weight with ``head(h) == h @ weight.T`` (differentiable in LoRA factors).

    Args:
        head: the model's ``lm_head``, accepted by :func:`full_logits_reason`.

    Returns:
        ``head.weight``, or for a ``LoRALinear`` ``W + scaling * B @ A`` in ``W``'s dtype
        (``W`` alone while its adapter is merged or switched off).
    """
    from lora_core import LoRALinear

    if not isinstance(head, LoRALinear):
        return _local(cast("torch.Tensor", head.weight))
    w = _local(head.base_layer.weight)
    if not head.adds_update:  # merged into W, or switched off (adapters_disabled)
        return w
    a, b = _local(head.lora_A.weight), _local(head.lora_B.weight)
    return w + ((b @ a) * head.scaling).to(w.dtype)


def on_model_device(model: nn.Module, batch: Batch) -> Batch:
    """``batch`` on the device of the model's input embedding (a GPU for ``--device cuda``)."""
    getter: Any = getattr(model, "get_input_embeddings", None)
    embed = getter() if callable(getter) else None
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device == batch.input_ids.device:
        return batch
    device = _local(weight).device
    return Batch(batch.input_ids.to(device), batch.labels.to(device), batch.position_ids.to(device))


@contextmanager
def _without_head(model: nn.Module) -> Iterator[nn.Module]:
    head = cast(nn.Module, model.lm_head)
    model.lm_head = _Passthrough()
    try:
        yield head
    finally:
        model.lm_head = head


def final_hidden(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The last hidden states ``[B, L, H]`` of ``batch`` and the ``[V, H]`` head weight.

    For a model that :func:`full_logits_reason` accepts: the head is taken out of the forward
    (no ``[B, L, V]`` logits) and its weight read afterwards (FSDP2 has gathered it by then).
    """
    with _without_head(model) as head:
        hidden = model(**batch.model_inputs(model)).logits
    return hidden, head_weight(head)


def token_loss_sum(model: nn.Module, batch: Batch, mode: str = "chunked") -> torch.Tensor:
    """Summed cross-entropy over the batch's target tokens (a 0-d float32 tensor).

    Summing, and dividing once by the step's target count, makes accumulation and sharding
    across ranks give the same loss and gradients as one big batch.

    Args:
        model: the causal LM.
        batch: ``[B, L]`` inputs and aligned labels (``-100``: no target).
        mode: ``"chunked"`` (when :func:`full_logits_reason` allows it) or ``"full"``.

    Returns:
        The fp32 sum of the per-token losses; both modes agree to fp32 rounding.

    Raises:
        ValueError: ``mode`` is neither ``"chunked"`` nor ``"full"``.
    """
    if mode not in ("chunked", "full"):
        raise ValueError(f"loss mode {mode!r}: expected 'chunked' or 'full'")
    batch = on_model_device(model, batch)
    if mode == "chunked" and full_logits_reason(model) is None:
        from moe_experts.losses import chunked_lm_cross_entropy

        hidden, weight = final_hidden(model, batch)
        # num_targets=1: the sum, not the mean (the loop divides by the step's count).
        return chunked_lm_cross_entropy(
            hidden, weight, batch.labels, num_targets=1, ignore_index=IGNORE_INDEX
        )
    logits = model(**batch.model_inputs(model)).logits
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        batch.labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
