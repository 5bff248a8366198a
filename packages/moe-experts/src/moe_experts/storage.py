"""One builder of a MoE block's frozen expert storage, whatever the weights' source.

:func:`moe_experts.wrap` (the weights are in the module) and
:func:`moe_experts.load_pretrained` (they are in a checkpoint) run the same per-block
sequence through :func:`build_block`: the block's :class:`kt_kernel.ExpertSpec`, its storage
in the run's format (built once per machine when local ranks share it), the
:class:`~moe_experts.KernelExperts` over it with zero-storage placeholders under the original
names, the optional self-check, and its installation in the block. What differs is behind the
small :class:`ExpertSource` protocol: where the tensors come from, whether the original can be
checked against, and how the kernel is installed (in place of the module, or under PEFT's
wrappers). The storage format is resolved once per run into a :class:`StoragePlan`, from a name
in :data:`kt_kernel.FORMATS` or ``"auto"`` (the source's own format).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

import kt_kernel
from moe_experts._safetensors import Shards, weight_map
from moe_experts.architectures import MoEBlockSite
from moe_experts.errors import LoadError, WrapError
from moe_experts.kernel_experts import KernelExperts, Policy
from moe_experts.self_check import BlockCheck, expert_activation
from moe_experts.sharing import ExpertSharing, shared_or_local

__all__ = [
    "AUTO",
    "POLICIES",
    "BuiltBlock",
    "ExpertSource",
    "StoragePlan",
    "build_block",
    "check_policy",
    "checkpoint_dtype",
    "expert_spec",
    "storage_name",
]

POLICIES: tuple[Policy, ...] = ("save", "recompute")
# The storage name that stands for the source's own format (resolved by kt_kernel.auto_format).
AUTO = "auto"


def storage_name(weight_dtype: str) -> str:
    """``weight_dtype`` as :data:`kt_kernel.FORMATS` spells it, or :data:`AUTO`.

    An old spelling (``"bfloat16"``, ``"float32"``) gives a ``FutureWarning`` naming the new one.

    Raises:
        WrapError: not ``"auto"`` nor a registered weight format (the message lists them).
    """
    if weight_dtype == AUTO:
        return AUTO
    try:
        return kt_kernel.format_name(weight_dtype)
    except kt_kernel.KernelDTypeError:
        raise WrapError(
            f"weight_dtype must be {AUTO!r} or one of {list(kt_kernel.FORMATS)} (the weight "
            f"formats of kt_kernel.FORMATS), got {weight_dtype!r}"
        ) from None


def check_policy(policy: Policy) -> Policy:
    """``policy`` itself if it is one of :data:`POLICIES`.

    Raises:
        WrapError: any other value.
    """
    if policy not in POLICIES:
        raise WrapError(f"policy must be 'save' or 'recompute', got {policy!r}")
    return policy


@dataclass(frozen=True)
class StoragePlan:
    """How every MoE block of one ``wrap``/``load_pretrained`` call is stored.

    Attributes:
        weight_dtype: the format's name in :data:`kt_kernel.FORMATS` (``"auto"`` resolved).
        format: the :class:`kt_kernel.WeightFormat` every block is stored in (a quantised one
            computes in bf16).
        policy: kt-kernel activation policy of the :class:`KernelExperts`.
        self_check: whether a source that still has the original module checks the kernel
            against it before the module is replaced.
        reason: how ``"auto"`` was resolved (for start-up summaries); empty when the format
            was named.
    """

    weight_dtype: str
    format: kt_kernel.WeightFormat
    policy: Policy = "save"
    self_check: bool = True
    reason: str = ""

    @classmethod
    def resolve(
        cls,
        weight_dtype: str,
        *,
        policy: Policy = "save",
        self_check: bool = True,
        source_dtype: torch.dtype | None = None,
    ) -> StoragePlan:
        """The plan for the storage name ``weight_dtype`` (``"auto"``: ``source_dtype``'s).

        Args:
            weight_dtype: ``"auto"`` or a name in :data:`kt_kernel.FORMATS`.
            policy: kt-kernel activation policy.
            self_check: see :attr:`self_check`.
            source_dtype: the dtype the experts are stored in; ``"auto"`` keeps their values
                (fp32, else bf16, repacked where kt-kernel's own products run:
                :func:`kt_kernel.auto_format`).

        Raises:
            WrapError: an unknown ``weight_dtype`` or ``policy``, or ``"auto"`` without a
                ``source_dtype``.
        """
        name = storage_name(weight_dtype)
        check_policy(policy)
        reason = ""
        if name == AUTO:
            if source_dtype is None:
                raise WrapError("weight_dtype='auto' needs the experts' dtype to resolve")
            name = kt_kernel.auto_format(source_dtype)
            reason = f"auto: the experts' {_dtype_name(source_dtype)} weights"
        return cls(name, kt_kernel.FORMATS[name](), policy, self_check, reason)

    @classmethod
    def for_checkpoint(
        cls, path: Path, weight_dtype: str | None, *, policy: Policy = "save"
    ) -> StoragePlan:
        """The plan of ``load_pretrained(path, weight_dtype=...)``, from ``config.json``.

        A checkpoint whose ``quantization_config`` a registered format reads (FP8 blocks:
        ``"fp8"``; GPT-OSS: ``"mxfp4"``) keeps its shipped bytes under ``"auto"`` and
        ``None``, may be dequantised (a dense format), and is never quantised a second
        time. Otherwise ``"auto"`` keeps the values of the checkpoint's dtype
        (``config.json``'s ``dtype`` or ``torch_dtype``, else the dtype most of its tensors
        have: :func:`kt_kernel.auto_format`) and ``None`` stores dense bf16.

        Raises:
            LoadError: an unreadable ``config.json``, a ``quantization_config`` no format
                reads, or a lossy format other than the shipped one for a quantised checkpoint.
            WrapError: an unknown ``weight_dtype`` or ``policy``.
        """
        name = storage_name(weight_dtype) if weight_dtype is not None else None
        check_policy(policy)
        config_file = path / "config.json"
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise LoadError(f"cannot read {config_file}: {exc}") from exc
        quant = raw.get("quantization_config") if isinstance(raw, dict) else None
        try:
            shipped = kt_kernel.auto_format(torch.float32, quant) if quant else None
        except kt_kernel.KernelDTypeError as exc:
            raise LoadError(f"{config_file}: {exc}") from exc
        reason = ""
        if shipped is not None and name in (None, AUTO):
            name, reason = shipped, f"auto: the checkpoint's quantization_config ({shipped})"
        elif name is None:
            name = "bf16"
        elif name == AUTO:
            dtype = checkpoint_dtype(path, raw)
            name = kt_kernel.auto_format(dtype)
            reason = f"auto: the checkpoint's {_dtype_name(dtype)} weights"
        if shipped is not None and name != shipped and kt_kernel.FORMATS[name].lossy:
            raise LoadError(
                f"{config_file}: the checkpoint's experts are {shipped.upper()} "
                f"(quantization_config); weight_dtype={weight_dtype!r} would quantise them a "
                f"second time; pass {shipped!r} (the default: the shipped bytes) or a dense "
                "format such as 'bf16'/'fp32' (dequantised while streaming)"
            )
        return cls(name, kt_kernel.FORMATS[name](), policy, False, reason)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(path: Path, config: Mapping[str, Any]) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in.

    ``config.json``'s ``dtype`` (or the older ``torch_dtype``, also under ``text_config``),
    else the floating dtype most of the checkpoint's tensors have (float32 if none).

    Raises:
        LoadError: the checkpoint's safetensors cannot be read.
    """
    for where in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = where.get(key) if isinstance(where, Mapping) else None
            dtype = getattr(torch, value, None) if isinstance(value, str) else None
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return dtype
    shards = Shards()
    counts: Counter[torch.dtype] = Counter()
    for key, file in weight_map(path).items():
        dtype = shards.info(file, key)[1]
        if dtype.is_floating_point and dtype.itemsize > 1:  # FP8 bytes are not a dtype choice
            counts[dtype] += 1
    return counts.most_common(1)[0][0] if counts else torch.float32


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
