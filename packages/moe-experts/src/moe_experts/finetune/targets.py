"""The default LoRA targets, resolved against the model being fine-tuned.

Families differ in where they keep the router (``mlp.gate``, ``mlp.router``, Gemma-4's
``router.proj``, ...) and in what their attention projections are called (``q_proj`` ...
``o_proj``, DeepSeek's MLA ``q_a_proj``/``kv_a_proj_with_mqa``, DeepSeek-V4's ``kv_proj`` and
``o_b_proj``, LFM2's ``out_proj``). So the run's default ``lora`` lists name the word
:data:`AUTO` instead of module names, and :func:`resolve_targets` replaces it once the model is
known:

- in ``target_parameters``, ``auto`` becomes :func:`moe_experts.router_targets` (every router);
- in ``target_modules``, ``auto`` becomes the attention projections (:func:`attention_targets`).

Entries the user writes are kept as written, so a target that matches nothing is still the
clear ``LoraTargetError`` of lora-core.

Shared experts (and DeepSeek's leading dense MLP layers) get no LoRA by default, although
PEFT's ``all-linear`` and LLaMA-Factory's ``lora_target: all`` would adapt them: for every
family whose checkpoints transformers converts from per-expert to fused experts (DeepSeek,
Qwen2/3-MoE, GLM-4.5, dots1, ERNIE, HunYuan, ...), PEFT's loader rewrites any
``target_modules`` entry ending in ``gate_proj``/``up_proj``/``down_proj`` into the fused
experts' parameters and doubles their rank, so such an adapter fails
``PeftModel.from_pretrained`` (size mismatch on ``mlp.experts.base_layer.lora_A``), and with
it ``generate`` and ``export``. :func:`check_peft_loadable` refuses those entries by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from moe_experts.finetune.config import FinetuneArgs
from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "AUTO",
    "attention_targets",
    "check_peft_loadable",
    "model_skeleton",
    "needs_model",
    "resolve_targets",
]

AUTO = "auto"
# The projections most LoRA recipes train; kept as the targets wherever an attention module has
# all four, so the families that worked before resolve to exactly what they had (hybrid
# MiniMax keeps its lightning-attention layers unadapted, as before).
_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# transformers names a decoder layer's softmax attention ``self_attn`` in every MoE family;
# hybrid layers (linear attention, short convolutions) are left alone.
_ATTENTION_ATTR = "self_attn"


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer: the children of the ModuleList that holds the MoE blocks."""
    from moe_experts import find_architecture
    from moe_experts.architectures import iter_moe_blocks

    containers: dict[str, None] = {}
    for site in iter_moe_blocks(model, find_architecture(model)):
        parent, _, leaf = site.name.rpartition(".")
        layer = site.name if leaf.isdigit() else parent  # Gemma-4: the block is the layer
        containers[layer.rpartition(".")[0]] = None
    return [layer for name in containers for layer in model.get_submodule(name).children()]


def attention_targets(model: nn.Module) -> tuple[str, ...]:
    """The ``target_modules`` entries selecting the attention projections of ``model``.

    Rule: the plain ``nn.Linear`` modules that are direct children of a decoder layer's
    ``self_attn``. Sub-modules of the attention (DeepSeek-V3.2/V4 indexers and compressors,
    whose top-k selection passes no gradient) and ``nn.Linear`` subclasses with their own
    forward (DeepSeek-V4's grouped ``o_a_proj``) are left out. Where an attention module has
    ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``, those four are the answer. A leaf
    name that also names a Linear elsewhere is written ``self_attn.<leaf>``.

    Args:
        model: a supported transformers MoE model (on any device, ``meta`` included).

    Returns:
        Target suffixes in the attention's own order; empty if no layer has ``self_attn``.
    """
    attentions = [
        getattr(layer, _ATTENTION_ATTR)
        for layer in _decoder_layers(model)
        if isinstance(getattr(layer, _ATTENTION_ATTR, None), nn.Module)
    ]
    chosen: set[int] = set()
    leaves: dict[str, None] = {}
    has_qkvo = False
    for attn in attentions:
        linear = {n: m for n, m in attn.named_children() if type(m) is nn.Linear}
        has_qkvo |= all(n in linear for n in _QKVO)
        for n, m in linear.items():
            chosen.add(id(m))
            leaves[n] = None
    if has_qkvo:
        return _QKVO
    outside = {
        name.rpartition(".")[2]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) not in chosen
    }
    return tuple(f"{_ATTENTION_ATTR}.{n}" if n in outside else n for n in leaves)


def _expand(entries: Any, auto: tuple[str, ...]) -> Any:
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, (list, tuple)) or AUTO not in entries:
        return entries
    out: list[Any] = []
    for entry in entries:
        for item in auto if entry == AUTO else (entry,):
            if item not in out:
                out.append(item)
    return out


def _has_auto(value: Any) -> bool:
    return value == AUTO or (isinstance(value, (list, tuple)) and AUTO in value)


def needs_model(args: FinetuneArgs) -> bool:
    """Whether ``args.lora`` names :data:`AUTO` anywhere (so the model must be known)."""
    return any(_has_auto(args.lora.get(k)) for k in ("target_modules", "target_parameters"))


def check_peft_loadable(lora: dict[str, Any], model: nn.Module) -> None:
    """Refuse ``target_modules`` entries that PEFT would load as this family's fused experts.

    Asks the installed PEFT: its transformers-v5 MoE conversion maps ``model_type`` to a table
    of module names (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral's ``w1``/``w2``/``w3``;
    ``gate``) that it re-reads as expert parameters, whatever path precedes them.

    Raises:
        FinetuneError: names the entry, the parameter PEFT would read it as, and the fix.
    """
    modules = lora.get("target_modules")
    if not isinstance(modules, (list, tuple)):
        return
    try:
        from peft.utils.transformers_weight_conversion import (  # type: ignore[attr-defined]
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:  # no PEFT, or one without this conversion: nothing is rewritten
        return
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    rewritten = _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {})
    for entry in modules:
        leaf = str(entry).rpartition(".")[2]
        if leaf in rewritten:
            raise FinetuneError(
                f"lora.target_modules {entry!r}: for {model_type} models PEFT loads a "
                f"target_modules entry ending in {leaf!r} as the fused experts' "
                f"{rewritten[leaf]!r} (its transformers-v5 MoE conversion), so "
                "PeftModel.from_pretrained, generate and export could not load this adapter; "
                f"remove {entry!r} (the routed experts get LoRA through target_parameters; "
                "dense and shared-expert MLP projections cannot be adapted loadably for this "
                "family)"
            )


def resolve_targets(args: FinetuneArgs, model: nn.Module) -> FinetuneArgs:
    """``args`` with every :data:`AUTO` in the ``lora`` target lists replaced for ``model``.

    Raises:
        FinetuneError: ``auto`` asked for attention targets and the model has none (name the
            modules to adapt in ``lora.target_modules``), or an entry PEFT would load as the
            fused experts (:func:`check_peft_loadable`).
    """
    check_peft_loadable(args.lora, model)
    if not needs_model(args):
        return args
    from moe_experts import UnsupportedModelError, router_targets

    lora = dict(args.lora)
    modules = lora.get("target_modules", ())
    try:
        routers = router_targets(model)
        auto_modules = _has_auto(modules)
        attention = attention_targets(model) if auto_modules else ()
    except UnsupportedModelError as exc:
        raise FinetuneError(f"--model {args.model}: {exc}") from exc
    lora["target_parameters"] = _expand(lora.get("target_parameters", ()), routers)
    if auto_modules:
        if not attention:
            raise FinetuneError(
                f"lora.target_modules 'auto': {type(model).__name__} has no decoder layer with a "
                "'self_attn' module to take the attention projections from; list the modules "
                "to adapt in lora.target_modules"
            )
        lora["target_modules"] = _expand(modules, attention)
    return replace(args, lora=lora)


def model_skeleton(name: str) -> nn.Module:
    """The model ``--model name`` loads, built on the ``meta`` device (no weights read).

    Raises:
        FinetuneError: no such built-in model or local directory, or transformers cannot
            build it.
    """
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_experts.finetune.models import BUILTIN_MODELS

    try:
        if name in BUILTIN_MODELS:
            spec = dict(BUILTIN_MODELS[name])
            config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        else:
            if not (Path(name) / "config.json").is_file():
                raise FinetuneError(
                    f"--model {name}: not a built-in model ({', '.join(BUILTIN_MODELS)}) and not "
                    "a local Hugging Face model directory (no config.json there)"
                )
            config = AutoConfig.from_pretrained(name)
        with torch.device("meta"):
            # transformers: _BaseAutoModelClass.from_config is unannotated
            return AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call, no-any-return]
    except (OSError, ValueError, KeyError) as exc:
        raise FinetuneError(f"--model {name}: transformers could not load it: {exc}") from exc
