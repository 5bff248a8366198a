"""TRL as the oracle: one DPO/ORPO step of TRL's own trainers on a transformers + PEFT twin.

The twin is the same checkpoint loaded by ``from_pretrained`` with a PEFT adapter that holds
our LoRA values (``target_modules`` for attention, ``target_parameters`` for routers and the
fused experts). TRL builds its own batch from the raw records (its tokenisation, padding and
completion masks), and :func:`trl_step` returns its loss, its logged metrics and the gradient
of every adapter parameter after one backward.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import peft
import torch
from transformers import AutoModelForCausalLM

from lora_core.contracts import AdaptationResult, PeftTensorLayout
from moe_experts import peft_mapping


def peft_name(export_key: str, adapter: str = "default") -> str:
    """PEFT's in-memory parameter name for a saved adapter key."""
    return export_key.removesuffix(".weight") + f".{adapter}.weight"


def to_peft(t: torch.Tensor, layout: PeftTensorLayout) -> torch.Tensor:
    """Our ``[E, r, in]`` / ``[E, out, r]`` tensor in PEFT's stacked layout."""
    if layout is PeftTensorLayout.EXPERT_STACKED_A:
        return peft_mapping.stack_lora_a(t)
    if layout is PeftTensorLayout.EXPERT_STACKED_B:
        return peft_mapping.stack_lora_b(t)
    return t


def _base(model_dir: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _peft_config(result: AdaptationResult) -> Any:
    cfg = result.lora_config
    assert cfg is not None
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=list(result.peft_target_modules),
        target_parameters=list(result.peft_target_parameters),
    )


def copy_ours(pm: Any, result: AdaptationResult) -> dict[str, torch.nn.Parameter]:
    """Copy our LoRA values into PEFT model ``pm``; returns ``our fqn -> PEFT Parameter``."""
    named = dict(pm.named_parameters())
    pairs = {}
    with torch.no_grad():
        for fqn, p in result.named_optimizer_parameters:
            export = result.peft_exports[fqn]
            q = named[peft_name(export.key)]
            q.copy_(to_peft(p.detach(), export.layout))
            pairs[fqn] = q
    return pairs


def our_grads_in_peft_layout(result: AdaptationResult) -> dict[str, torch.Tensor]:
    """Every adapter gradient of ours, keyed by our name, in PEFT's layout."""
    out = {}
    for fqn, p in result.named_optimizer_parameters:
        assert p.grad is not None, fqn
        out[fqn] = to_peft(p.grad, result.peft_exports[fqn].layout)
    return out


def trl_step(
    model_dir: Path,
    result: AdaptationResult,
    tokenizer: Any,
    records: list[dict[str, Any]],
    out: Path,
    *,
    method: str = "dpo",
    **config: Any,
) -> tuple[float, dict[str, float], dict[str, torch.nn.Parameter]]:
    """One forward/backward of TRL's DPOTrainer (or ORPOTrainer) over all ``records``.

    TRL gets the base model and a PEFT config, so it creates a *new* adapter and takes the
    adapter-free model as DPO's reference (given a PEFT model instead, TRL would take the
    adapter's initial values as the reference); our LoRA values are then copied into it.
    The records form one batch (order does not matter: every loss is a mean over pairs, and
    ORPO's NLL a mean over the batch's tokens).

    Returns:
        ``(loss, metrics, our fqn -> PEFT Parameter)``: TRL's loss, its metrics (TRL's names)
        and the adapter parameters, whose ``.grad`` holds the gradient.
    """
    from datasets import Dataset

    common: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": len(records),
        "report_to": [],
        "use_cpu": True,
        "max_length": None if method == "dpo" else 4096,
        "logging_steps": 1,
    }
    if method == "dpo":
        # No MoE load-balancing term: ours trains the preference loss alone (as SFT does).
        common["router_aux_loss_coef"] = 0.0
    data = Dataset.from_list(records)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "dpo":
            from trl import DPOConfig, DPOTrainer

            trainer: Any = DPOTrainer(
                model=_base(model_dir),
                args=DPOConfig(**common, **config),
                train_dataset=data,
                processing_class=tokenizer,
                peft_config=_peft_config(result),
            )
        else:
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            trainer = ORPOTrainer(
                model=_base(model_dir),
                args=ORPOConfig(**common, **config),
                train_dataset=data,
                processing_class=tokenizer,
                peft_config=_peft_config(result),
            )
    model = trainer.model
    pairs = copy_ours(model, result)
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    if method == "dpo":
        metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    else:
        metrics = {k: float(v[-1]) for k, v in trainer._stored_metrics["train"].items()}
    return float(loss.detach()), metrics, pairs
