"""Put :class:`LoRALinear` on the targeted ``nn.Linear`` modules of a model, and
:class:`LoRAParameter` on the targeted 2-D parameters of other modules (MoE routers).

Matching rule (shared by ``target_modules`` and ``exclude_modules``): a target matches a
module when the target's dot-separated components equal the *trailing whole components* of
the module's fully-qualified name. ``o_proj`` matches ``model.layers.0.self_attn.o_proj``
but never ``model.layers.0.foo_proj``; ``self_attn.q_proj`` matches
``model.layers.0.self_attn.q_proj`` but not ``model.layers.0.cross_attn.q_proj``. Excludes
are applied after targets. Only ``nn.Linear`` modules are replaced through
``target_modules``; ``target_parameters`` matches parameter names by the same rule.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn

from lora_core.config import LoraConfig
from lora_core.contracts import (
    AdaptationResult,
    ComponentVersion,
    ContractError,
    ParameterOwnership,
    PeftExport,
)
from lora_core.layers import LoRALinear, LoRAParameter, _LoRAFactors

__all__ = [
    "LoraTargetError",
    "enable_lora_training",
    "matches_module",
    "rebind_parameters",
    "remap_checkpoint_keys",
]

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."


class LoraTargetError(ValueError):
    """The targets selected nothing, or something that cannot be adapted."""


def matches_module(name: str, patterns: Iterable[str]) -> bool:
    """Whether any pattern equals the trailing whole dotted components of ``name``.

    Args:
        name: fully-qualified module name, e.g. ``"model.layers.0.self_attn.q_proj"``.
        patterns: module names or dotted suffixes, e.g. ``["q_proj", "self_attn.o_proj"]``.

    Returns:
        True if some pattern matches; ``"o_proj"`` does not match ``"x.foo_proj"``.
    """
    parts = name.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        if len(want) <= len(parts) and parts[len(parts) - len(want) :] == want:
            return True
    return False


def _empty_result(config: LoraConfig | None) -> AdaptationResult:
    return AdaptationResult.create(
        adapted_layers=(),
        named_optimizer_parameters=(),
        ownership={},
        producer=ComponentVersion.of("lora-core"),
        lora_config=config,
    )


def _inside(name: str, adapters: set[str]) -> bool:
    """Whether ``name`` is a strict descendant of one of the ``adapters`` modules."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in adapters for i in range(1, len(parts)))


def _claim(seen: dict[int, str], module: nn.Module, name: str) -> None:
    """Record that ``name`` adapts ``module``; refuse a module reachable under two names."""
    if id(module) in seen:
        raise LoraTargetError(
            f"module {name!r} is the same object as {seen[id(module)]!r} (a shared or tied "
            "module); adapting one name would leave the other unadapted. Exclude one of them "
            "with lora.exclude_modules or untie them"
        )
    seen[id(module)] = name


def _select(
    model: nn.Module, config: LoraConfig, adapters: set[str]
) -> tuple[list[tuple[str, nn.Linear | LoRALinear]], list[str]]:
    """Matched ``(name, module)`` in module order, and every Linear name (for errors).

    ``adapters`` names the model's existing adapter modules, whose insides are never targets.
    """
    seen: dict[int, str] = {}
    chosen: list[tuple[str, nn.Linear | LoRALinear]] = []
    linear_names: list[str] = []
    excluded: list[str] = []
    # remove_duplicate=False: a Linear reachable under two names cannot be wrapped for both.
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or _inside(name, adapters):
            continue
        if not isinstance(module, nn.Linear | LoRALinear):
            continue
        if isinstance(module, nn.Linear):
            linear_names.append(name)
        if not matches_module(name, config.target_modules):
            continue
        if matches_module(name, config.exclude_modules):
            excluded.append(name)
            continue
        _claim(seen, module, name)
        chosen.append((name, module))
    # Default attention targets may legitimately match nothing when only parameters (routers)
    # are targeted; targets the user wrote must match.
    if not chosen and ("target_modules" in config.model_fields_set or not config.target_parameters):
        sample = linear_names[:12]
        more = f" (and {len(linear_names) - len(sample)} more)" if len(linear_names) > 12 else ""
        why = (
            f"; {len(excluded)} matched but all were removed by lora.exclude_modules "
            f"{list(config.exclude_modules)}: {excluded[:6]}"
            if excluded
            else ""
        )
        raise LoraTargetError(
            f"lora.target_modules {list(config.target_modules)} matched no nn.Linear module of "
            f"{type(model).__name__}{why}. Linear modules that exist: {sample}{more}. "
            "A target matches whole trailing components of a module name (e.g. 'q_proj' or "
            "'self_attn.q_proj'), never a substring"
        )
    return chosen, linear_names


def _adapter_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, _LoRAFactors)}


def _select_parameters(
    model: nn.Module, config: LoraConfig, adapters: set[str], linear_targets: set[str]
) -> list[tuple[str, nn.Module, str, list[str]]]:
    """Matched ``(module name, owner, parameter name, matching patterns)`` in module order.

    An owner that is already a :class:`LoRAParameter` is matched by the name of the
    parameter it adapts, so a repeated call finds it instead of wrapping it again.
    """
    if not config.target_parameters:
        return []
    chosen: list[tuple[str, nn.Module, str, list[str]]] = []
    seen: dict[int, str] = {}
    candidates: list[str] = []
    excluded: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if _inside(name, adapters) or isinstance(module, LoRALinear):
            continue
        if isinstance(module, LoRAParameter):
            params: list[tuple[str, torch.Tensor]] = [(module.parameter_name, module.base_weight)]
        else:
            params = [(k, v) for k, v in module._parameters.items() if v is not None]
        hits: list[tuple[str, list[str]]] = []
        for param_name, param in params:
            fqn = f"{name}.{param_name}" if name else param_name
            candidates.append(fqn)
            patterns = [t for t in config.target_parameters if matches_module(fqn, [t])]
            if not patterns:
                continue
            if matches_module(name, config.exclude_modules):
                excluded.append(fqn)
                continue
            if not name:
                raise LoraTargetError(
                    f"lora.target_parameters matched {fqn!r}, a parameter of the root module "
                    f"{type(model).__name__}, which cannot be wrapped; target a submodule's "
                    "parameter"
                )
            if param.dim() != 2:
                raise LoraTargetError(
                    f"lora.target_parameters {patterns} matched {fqn!r} of shape "
                    f"{list(param.shape)}; only 2-D [out, in] weights take a LoRA update "
                    "(MoE expert banks get theirs from moe_experts.adapt)"
                )
            if name in linear_targets:
                raise LoraTargetError(
                    f"{name!r} is matched by lora.target_modules and its parameter {fqn!r} by "
                    "lora.target_parameters; adapt it one way only"
                )
            hits.append((param_name, patterns))
        if not hits:
            continue
        if len(hits) > 1:
            raise LoraTargetError(
                f"lora.target_parameters matched {len(hits)} parameters of {name!r} "
                f"({[h for h, _ in hits]}); one LoRA update per module is supported"
            )
        _claim(seen, module, name)
        chosen.append((name, module, *hits[0]))
    if not chosen:
        why = (
            f"; {len(excluded)} matched but lora.exclude_modules removed them: {excluded[:6]}"
            if excluded
            else ""
        )
        more = f" (and {len(candidates) - 12} more)" if len(candidates) > 12 else ""
        raise LoraTargetError(
            f"lora.target_parameters {list(config.target_parameters)} matched no parameter "
            f"of {type(model).__name__}{why}. Parameters that exist: {candidates[:12]}{more}. "
            "A target matches whole trailing components of a parameter name (e.g. "
            "'mlp.gate.weight'), never a substring"
        )
    return chosen


def enable_lora_training(
    model: nn.Module, config: LoraConfig | None, *, prepare_for_fsdp: bool = False
) -> AdaptationResult:
    """Wrap the targeted ``nn.Linear`` modules in :class:`LoRALinear`, the modules owning the
    targeted 2-D parameters in :class:`LoRAParameter`, and freeze the rest.

    Matching: a target (or exclude) matches a module when it equals the trailing whole
    dotted components of the module's name (``o_proj`` matches ``a.o_proj``, not
    ``a.foo_proj``; ``self_attn.q_proj`` is a dotted suffix). ``target_parameters`` match
    parameter names by the same rule (``mlp.gate.weight``: every MoE router). Excludes apply
    after targets, to module names. Layers that are already adapted are left as they are and
    reported in ``already_adapted_layers`` (a repeated call never double-wraps).

    Every parameter of ``model`` is frozen except the ``lora_A``/``lora_B`` weights of the
    matched layers (LoRA-only training), so call this *before* other adapter producers
    (e.g. ``moe_experts.adapt``) that set their own trainable parameters.

    Adapter values are ``init_lora_tensor(f"{fqn}.lora_A"/"lora_B", ..., seed=init_seed)``,
    so they never depend on module-creation order. With ``prepare_for_fsdp=True`` no values
    are built: ``lora_A``/``lora_B`` are created on the meta device (the model may itself be
    on meta), and ``result.missing_parameter_initializer(model)`` fills them after the model
    is materialised (``to_empty``) and the base checkpoint is loaded with
    :func:`remap_checkpoint_keys`; the result is bitwise equal to the eager path.

    Args:
        model: the model to adapt in place.
        config: the LoRA config; ``None`` or ``enable=False`` adapts nothing and returns an
            empty result.
        prepare_for_fsdp: build adapters on the meta device for the FSDP2 loader path.

    Returns:
        An :class:`AdaptationResult` covering every matched layer: ``<fqn>.lora_A.weight`` and
        ``<fqn>.lora_B.weight`` per layer (Linear layers in module order, then parameter
        adapters in module order), all ``REPLICATED``; checkpoint key aliases
        ``<fqn>.<key> -> <fqn>.base_layer.<key>`` for every state-dict key of a wrapped
        module; PEFT export keys ``base_model.model.<fqn>.lora_A.weight``; sorted unique
        Linear leaf names as ``peft_target_modules`` (a leaf that also names another module or
        parameter is qualified with its parents, e.g. ``shared_experts.down_proj``) and the
        matching ``target_parameters`` patterns as ``peft_target_parameters``.

    Raises:
        TypeError: if ``config`` is not a :class:`LoraConfig`.
        LoraTargetError: if targets matched nothing (names the targets and what exists), a
            matched module is shared under two names, a matched parameter is not 2-D, or a
            module is targeted both as a module and through its parameter.
        ValueError: if the model is on the meta device and ``prepare_for_fsdp`` is False.
    """
    if config is None or (isinstance(config, LoraConfig) and not config.enable):
        logger.info("LoRA is not enabled (config=%s): no LoRA applied", config)
        return _empty_result(config)
    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"enable_lora_training config must be a lora_core.LoraConfig, got "
            f"{type(config).__name__}; build it with LoraConfig.model_validate(...)"
        )
    if config.rank is None or config.alpha is None:  # unreachable for a validated config
        raise ValueError("lora.rank must be set when lora.enable is true")
    adapters = _adapter_names(model)
    chosen, _ = _select(model, config, adapters) if config.target_modules else ([], [])
    chosen_params = _select_parameters(model, config, adapters, {n for n, _ in chosen})
    adapted: list[str] = []
    repeated: list[str] = []
    layers: list[tuple[str, _LoRAFactors]] = []
    device = "meta" if prepare_for_fsdp else None
    # param_name None: a Linear from target_modules; else a parameter from target_parameters.
    todo: list[tuple[str, nn.Module, str | None]] = [(n, m, None) for n, m in chosen]
    todo += [(n, owner, param) for n, owner, param, _ in chosen_params]
    for name, module, param_name in todo:
        if isinstance(module, _LoRAFactors):
            repeated.append(name)
            layers.append((name, module))
            continue
        weight_name = param_name or "weight"
        weight = module._parameters[weight_name]
        if weight is not None and weight.is_meta and not prepare_for_fsdp:
            raise ValueError(
                f"{name}.{weight_name} is on the meta device, so adapter values cannot be built "
                "eagerly; pass prepare_for_fsdp=True and call "
                "result.missing_parameter_initializer(model) after materialising the model"
            )
        common: dict[str, Any] = {"fqn": name, "init_seed": config.init_seed, "device": device}
        wrapped: _LoRAFactors = (
            # _select yields only nn.Linear here: the LoRALinear it matches went to `repeated`.
            LoRALinear(cast(nn.Linear, module), config.rank, config.alpha, config.dropout, **common)
            if param_name is None
            else LoRAParameter(module, param_name, config.rank, config.alpha, **common)
        )
        parent_name, _, leaf = name.rpartition(".")
        model.get_submodule(parent_name).register_module(leaf, wrapped)
        adapted.append(name)
        layers.append((name, wrapped))
    matched_patterns = [t for *_, patterns in chosen_params for t in patterns]
    if repeated:
        logger.info(
            "%d layer(s) already carry LoRA and were left as they were: %s",
            len(repeated),
            repeated[:8],
        )

    for p in model.parameters():
        p.requires_grad_(False)
    named: list[tuple[str, nn.Parameter]] = []
    aliases: dict[str, str] = {}
    exports: dict[str, PeftExport] = {}
    for name, layer in layers:
        for leaf in ("lora_A", "lora_B"):
            p = getattr(layer, leaf).weight
            p.requires_grad_(True)
            key = f"{name}.{leaf}.weight"
            named.append((key, p))
            exports[key] = PeftExport(key=_PEFT_PREFIX + key)
        # Every state-dict key of the wrapped module moves under base_layer (a router's
        # buffers such as DeepSeek's e_score_correction_bias included).
        for key in layer.base_layer.state_dict(keep_vars=True):
            aliases[f"{name}.{key}"] = f"{name}.base_layer.{key}"
    logger.info(
        "LoRA r=%s alpha=%s on %d layer(s) (%d new)",
        config.rank,
        config.alpha,
        len(layers),
        len(adapted),
    )

    initializer = None
    if prepare_for_fsdp:
        initializer = _Initializer(tuple(name for name, _ in layers))
    return AdaptationResult.create(
        adapted_layers=adapted,
        already_adapted_layers=repeated,
        named_optimizer_parameters=named,
        ownership=dict.fromkeys((k for k, _ in named), ParameterOwnership.REPLICATED),
        producer=ComponentVersion.of("lora-core"),
        lora_config=config,
        checkpoint_key_aliases=aliases,
        peft_exports=exports,
        peft_target_modules=_peft_target_modules(
            model, [name for name, m in layers if isinstance(m, LoRALinear)]
        ),
        peft_target_parameters=sorted(set(matched_patterns)),
        missing_parameter_initializer=initializer,
    )


def _peft_target_modules(model: nn.Module, linear_names: list[str]) -> list[str]:
    """The shortest suffix of each adapted Linear that PEFT matches to adapted layers only.

    PEFT adapts every module whose name ends with a ``target_modules`` entry, and re-reads
    bare ``gate_proj``/``up_proj``/``down_proj`` entries as the fused expert parameters of
    transformers 5 MoE models. So a leaf name is written bare only when no other module or
    parameter of the model ends with it; otherwise it is qualified with its parents
    (``shared_experts.down_proj``) until it is unambiguous.
    """
    adapted = set(linear_names)
    inside = tuple(f"{n}." for n in linear_names)
    others: dict[str, list[str]] = {}  # leaf -> names of other modules/parameters with it
    for name in (*(n for n, _ in model.named_modules()), *(n for n, _ in model.named_parameters())):
        if name and name not in adapted and not name.startswith(inside):
            others.setdefault(name.rpartition(".")[2], []).append(name)
    out: set[str] = set()
    for name in linear_names:
        parts = name.split(".")
        clashes = others.get(parts[-1], [])
        depth = 1
        while depth < len(parts):
            suffix = ".".join(parts[-depth:])
            clashes = [c for c in clashes if c == suffix or c.endswith("." + suffix)]
            if not clashes:
                break
            depth += 1
        out.add(".".join(parts[-depth:]))
    return sorted(out)


class _Initializer:
    """``missing_parameter_initializer``: fills every adapter of the named layers."""

    def __init__(self, layer_names: tuple[str, ...]) -> None:
        self.layer_names = layer_names

    def __call__(self, model: nn.Module) -> int:
        """Fill ``lora_A``/``lora_B`` of each layer in ``model``; return how many tensors."""
        filled = 0
        for name in self.layer_names:
            try:
                layer = model.get_submodule(name)
            except AttributeError as exc:
                raise ContractError(
                    f"missing_parameter_initializer: model has no module {name!r}; pass the "
                    "same model (or its FSDP-wrapped self) that enable_lora_training adapted"
                ) from exc
            if not isinstance(layer, _LoRAFactors):
                raise ContractError(
                    f"missing_parameter_initializer: {name!r} is a {type(layer).__name__}, "
                    "expected a LoRALinear or LoRAParameter"
                )
            filled += layer.reset_lora_parameters()
        return filled

    def __repr__(self) -> str:
        return f"lora_core missing_parameter_initializer({len(self.layer_names)} layers)"


def remap_checkpoint_keys(
    state_dict: Mapping[str, Any], result: AdaptationResult
) -> dict[str, Any]:
    """Rename base-checkpoint keys to the adapted module tree via ``checkpoint_key_aliases``.

    ``x.weight`` becomes ``x.base_layer.weight`` for every adapted ``x``; other keys pass
    unchanged, in their original order. Load the result with
    ``model.load_state_dict(remapped, strict=False)`` (the adapter keys are the missing ones)
    and then call ``result.missing_parameter_initializer``.

    Args:
        state_dict: base checkpoint, e.g. from ``safetensors.torch.load_file``.
        result: the :class:`AdaptationResult` of the adaptation.

    Returns:
        A new dict with the remapped keys (values are the same objects).

    Raises:
        ContractError: if a key and its alias target are both present (ambiguous).
    """
    aliases = result.checkpoint_key_aliases
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        new = aliases.get(key, key)
        if new in out or (new != key and new in state_dict):
            raise ContractError(
                f"state_dict has both {key!r} and {new!r}; it is already partly in the adapted "
                "layout, so remapping is ambiguous. Pass the base checkpoint unchanged"
            )
        out[new] = value
    return out


def rebind_parameters(result: AdaptationResult, model: nn.Module) -> AdaptationResult:
    """Return ``result`` with its optimizer parameters re-read from ``model`` by name.

    ``model.to_empty(...)`` (meta -> real device), ``fully_shard`` and
    ``load_state_dict(assign=True)`` replace ``Parameter`` objects, which leaves the
    tensors held by an earlier result stale. Call this after such a step and build the
    optimizer from the returned value. Every other field is kept.

    Args:
        result: the result whose ``named_optimizer_parameters`` name parameters of ``model``.
        model: the (materialised, possibly FSDP-wrapped) model.

    Returns:
        A new :class:`AdaptationResult` pointing at ``model``'s current parameters.

    Raises:
        ContractError: if a name is not a parameter of ``model`` or its shape changed.
    """
    fresh: list[tuple[str, nn.Parameter]] = []
    for name, old in result.named_optimizer_parameters:
        try:
            new = model.get_parameter(name)
        except AttributeError as exc:
            raise ContractError(
                f"rebind_parameters: {type(model).__name__} has no parameter {name!r}; pass "
                "the model the result was produced for"
            ) from exc
        if tuple(new.shape) != tuple(old.shape):
            raise ContractError(
                f"rebind_parameters: {name!r} has shape {list(new.shape)} in the model but "
                f"{list(old.shape)} in the result"
            )
        fresh.append((name, new))
    return dataclasses.replace(result, named_optimizer_parameters=tuple(fresh))
