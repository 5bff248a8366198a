"""``wrap``: move every MoE block's expert weights into kt-kernel and run the experts there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

import kt_kernel
from moe_experts import peft_mapping
from moe_experts.architectures import (
    MoEArchitecture,
    MoEBlockSite,
    find_architecture,
    iter_moe_blocks,
)
from moe_experts.errors import WrapError
from moe_experts.kernel_experts import KernelExperts, Policy, _KernelCall, _PeftAdoption
from moe_experts.memory import release_file_views, trim_host_heap
from moe_experts.placeholders import named_placeholders
from moe_experts.self_check import BlockCheck, expert_activation
from moe_experts.self_check import self_check as self_check_block
from moe_experts.sharing import default_kernel_threads, expert_sharing, shared_or_local

__all__ = ["WeightDType", "WrapReport", "experts_sites", "wrap"]

WeightDType = Literal["bf16", "fp32", "int8", "int4", "fp8"]
# Compute dtype per storage name; "int8", "int4" and "fp8" are kt-kernel's quantised bases
# (the kt_kernel.FORMATS shorthands, quantised once here) computing, with their LoRA, in bf16.
_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "int8": torch.bfloat16,
    "int4": torch.bfloat16,
    "fp8": torch.bfloat16,
}
_QUANTISED = frozenset({"int8", "int4", "fp8"})


@dataclass(frozen=True)
class WrapReport:
    """What :func:`wrap` did.

    Attributes:
        family: the architecture family, e.g. ``"qwen3_moe"``.
        wrapped_blocks: fully-qualified names of the experts modules wrapped by this call.
        already_wrapped: experts modules that were already on the kernel (left as they were).
        placeholders: names of every zero-storage placeholder now in the module tree.
        bytes_moved: bytes of expert weights that left the module tree in this call.
        kernel_bytes: bytes now held by kt-kernel for those experts (differs from
            ``bytes_moved`` when ``weight_dtype`` differs from the model's dtype).
        weight_dtype: kernel storage dtype name.
        adopted_peft: experts modules whose PEFT ``target_parameters`` LoRA was adopted.
        quantization: for ``weight_dtype="int8"``, ``(experts module, report)`` per wrapped
            block: each projection's max abs and relative Frobenius quantisation error.
        self_checks: the wrap-time comparison of kernel and original module per wrapped
            block (empty with ``self_check=False``).
        shared_by: how many local ranks map this call's expert storage (one copy per
            machine); 1 when every rank holds its own copy.
    """

    family: str
    wrapped_blocks: tuple[str, ...]
    already_wrapped: tuple[str, ...]
    placeholders: tuple[str, ...]
    bytes_moved: int
    kernel_bytes: int
    weight_dtype: str
    adopted_peft: tuple[str, ...] = ()
    quantization: tuple[tuple[str, kt_kernel.QuantizationReport], ...] = ()
    self_checks: tuple[BlockCheck, ...] = ()
    shared_by: int = 1


def _peft_param_wrapper_type() -> type[nn.Module] | None:
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # peft is optional: without it no model can hold ParamWrappers
        return None
    return ParamWrapper


def _unwrap_peft(module: nn.Module) -> tuple[tuple[nn.Module, ...], nn.Module]:
    """Split a PEFT ``ParamWrapper`` chain into (wrappers outermost first, innermost base)."""
    wrapper_type = _peft_param_wrapper_type()
    chain: list[nn.Module] = []
    while wrapper_type is not None and isinstance(module, wrapper_type):
        chain.append(module)
        module = module.base_layer
    return tuple(chain), module


def experts_sites(model: nn.Module) -> list[tuple[MoEBlockSite, KernelExperts]]:
    """Return ``(site, KernelExperts)`` for every wrapped MoE block, in module order.

    Raises:
        UnsupportedModelError: the model is not a supported family.
    """
    arch = find_architecture(model)
    out = []
    for site in iter_moe_blocks(model, arch):
        _, base = _unwrap_peft(getattr(site.block, arch.experts_attr))
        if isinstance(base, KernelExperts):
            out.append((site, base))
    return out


def _expert_spec(
    site: MoEBlockSite, base: nn.Module, gate_up: torch.Tensor, down: torch.Tensor
) -> kt_kernel.ExpertSpec:
    """The kernel spec of one experts module, from its stored tensors (any declared layout).

    Raises:
        WrapError: the tensors are not 3-D, or their shapes disagree with the spec's layout.
    """
    arch = site.arch
    if gate_up.dim() != 3 or down.dim() != 3:
        raise WrapError(
            f"{site.experts_name}.{arch.gate_up_param} and {arch.down_param} must be fused 3D "
            f"parameters; got {list(gate_up.shape)} and {list(down.shape)}"
        )
    e, i, h = arch.expert_dims(gate_up)
    want = arch.stored_shapes(e, i, h)
    have = {arch.gate_up_param: gate_up, arch.down_param: down}
    have.update({p: getattr(base, p, None) for p in arch.bias_params})
    for name, shape in want.items():
        t = have[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise WrapError(
                f"{site.experts_name}.{name} is {got}; the {arch.family} layout "
                f"(transposed={arch.transposed}) needs {list(shape)} for E={e}, I={i}, H={h}"
            )
    return kt_kernel.ExpertSpec(
        num_experts=e,
        hidden_size=h,
        intermediate_size=i,
        activation=expert_activation(base, site.experts_name, arch),
    )


def _kernel_weights(
    arch: MoEArchitecture,
    spec: kt_kernel.ExpertSpec,
    tensors: dict[str, torch.Tensor],
    **kwargs: object,
) -> kt_kernel.ExpertWeights:
    """kt-kernel storage from stored expert tensors, converted with views expert by expert."""
    gate_up = arch.kernel_gate_up(tensors[arch.gate_up_param])  # [E, 2, I, H] view
    gb = tensors.get(arch.gate_up_bias_param or "")
    return kt_kernel.ExpertWeights.from_split(
        spec,
        gate_up[:, 0],
        gate_up[:, 1],
        arch.kernel_down(tensors[arch.down_param]),
        gate_up_bias=None if gb is None else arch.kernel_rows(gb.detach(), dim=1),
        down_bias=tensors.get(arch.down_bias_param or ""),
        **kwargs,  # type: ignore[arg-type]
    )


def _weight_format(weight_dtype: str, source: torch.dtype) -> kt_kernel.WeightFormat:
    """The kernel format ``wrap``/``load_pretrained`` store ``weight_dtype`` in."""
    from kt_kernel.formats import resolve_format

    quantised = weight_dtype if weight_dtype in _QUANTISED else None
    return resolve_format(quantised, _DTYPES[weight_dtype], source)


def _adopt(site: MoEBlockSite, wrappers: tuple[nn.Module, ...], kernel: KernelExperts) -> None:
    """Point ``kernel`` at PEFT's LoRA tensors and route PEFT's forward through the kernel."""
    arch = site.arch
    by_param = {w.parameter_name: w for w in wrappers}
    unknown = sorted(set(by_param) - {arch.gate_up_param, arch.down_param})
    if unknown:
        raise WrapError(
            f"{site.experts_name}: PEFT target_parameters {unknown} are not expert weights "
            f"({arch.gate_up_param}, {arch.down_param}); remove them from target_parameters"
        )
    adapters = [a for a in wrappers[0].active_adapters if a in wrappers[0].lora_A]
    if len(adapters) != 1:
        raise WrapError(
            f"{site.experts_name}: exactly one active PEFT adapter is supported on experts, "
            f"got {adapters}; call peft_model.set_adapter(name) first"
        )
    adapter = adapters[0]
    ranks = {w.r[adapter] for w in wrappers}
    scalings = {float(w.scaling[adapter]) for w in wrappers}
    if len(ranks) != 1 or len(scalings) != 1:
        raise WrapError(
            f"{site.experts_name}: PEFT adapters on {sorted(by_param)} use ranks {sorted(ranks)} "
            f"and scalings {sorted(scalings)}; kt-kernel needs one rank and alpha per experts "
            "module (drop rank_pattern/alpha_pattern for experts)"
        )
    rank = ranks.pop()
    alpha = scalings.pop() * rank
    spec = kernel.spec
    sources: dict[str, tuple[nn.Parameter, str]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for param_name, ours in ((arch.gate_up_param, "gate_up"), (arch.down_param, "down")):
        wrapper = by_param.get(param_name)
        out_dim = 2 * spec.intermediate_size if ours == "gate_up" else spec.hidden_size
        in_dim = spec.hidden_size if ours == "gate_up" else spec.intermediate_size
        if wrapper is None:
            # An untargeted projection contributes exactly zero (A = B = 0, no gradient).
            tensors[f"{ours}_lora_a"] = torch.zeros(spec.num_experts, rank, in_dim)
            tensors[f"{ours}_lora_b"] = torch.zeros(spec.num_experts, out_dim, rank)
            continue
        a = wrapper.lora_A[adapter].weight
        b = wrapper.lora_B[adapter].weight
        sources[f"{ours}_lora_a"] = (a, "a")
        sources[f"{ours}_lora_b"] = (b, "b")
        # Views of PEFT's storage: the kernel's buffers *are* PEFT's memory, no copy.
        tensors[f"{ours}_lora_a"] = peft_mapping.unstack_lora_a(a.detach(), spec.num_experts)
        tensors[f"{ours}_lora_b"] = peft_mapping.unstack_lora_b(b.detach(), spec.num_experts)
    buffers = kt_kernel.LoraBuffers.from_tensors(spec, rank, alpha, "fused", tensors)
    for p in buffers.parameters():
        p.requires_grad_(False)  # gradients go to PEFT's parameters through the views
    kernel.adopt_peft(
        _PeftAdoption(
            caller=_KernelCall(kernel.expert_weights, buffers),
            wrappers=wrappers,
            adapter=adapter,
            sources=sources,
        )
    )
    # The ParamWrapper chain stays in the tree (PEFT keeps saving and loading its keys); only
    # its forward changes, because PEFT would parametrize a weight that now lives in the kernel.
    wrappers[0].forward = kernel.peft_forward


def wrap(
    model: nn.Module,
    *,
    weight_dtype: WeightDType = "bf16",
    policy: Policy = "save",
    self_check: bool = True,
    share_experts: bool | None = None,
) -> WrapReport:
    """Run every MoE block's routed experts on kt-kernel, in place.

    Each experts module is replaced by a :class:`KernelExperts` that the block calls exactly as
    before, with the top-k ids and weights from the model's own router. The base expert weights
    are copied into :class:`kt_kernel.ExpertWeights` and the module tree keeps zero-storage
    placeholders under the same names and logical shapes. PEFT ``target_parameters`` LoRA
    already on the experts is adopted (its parameters stay the trained tensors; the kernel
    reads them through views). Calling ``wrap`` again leaves wrapped blocks as they are.

    Args:
        model: a supported transformers MoE model (or a PEFT model around one).
        weight_dtype: kernel storage dtype, ``"bf16"``, ``"fp32"``, or a quantised base
            computing in bf16 (quantisation error in ``WrapReport.quantization``): ``"int8"``
            (per-output-channel scales, 0.50x bf16 memory), ``"int4"`` (group-wise, 64
            columns per bf16 scale, 0.27x) or ``"fp8"`` (E4M3 with 128x128 block scales,
            0.50x); activations are cast to the compute dtype inside the experts and the
            output is cast back.
        policy: kt-kernel activation policy, ``"save"`` or ``"recompute"``.
        self_check: run each block's original experts module and the kernel on the same
            8 random tokens before the original weights are freed and refuse a disagreement
            (``SelfCheckError`` naming the block and the error). Turn it off only for a model
            verified another way; it costs one small forward per block.
        share_experts: under torchrun with ``LOCAL_WORLD_SIZE`` > 1, local rank 0 builds each
            block's kernel storage once in anonymous shared memory (a memfd handed over a
            Unix socket; nothing named, nothing left after a crash) and every local rank
            maps it read-only: one copy per machine. ``None`` (default) shares unless the
            environment sets ``MOE_EXPERTS_SHARE_EXPERTS=0``; ``False`` keeps a copy per rank.
            Every rank must call ``wrap`` on the same model. Under torchrun the kernel also
            gets ``cores / LOCAL_WORLD_SIZE`` threads unless ``KT_KERNEL_THREADS`` (or an
            ``OMP_NUM_THREADS`` other than torchrun's default 1) says otherwise.

    Returns:
        A :class:`WrapReport`, including how many bytes left the module tree.

    Raises:
        UnsupportedModelError: the model is not a supported family (lists the supported).
        WrapError: bad ``weight_dtype``/``policy``, unexpected expert shapes, or an
            activation kt-kernel does not implement (read from the experts module).
        SelfCheckError: the kernel disagrees with the original experts module.
    """
    if weight_dtype not in _DTYPES:
        raise WrapError(f"weight_dtype must be one of {sorted(_DTYPES)}, got {weight_dtype!r}")
    if policy not in ("save", "recompute"):
        raise WrapError(f"policy must be 'save' or 'recompute', got {policy!r}")
    arch = find_architecture(model)
    default_kernel_threads()
    checks: list[BlockCheck] = []
    wrapped: list[str] = []
    already: list[str] = []
    adopted: list[str] = []
    reports: list[tuple[str, kt_kernel.QuantizationReport]] = []
    moved = kernel_bytes = 0
    # Every rank leaves the loop together: an error on one is an error on all, sockets closed.
    with expert_sharing(share_experts) as sharing:
        shared_by = sharing.local_ranks if sharing is not None else 1
        for site in iter_moe_blocks(model, arch):
            outer = getattr(site.block, arch.experts_attr)
            wrappers, base = _unwrap_peft(outer)
            if isinstance(base, KernelExperts):
                already.append(site.experts_name)
                continue
            gate_up = getattr(base, arch.gate_up_param, None)
            down = getattr(base, arch.down_param, None)
            if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
                raise WrapError(
                    f"{site.experts_name} ({type(base).__name__}) has no tensors "
                    f"{arch.gate_up_param!r} and {arch.down_param!r}; per-expert nn.Linear experts "
                    "(transformers 4.x) are not supported by this spec"
                )
            spec = _expert_spec(site, base, gate_up, down)
            stored = {arch.gate_up_param: gate_up, arch.down_param: down}
            stored.update({p: getattr(base, p) for p in arch.bias_params})
            fmt = _weight_format(weight_dtype, gate_up.dtype)

            def build(spec=spec, stored=stored, fmt=fmt) -> kt_kernel.ExpertWeights:
                return _kernel_weights(arch, spec, stored, weight_dtype=fmt)

            weights = shared_or_local(sharing, build, spec, fmt, site.experts_name)
            if weights.is_quantized:
                reports.append((site.experts_name, weights.quantization_report()))
            kernel = KernelExperts(
                weights,
                gate_up_like=gate_up,
                down_like=down,
                gate_up_name=arch.gate_up_param,
                down_name=arch.down_param,
                label=site.experts_name,
                policy=policy,
                arch=arch,
                bias_like={p: stored[p] for p in arch.bias_params},
                order=tuple(n for n, _ in base.named_parameters(recurse=False)),
                shared_by=shared_by,
            )
            if self_check:
                # Before this block is replaced: a refused block keeps its original module. A
                # quantised base is checked through a dense twin built from kernel-layout weights
                # (a copy of this block's gate_up only where the stored layout is not kt-kernel's).
                twin = weights.is_quantized
                checks.append(
                    self_check_block(
                        site.experts_name,
                        base,
                        kernel,
                        weight_dtype,
                        gate_up=arch.kernel_gate_up(gate_up).flatten(1, 2) if twin else None,
                        down=arch.kernel_down(down) if twin else None,
                    )
                )
            moved += sum(t.nbytes for t in stored.values())
            kernel_bytes += weights.nbytes
            if wrappers:
                _adopt(site, wrappers, kernel)  # validates first: a refusal leaves PEFT untouched
                wrappers[-1].base_layer = kernel
                adopted.append(site.experts_name)
            else:
                setattr(site.block, arch.experts_attr, kernel)
            wrapped.append(site.experts_name)
            # The last block's experts must be gone before the trim.
            del gate_up, down, base, outer, stored, build
    if not wrapped and not already:
        dense = (
            f" with {arch.block_enabled_attr}=True (a dense model of the family)"
            if arch.block_enabled_attr
            else ""
        )
        raise WrapError(
            f"{type(model).__name__} ({arch.family}) has no {arch.block_class} blocks{dense} "
            "to wrap"
        )
    if wrapped:
        # Dense views of the checkpoint's file mapping would keep the freed experts' pages of
        # the same shards resident; then hand the freed heap back to the OS.
        release_file_views(model)
        trim_host_heap()
    return WrapReport(
        family=arch.family,
        wrapped_blocks=tuple(wrapped),
        already_wrapped=tuple(already),
        placeholders=tuple(n for n, _ in named_placeholders(model)),
        bytes_moved=moved,
        kernel_bytes=kernel_bytes,
        weight_dtype=weight_dtype,
        adopted_peft=tuple(adopted),
        quantization=tuple(reports),
        self_checks=tuple(checks),
        shared_by=shared_by,
    )
