"""One builder of a MoE block's frozen expert storage, whatever the weights' source.

:func:`moe_experts.wrap` (the weights are in the module) and
:func:`moe_experts.load_pretrained` (they are in a checkpoint) run the same per-block
sequence through :func:`build_block`: the block's :class:`kt_kernel.ExpertSpec`, its storage
in the run's format (built once per machine when local ranks share it), the
:class:`~moe_experts.KernelExperts` over it with zero-storage placeholders under the original
names, the optional self-check, and its installation in the block. What differs is behind the
small :class:`ExpertSource` protocol: where the tensors come from, whether the original can be
checked against, and how the kernel is installed (in place of the module, or under PEFT's
wrappers). The storage format is resolved once per run into a :class:`StoragePlan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

import kt_kernel
from moe_experts.architectures import MoEBlockSite
from moe_experts.errors import WrapError
from moe_experts.kernel_experts import KernelExperts, Policy
from moe_experts.self_check import BlockCheck, expert_activation
from moe_experts.sharing import ExpertSharing, shared_or_local

__all__ = [
    "POLICIES",
    "BuiltBlock",
    "ExpertSource",
    "StoragePlan",
    "build_block",
    "expert_spec",
]

POLICIES: tuple[Policy, ...] = ("save", "recompute")
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
class StoragePlan:
    """How every MoE block of one ``wrap``/``load_pretrained`` call is stored.

    Attributes:
        weight_dtype: the storage's name (``"bf16"``, ``"fp32"``, ``"int8"``, ...).
        format: the :class:`kt_kernel.WeightFormat` every block is stored in.
        policy: kt-kernel activation policy of the :class:`KernelExperts`.
        self_check: whether a source that still has the original module checks the kernel
            against it before the module is replaced.
    """

    weight_dtype: str
    format: kt_kernel.WeightFormat
    policy: Policy = "save"
    self_check: bool = True

    @classmethod
    def resolve(
        cls, weight_dtype: str, *, policy: Policy = "save", self_check: bool = True
    ) -> StoragePlan:
        """The plan for the storage name ``weight_dtype``.

        Raises:
            WrapError: an unknown ``weight_dtype`` or ``policy``.
        """
        if weight_dtype not in _DTYPES:
            raise WrapError(f"weight_dtype must be one of {sorted(_DTYPES)}, got {weight_dtype!r}")
        if policy not in POLICIES:
            raise WrapError(f"policy must be 'save' or 'recompute', got {policy!r}")
        from kt_kernel.formats import resolve_format

        quantised = weight_dtype if weight_dtype in _QUANTISED else None
        fmt = resolve_format(quantised, _DTYPES[weight_dtype], _DTYPES[weight_dtype])
        return cls(weight_dtype, fmt, policy, self_check)

    @property
    def quantised(self) -> bool:
        """Whether the format is lossy (anything but dense storage)."""
        return not isinstance(self.format, kt_kernel.Dense)


@runtime_checkable
class ExpertSource(Protocol):
    """Where one MoE block's frozen expert weights come from, and where its kernel goes.

    Two implementations: the experts module's own tensors (``wrap``) and a checkpoint
    reader (``load_pretrained``).
    """

    @property
    def module(self) -> nn.Module:
        """The experts module the kernel replaces (its parameters may be on the meta device)."""
        ...

    def stored(self) -> Mapping[str, torch.Tensor]:
        """Stored parameter name -> tensor (or a CPU description of it): gate_up, down, biases."""
        ...

    def kernel_weights(
        self, spec: kt_kernel.ExpertSpec, fmt: kt_kernel.WeightFormat
    ) -> kt_kernel.ExpertWeights:
        """The block's experts in kernel storage in ``fmt`` (kt-kernel's layout)."""
        ...

    def check(self, kernel: KernelExperts) -> BlockCheck | None:
        """Compare ``kernel`` with the original experts, or ``None`` where there is none."""
        ...

    def install(self, kernel: KernelExperts) -> bool:
        """Put ``kernel`` in the block; ``True`` when it adopted PEFT LoRA on the way."""
        ...


@dataclass(frozen=True)
class BuiltBlock:
    """What :func:`build_block` made of one MoE block.

    Attributes:
        experts: the experts module's qualified name.
        kernel: the installed :class:`KernelExperts`.
        check: the self-check, ``None`` when not run.
        adopted_peft: whether PEFT ``target_parameters`` LoRA was adopted.
    """

    experts: str
    kernel: KernelExperts
    check: BlockCheck | None
    adopted_peft: bool


def expert_spec(
    site: MoEBlockSite, module: nn.Module, stored: Mapping[str, torch.Tensor]
) -> kt_kernel.ExpertSpec:
    """The kernel spec of one experts module, from its stored tensors (any declared layout).

    Args:
        site: the block.
        module: its experts module (the activation is read from it; meta parameters are fine).
        stored: stored parameter name -> tensor or description (gate_up, down, biases).

    Raises:
        WrapError: the tensors are not 3-D, or their shapes disagree with the spec's layout.
    """
    arch = site.arch
    gate_up, down = stored[arch.gate_up_param], stored[arch.down_param]
    if gate_up.dim() != 3 or down.dim() != 3:
        raise WrapError(
            f"{site.experts_name}.{arch.gate_up_param} and {arch.down_param} must be fused 3D "
            f"parameters; got {list(gate_up.shape)} and {list(down.shape)}"
        )
    e, i, h = arch.expert_dims(gate_up)
    for name, shape in arch.stored_shapes(e, i, h).items():
        t = stored.get(name)
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
        activation=expert_activation(module, site.experts_name, arch),
    )


def build_block(
    site: MoEBlockSite,
    source: ExpertSource,
    plan: StoragePlan,
    sharing: ExpertSharing | None,
) -> BuiltBlock:
    """Store one block's experts on kt-kernel and install the :class:`KernelExperts`.

    The spec comes from the source's stored tensors and module; the storage is built by the
    source in ``plan.format`` (by the machine's local rank 0 only, and mapped by the others,
    when ``sharing``); the kernel gets placeholders named, shaped and ordered like the
    original parameters; with ``plan.self_check`` the source checks it before installing it,
    so a refused block keeps its original module.

    Raises:
        WrapError: unexpected expert shapes or an activation kt-kernel does not implement.
        SelfCheckError: the kernel disagrees with the original experts module.
    """
    arch = site.arch
    stored = source.stored()
    spec = expert_spec(site, source.module, stored)
    fmt = plan.format

    def build() -> kt_kernel.ExpertWeights:
        return source.kernel_weights(spec, fmt)

    weights = shared_or_local(sharing, build, spec, fmt, site.experts_name)
    kernel = KernelExperts(
        weights,
        gate_up_like=stored[arch.gate_up_param],
        down_like=stored[arch.down_param],
        gate_up_name=arch.gate_up_param,
        down_name=arch.down_param,
        label=site.experts_name,
        policy=plan.policy,
        arch=arch,
        bias_like={p: stored[p] for p in arch.bias_params},
        order=tuple(n for n, _ in source.module.named_parameters(recurse=False)),
        shared_by=sharing.local_ranks if sharing is not None else 1,
    )
    check = source.check(kernel) if plan.self_check else None
    adopted = source.install(kernel)
    return BuiltBlock(site.experts_name, kernel, check, adopted)
