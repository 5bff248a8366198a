"""``adapt``: LoRA on every wrapped expert bank, published as one ``AdaptationResult``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

import kt_kernel
from lora_core import LoraConfig, enable_lora_training, init_lora_tensor, matches_module
from lora_core.contracts import (
    AdaptationResult,
    ComponentVersion,
    ParameterOwnership,
    PeftExport,
    PeftTensorLayout,
    peft_lora_key,
)
from moe_experts.architectures import MoEBlockSite, find_architecture, iter_moe_blocks
from moe_experts.attention import use_kernel_attention
from moe_experts.errors import AdaptError
from moe_experts.kernel_experts import KernelExperts
from moe_experts.lora_experts import LoraExperts
from moe_experts.norms import use_kernel_norms
from moe_experts.placeholders import named_placeholders
from moe_experts.wrapping import WeightDType, experts_sites, wrap

__all__ = ["adapt", "adapt_model", "peft_key_prefix", "router_targets"]

LoraLayout = Literal["fused", "split"]
_PEFT_ROOT = "base_model.model."
# Our buffer name -> (projection for init names, PEFT layout, transformers parameter attr).
_FUSED = {
    "gate_up_lora_a": ("gate_up", PeftTensorLayout.EXPERT_STACKED_A, "gate_up_param"),
    "gate_up_lora_b": ("gate_up", PeftTensorLayout.EXPERT_STACKED_B, "gate_up_param"),
    "down_lora_a": ("down", PeftTensorLayout.EXPERT_STACKED_A, "down_param"),
    "down_lora_b": ("down", PeftTensorLayout.EXPERT_STACKED_B, "down_param"),
}


def _component() -> ComponentVersion:
    return ComponentVersion.of("moe-experts")


def _strip_peft_root(name: str) -> str:
    return name.removeprefix(_PEFT_ROOT)


def peft_key_prefix(experts_fqn: str, depth: int) -> str:
    """PEFT's state-dict prefix for the ``depth``-th nested ``ParamWrapper`` of an experts module.

    PEFT wraps the targeted parameters of one module in registration order, each new
    ``ParamWrapper`` around the previous one, so with ``gate_up_proj`` and ``down_proj`` both
    targeted, ``gate_up_proj``'s adapter saves under ``<experts>.base_layer.lora_A.weight`` and
    ``down_proj``'s under ``<experts>.lora_A.weight`` (verified against peft 0.21
    ``save_pretrained``).

    Args:
        experts_fqn: experts module name in the transformers model (no ``base_model.model.``).
        depth: number of ``.base_layer`` hops (0 for the outermost wrapper).

    Returns:
        e.g. ``"base_model.model.model.layers.0.mlp.experts.base_layer"``.
    """
    return _PEFT_ROOT + _strip_peft_root(experts_fqn) + ".base_layer" * depth


def _init_fn(experts_fqn: str, seed: int) -> Callable[[str, torch.Tensor], None]:
    def init(name: str, tensor: torch.Tensor) -> None:
        proj, kind = name.rsplit("_lora_", 1)
        # Names like "model.layers.3.mlp.experts.gate_up.lora_A": stable across ranks/orders.
        full = f"{_strip_peft_root(experts_fqn)}.{proj}.lora_{kind.upper()}"
        tensor.copy_(init_lora_tensor(full, tuple(tensor.shape), tensor.dtype, seed=seed))

    return init


def _targeted(site: MoEBlockSite, config: LoraConfig) -> bool:
    return not matches_module(site.experts_name, config.exclude_modules)


def _own_lora(
    site: MoEBlockSite, kernel: KernelExperts, config: LoraConfig, layout: LoraLayout
) -> tuple[bool, kt_kernel.LoraBuffers]:
    """Create (or find) the kernel LoRA buffers; returns (already_there, buffers)."""
    rank, alpha = int(config.rank or 0), float(config.alpha or config.rank or 1)
    if kernel.lora is not None:
        lora = kernel.lora
        if (lora.rank, lora.alpha, lora.layout) != (rank, alpha, layout):
            raise AdaptError(
                f"{site.experts_name} already has expert LoRA rank={lora.rank} alpha={lora.alpha} "
                f"layout={lora.layout!r}; adapt was called with rank={rank} alpha={alpha} "
                f"layout={layout!r}. Use the same config, or rebuild the model"
            )
        return True, lora
    dtype = getattr(kernel, kernel.gate_up_name).dtype
    lora = kt_kernel.LoraBuffers(
        kernel.spec,
        rank,
        alpha,
        layout,
        dtype=dtype,
        init=_init_fn(site.experts_name, config.init_seed),
    )
    kernel.set_lora(lora)
    return False, lora


def _lora_experts(
    site: MoEBlockSite, kernel: KernelExperts, config: LoraConfig, n: int, width: int | None
) -> LoraExperts | None:
    """Create (or find) the block's extra LoRA experts; ``None`` when ``n == 0``."""
    width = kernel.spec.intermediate_size if width is None else width
    have = kernel.lora_experts
    if have is not None:
        if (have.num_experts, have.intermediate_size) != (n, width):
            raise AdaptError(
                f"{site.experts_name} already has {have.num_experts} LoRA experts of width "
                f"{have.intermediate_size}; adapt was called with lora_experts={n}, "
                f"lora_expert_intermediate={width}. Use the same values, or rebuild the model"
            )
        return have
    if n == 0:
        return None
    dtype = getattr(kernel, kernel.gate_up_name).dtype
    kernel.lora_experts = LoraExperts(
        n,
        kernel.spec.hidden_size,
        width,
        dtype=dtype,
        seed=config.init_seed,
        name=f"{_strip_peft_root(site.experts_name)}.lora_experts",
    )
    return kernel.lora_experts


def _check_lora_expert_args(n: object, width: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AdaptError(f"lora_experts must be an int >= 0 (0: none), got {n!r}")
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise AdaptError(
            f"lora_expert_intermediate must be a positive int (default: the routed experts' "
            f"intermediate size), got {width!r}"
        )


def adapt(
    model: nn.Module,
    config: LoraConfig,
    *,
    layout: LoraLayout = "fused",
    lora_experts: int = 0,
    lora_expert_intermediate: int | None = None,
) -> AdaptationResult:
    """Put LoRA on the gate, up and down projections of every wrapped expert bank.

    ``layout="fused"`` (default) is PEFT ``target_parameters`` on transformers' fused experts:
    one adapter on ``gate_up_proj`` (``gate_up_lora_a [E, r, H]``, ``gate_up_lora_b [E, 2I, r]``)
    and one on ``down_proj``; these export to PEFT's ``adapter_model.safetensors`` keys. The
    ``2I`` rows of ``gate_up_lora_b`` follow the stored weight's gate/up order, as PEFT's do
    (interleaved for GPT-OSS; the kernel gets them reordered).
    ``layout="split"`` gives gate and up their own A (no PEFT export for gate/up, since PEFT
    cannot express that on a fused parameter). Values come from
    ``lora_core.init_lora_tensor("<experts>.<gate_up|down|gate|up>.lora_A", [E, r, in])``
    (B is zero), so they are a pure function of ``config.init_seed`` and the name.
    If PEFT LoRA was adopted by :func:`wrap`, its parameters are published as they are.
    Experts modules matched by ``config.exclude_modules`` are skipped; ``target_modules`` only
    selects dense layers (see :func:`adapt_model`). Calling ``adapt`` again with the same config
    changes nothing and reports the layers in ``already_adapted_layers``.

    Args:
        model: a model wrapped by :func:`moe_experts.wrap`.
        config: the LoRA config (rank, alpha, init_seed, exclude_modules).
        layout: ``"fused"`` or ``"split"``.
        lora_experts: N extra trainable SwiGLU "LoRA experts" per targeted block
            (:class:`~moe_experts.lora_experts.LoraExperts`: ``le_gate``/``le_up``
            ``[N, J, H]``, zero-initialised ``le_down`` ``[N, H, J]``) whose mean is added to
            the block's routed output; named ``<experts>.lora_experts.le_*``, ``REPLICATED``,
            saved by lora-checkpoint but not PEFT-loadable (no PEFT export). 0: none.
        lora_expert_intermediate: J, default the routed experts' intermediate size.

    Returns:
        An :class:`~lora_core.contracts.AdaptationResult`: names
        ``<experts>.lora.<buffer>`` (e.g. ``model.layers.0.mlp.experts.lora.gate_up_lora_a``),
        all ``REPLICATED``; every placeholder; PEFT export keys and ``peft_target_parameters``.

    Raises:
        AdaptError: the model is not wrapped, or has expert LoRA from a different config.
        TypeError: ``config`` is not a :class:`lora_core.LoraConfig`.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"adapt config must be a lora_core.LoraConfig, got {type(config).__name__}")
    if layout not in ("fused", "split"):
        raise AdaptError(f"layout must be 'fused' or 'split', got {layout!r}")
    _check_lora_expert_args(lora_experts, lora_expert_intermediate)
    sites = experts_sites(model)
    if not sites:
        raise AdaptError(
            f"{type(model).__name__} has no experts on kt-kernel; call moe_experts.wrap(model) "
            "before moe_experts.adapt(model, config)"
        )
    placeholders = [n for n, _ in named_placeholders(model)]
    if not config.enable:
        return AdaptationResult.create(
            adapted_layers=(),
            named_optimizer_parameters=(),
            ownership={},
            producer=_component(),
            lora_config=config,
            placeholders=placeholders,
        )
    fqn_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    adapted: list[str] = []
    repeated: list[str] = []
    params: list[tuple[str, nn.Parameter]] = []
    exports: dict[str, PeftExport] = {}
    targets: list[str] = []
    for site, kernel in sites:
        if not _targeted(site, config):
            continue
        extra = _lora_experts(site, kernel, config, lora_experts, lora_expert_intermediate)
        if extra is not None:
            extra.requires_grad_(True)
            fqns = {id(p): n for n, p in model.named_parameters()}
            params += [(fqns[id(p)], p) for p in extra.parameters()]
        arch = site.arch
        rel = site.target(arch.experts_attr)
        if kernel.adopted_peft:
            repeated.append(site.experts_name)
            for name, p in model.named_parameters():
                if name.startswith(site.experts_name + ".") and p.requires_grad:
                    params.append((name, p))
                    key = _PEFT_ROOT + _strip_peft_root(name).replace(
                        f".{kernel.peft_adapter}.weight", ".weight"
                    )
                    exports[name] = PeftExport(key, PeftTensorLayout.IDENTITY)
            targets += [f"{rel}.{n}" for n in kernel.peft_parameter_names]
            continue
        again, lora = _own_lora(site, kernel, config, layout)
        (repeated if again else adapted).append(site.experts_name)
        lora.requires_grad_(True)
        exported = ("gate_up", "down") if layout == "fused" else ("down",)
        order = [arch.gate_up_param, arch.down_param]
        kept = [p for p, proj in zip(order, ("gate_up", "down"), strict=True) if proj in exported]
        for name, p in lora.named_lora_parameters():
            fqn = fqn_of.get(id(p), f"{site.experts_name}.lora.{name}")
            params.append((fqn, p))
            spec = _FUSED.get(name)
            if spec is None or spec[0] not in exported:
                continue
            _proj, peft_layout, attr = spec
            param_name = getattr(arch, attr)
            depth = len(kept) - 1 - kept.index(param_name)
            factor = "A" if peft_layout is PeftTensorLayout.EXPERT_STACKED_A else "B"
            exports[fqn] = PeftExport(
                peft_lora_key(peft_key_prefix(site.experts_name, depth), factor), peft_layout
            )
        targets += [f"{rel}.{p}" for p in kept]
    return AdaptationResult.create(
        adapted_layers=adapted,
        already_adapted_layers=repeated,
        named_optimizer_parameters=params,
        ownership={n: ParameterOwnership.REPLICATED for n, _ in params},
        producer=_component(),
        lora_config=config,
        placeholders=placeholders,
        peft_exports=exports,
        peft_target_parameters=sorted(set(targets)),
    )


def router_targets(model: nn.Module) -> tuple[str, ...]:
    """The ``LoraConfig.target_parameters`` entries that put LoRA on every router of ``model``.

    Args:
        model: a supported transformers MoE model (wrapped or not, PEFT-wrapped or not).

    Returns:
        Dotted parameter suffixes such as ``("mlp.gate.weight",)``: the block's attribute name
        in its layer, the router attribute and its ``weight`` (``("router.proj.weight",)`` for
        Gemma-4, whose block is the decoder layer; see :meth:`MoEBlockSite.target`).

    Raises:
        UnsupportedModelError: the model is not a supported MoE family.
    """
    arch = find_architecture(model)
    names = {
        site.target(f"{arch.router_attr}.{arch.router_param}")
        for site in iter_moe_blocks(model, arch)
    }
    return tuple(sorted(names))


def _dense_part(model: nn.Module, config: LoraConfig) -> LoraConfig:
    """``config`` without the ``target_parameters`` that name expert banks.

    A PEFT-style config lists ``mlp.experts.gate_up_proj`` beside ``mlp.gate.weight``; the
    experts get their LoRA from :func:`adapt`, so only the rest goes to lora-core.
    """
    experts = [n for n, _ in named_placeholders(model)]
    kept = tuple(
        t for t in config.target_parameters if not any(matches_module(n, [t]) for n in experts)
    )
    if kept == config.target_parameters:
        return config
    return config.model_copy(update={"target_parameters": kept})


def adapt_model(
    model: nn.Module,
    config: LoraConfig,
    *,
    dense_config: LoraConfig | None = None,
    weight_dtype: WeightDType = "bf16",
    layout: LoraLayout = "fused",
    lora_experts: int = 0,
    lora_expert_intermediate: int | None = None,
    kernel_attention: bool = True,
    kernel_norms: bool = True,
) -> AdaptationResult:
    """Wrap (if needed), put dense LoRA on attention/routers and expert LoRA on the experts.

    The two-call pattern it implements, in this order (``enable_lora_training`` freezes every
    parameter it does not create, so it must run before ``adapt``)::

        dense = lora_core.enable_lora_training(model, dense_config or config)
        experts = moe_experts.adapt(model, config)
        result = dense.merge(experts)

    Routers get LoRA when the dense config's ``target_parameters`` names them (see
    :func:`router_targets`, e.g. ``mlp.gate.weight``); entries naming the expert banks
    (``mlp.experts.gate_up_proj``, as in a PEFT config) are left to :func:`adapt`.

    Args:
        model: a supported transformers MoE model (wrapped or not).
        config: expert LoRA config (rank, alpha, init_seed).
        dense_config: dense LoRA config (``target_modules`` such as q/k/v/o_proj,
            ``target_parameters`` such as ``mlp.gate.weight``); ``None`` uses ``config``; a
            disabled config adds no dense LoRA.
        weight_dtype: kernel storage dtype when the model still needs wrapping.
        layout: expert LoRA layout (see :func:`adapt`).
        lora_experts: extra LoRA experts per block (see :func:`adapt`).
        lora_expert_intermediate: their width (see :func:`adapt`).
        kernel_attention: switch a CPU model that uses transformers' SDPA to kt-kernel's
            causal attention (:func:`moe_experts.attention.use_kernel_attention`; 1.8x less
            CPU time than SDPA's flash kernel at T=2048, any other call still goes to SDPA);
            ``False`` leaves the model's attention as it is.
        kernel_norms: run the model's RMSNorms on kt-kernel's fused op where it reproduces
            them (:func:`moe_experts.norms.use_kernel_norms`; calls off the CPU keep the
            module's own forward); ``False`` leaves them as they are.

    Returns:
        The merged :class:`~lora_core.contracts.AdaptationResult`.
    """
    if not experts_sites(model):
        wrap(model, weight_dtype=weight_dtype)
    if kernel_attention:
        use_kernel_attention(model)
    if kernel_norms:
        use_kernel_norms(model)
    dense_cfg = dense_config if dense_config is not None else config
    if dense_cfg.enable:
        dense_cfg = _dense_part(model, dense_cfg)
    dense = enable_lora_training(model, dense_cfg)
    experts = adapt(
        model,
        config,
        layout=layout,
        lora_experts=lora_experts,
        lora_expert_intermediate=lora_expert_intermediate,
    )
    if dense.lora_config is not None and dense.lora_config != config:
        # merge() refuses two different configs; the expert config is the one recorded.
        dense = AdaptationResult.create(
            adapted_layers=dense.adapted_layers,
            already_adapted_layers=dense.already_adapted_layers,
            named_optimizer_parameters=dense.named_optimizer_parameters,
            ownership=dense.ownership,
            producer=dense.producer,
            lora_config=None,
            placeholders=dense.placeholders,
            rank_local_names=dense.rank_local_names,
            checkpoint_key_aliases=dense.checkpoint_key_aliases,
            components=dense.components,
            peft_exports=dense.peft_exports,
            peft_target_modules=dense.peft_target_modules,
            peft_target_parameters=dense.peft_target_parameters,
            missing_parameter_initializer=dense.missing_parameter_initializer,
        )
    return dense.merge(experts)
