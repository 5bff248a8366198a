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


def _one_step(
    base: Any,
    peft_config: Any,
    load_values: Any,
    tokenizer: Any,
    records: list[dict[str, Any]],
    out: Path,
    method: str,
    config: dict[str, Any],
) -> tuple[float, dict[str, float], Any]:
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
                model=base,
                args=DPOConfig(**common, **config),
                train_dataset=data,
                processing_class=tokenizer,
                peft_config=peft_config,
            )
        else:
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            trainer = ORPOTrainer(
                model=base,
                args=ORPOConfig(**common, **config),
                train_dataset=data,
                processing_class=tokenizer,
                peft_config=peft_config,
            )
    model = trainer.model
    load_values(model)
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    if method == "dpo":
        metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    else:
        metrics = {k: float(v[-1]) for k, v in trainer._stored_metrics["train"].items()}
    return float(loss.detach()), metrics, model


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
    pairs: dict[str, torch.nn.Parameter] = {}
    loss, metrics, _ = _one_step(
        _base(model_dir),
        _peft_config(result),
        lambda model: pairs.update(copy_ours(model, result)),
        tokenizer,
        records,
        out,
        method,
        config,
    )
    return loss, metrics, pairs


def trl_dpo_from_adapter(
    base: Any,
    peft_config: Any,
    state: dict[str, torch.Tensor],
    tokenizer: Any,
    records: list[dict[str, Any]],
    out: Path,
    **config: Any,
) -> tuple[float, dict[str, float], dict[str, torch.nn.Parameter]]:
    """:func:`trl_step` (DPO) with the adapter values of a saved PEFT adapter ``state``.

    Returns:
        ``(loss, metrics, PEFT parameter name -> Parameter)``.
    """
    from peft import set_peft_model_state_dict

    # A saved adapter_config.json says inference_mode: true; TRL is to train this one.
    peft_config.inference_mode = False

    def load(model: Any) -> None:
        outcome = set_peft_model_state_dict(model, state)
        assert not outcome.unexpected_keys, outcome.unexpected_keys

    loss, metrics, model = _one_step(
        base, peft_config, load, tokenizer, records, out, "dpo", config
    )
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return loss, metrics, named
