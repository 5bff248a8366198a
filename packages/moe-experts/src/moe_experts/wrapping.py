"""``wrap``: move every MoE block's expert weights into kt-kernel and run the experts there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

import kt_kernel
from moe_experts.architectures import (
    MoEArchitecture,
    MoEBlockSite,
    find_architecture,
    iter_moe_blocks,
)
from moe_experts.errors import WrapError
from moe_experts.kernel_experts import KernelExperts, Policy, unwrap_peft
from moe_experts.memory import release_file_views, trim_host_heap
from moe_experts.placeholders import named_placeholders
from moe_experts.self_check import BlockCheck
from moe_experts.self_check import self_check as self_check_block
from moe_experts.sharing import default_kernel_threads, expert_sharing
from moe_experts.storage import AUTO, StoragePlan, build_block, check_policy, storage_name
from moe_experts.validation import check_expert_config

if TYPE_CHECKING:
    from peft.tuners.lora.layer import ParamWrapper

__all__ = ["ModuleSource", "WeightDType", "WrapReport", "experts_sites", "wrap"]

# A name in kt_kernel.FORMATS ("bf16", "fp32", "int8", ...) or "auto" (the experts' own dtype).
WeightDType = str


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


def _experts_dtype(model: nn.Module, arch: MoEArchitecture) -> torch.dtype | None:
    """The stored dtype of the first experts module not yet on the kernel (``None``: none)."""
    for site in iter_moe_blocks(model, arch):
        _, base = unwrap_peft(getattr(site.block, arch.experts_attr))
        gate_up = getattr(base, arch.gate_up_param, None)
        if not isinstance(base, KernelExperts) and isinstance(gate_up, torch.Tensor):
            return gate_up.dtype
    return None


def experts_sites(model: nn.Module) -> list[tuple[MoEBlockSite, KernelExperts]]:
    """Return ``(site, KernelExperts)`` for every wrapped MoE block, in module order.

    Raises:
        UnsupportedModelError: the model is not a supported family.
    """
    arch = find_architecture(model)
    out = []
    for site in iter_moe_blocks(model, arch):
        _, base = unwrap_peft(getattr(site.block, arch.experts_attr))
        if isinstance(base, KernelExperts):
            out.append((site, base))
    return out


class ModuleSource:
    """The :class:`~moe_experts.storage.ExpertSource` of ``wrap``: the experts module's tensors.

    Storage is converted from views of the module's parameters expert by expert; the kernel
    is self-checked against the module, then installed in its place (under PEFT's
    ``ParamWrapper`` chain, whose LoRA it adopts, when there is one).
    """

    def __init__(
        self, site: MoEBlockSite, wrappers: tuple[ParamWrapper, ...], base: nn.Module
    ) -> None:
        """Read the stored tensors of ``base``, the innermost experts module of ``site``.

        Raises:
            WrapError: ``base`` has no fused gate_up/down tensors (transformers 4.x experts).
        """
        arch = site.arch
        gate_up = getattr(base, arch.gate_up_param, None)
        down = getattr(base, arch.down_param, None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise WrapError(
                f"{site.experts_name} ({type(base).__name__}) has no tensors "
                f"{arch.gate_up_param!r} and {arch.down_param!r}; per-expert nn.Linear experts "
                "(transformers 4.x) are not supported by this spec"
            )
        self.site = site
        self.wrappers = wrappers
        self._module = base
        self._stored = {arch.gate_up_param: gate_up, arch.down_param: down}
        self._stored.update({p: getattr(base, p, None) for p in arch.bias_params})

    @property
    def module(self) -> nn.Module:
        """The original experts module (unwrapped from PEFT)."""
        return self._module

    def stored(self) -> Mapping[str, torch.Tensor]:
        """The module's gate_up, down and bias tensors, as stored."""
        return self._stored

    def kernel_weights(
        self, spec: kt_kernel.ExpertSpec, fmt: kt_kernel.WeightFormat
    ) -> kt_kernel.ExpertWeights:
        """kt-kernel storage from the stored tensors, converted with views expert by expert."""
        arch = self.site.arch
        tensors = self._stored
        gate_up = arch.kernel_gate_up(tensors[arch.gate_up_param])  # [E, 2, I, H] view
        gb = tensors.get(arch.gate_up_bias_param or "")
        return kt_kernel.ExpertWeights.from_split(
            spec,
            gate_up[:, 0],
            gate_up[:, 1],
            arch.kernel_down(tensors[arch.down_param]),
            gate_up_bias=None if gb is None else arch.kernel_rows(gb.detach(), dim=1),
            down_bias=tensors.get(arch.down_bias_param or ""),
            weight_dtype=fmt,
        )

    def check(self, kernel: KernelExperts) -> BlockCheck:
        """Run the module and the kernel on the same batch; refuse a disagreement.

        A quantised base is checked through a dense twin built from kernel-layout weights (a
        copy of this block's gate_up only where the stored layout is not kt-kernel's).
        """
        arch = self.site.arch
        twin = kernel.expert_weights.is_quantized
        gate_up, down = self._stored[arch.gate_up_param], self._stored[arch.down_param]
        return self_check_block(
            self.site.experts_name,
            self._module,
            kernel,
            gate_up=arch.kernel_gate_up(gate_up).flatten(1, 2) if twin else None,
            down=arch.kernel_down(down) if twin else None,
        )

    def install(self, kernel: KernelExperts) -> bool:
        """Replace the module by ``kernel`` (under PEFT's wrappers, adopting their LoRA)."""
        arch = self.site.arch
        if self.wrappers:
            kernel.adopt_peft(self.wrappers, self.site.experts_name)  # validates first
            self.wrappers[-1].base_layer = kernel
            return True
        setattr(self.site.block, arch.experts_attr, kernel)
        return False


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
        weight_dtype: kernel storage, a name in :data:`kt_kernel.FORMATS`: ``"bf16"``,
            ``"fp32"``, or a quantised base computing in bf16 (quantisation error in
            ``WrapReport.quantization``): ``"int8"`` (per-output-channel scales, 0.50x bf16
            memory), ``"int4"`` (group-wise, 64 columns per bf16 scale, 0.27x) or ``"fp8"``
            (E4M3 with 128x128 block scales, 0.50x); or ``"auto"``: the experts' own values
            (``"fp32"`` for float32, else ``"bf16"``, which is ``"bf16-packed"``, the same
            values in the kernel's own layout, on CPUs with AVX512_BF16:
            :func:`kt_kernel.auto_format`). Activations are cast to the compute dtype inside
            the experts and the output is cast back.
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
        WrapError: bad ``weight_dtype``/``policy``, unexpected expert shapes, an activation
            kt-kernel does not implement (read from the experts module), or a config with
            more experts per token than experts (naming the keys).
        SelfCheckError: the kernel disagrees with the original experts module.
    """
    name = storage_name(weight_dtype)
    check_policy(policy)
    arch = find_architecture(model)
    config = getattr(model, "config", None)
    if config is not None:  # top-k above the expert count would fail only in the first forward
        check_expert_config(config, f"{type(model).__name__}.config", WrapError)
    # With nothing left to wrap the plan is never used, so "auto" may resolve to anything.
    source_dtype = (_experts_dtype(model, arch) or torch.bfloat16) if name == AUTO else None
    plan = StoragePlan.resolve(
        name, policy=policy, self_check=self_check, source_dtype=source_dtype
    )
    default_kernel_threads()
    already: list[str] = []
    checks: list[BlockCheck] = []
    adopted: list[str] = []
    wrapped: list[str] = []
    reports: list[tuple[str, kt_kernel.QuantizationReport]] = []
    moved = kernel_bytes = 0
    # Every rank leaves the loop together: an error on one is an error on all, sockets closed.
    with expert_sharing(share_experts) as sharing:
        shared_by = sharing.local_ranks if sharing is not None else 1
        for site in iter_moe_blocks(model, arch):
            wrappers, base = unwrap_peft(getattr(site.block, arch.experts_attr))
            if isinstance(base, KernelExperts):
                already.append(site.experts_name)
                continue
            source = ModuleSource(site, wrappers, base)
            block = build_block(site, source, plan, sharing)
            weights = block.kernel.expert_weights
            if weights.is_quantized:
                reports.append((site.experts_name, weights.quantization_report()))
            if block.check is not None:
                checks.append(block.check)
            if block.adopted_peft:
                adopted.append(site.experts_name)
            moved += sum(t.nbytes for t in source.stored().values())
            kernel_bytes += weights.nbytes
            wrapped.append(site.experts_name)
            # The last block's experts must be gone before the trim.
            del source, base, wrappers, block, weights
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
        weight_dtype=plan.weight_dtype,
        adopted_peft=tuple(adopted),
        quantization=tuple(reports),
        self_checks=tuple(checks),
        shared_by=shared_by,
    )
