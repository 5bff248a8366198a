"""``KernelExperts``: the module that replaces a transformers experts module and calls kt-kernel.

It is called exactly like the transformers experts module it replaces,
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, so the MoE
block and its router run unchanged (routing stays bit-identical to transformers). The base
weights live in a :class:`kt_kernel.ExpertWeights`; the module tree keeps zero-storage
placeholders under the original parameter names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

import kt_kernel
from moe_experts import peft_mapping
from moe_experts.architectures import MoEArchitecture
from moe_experts.errors import WrapError
from moe_experts.lora_experts import LoraExperts
from moe_experts.placeholders import make_placeholder

if TYPE_CHECKING:
    from peft.tuners.lora.layer import ParamWrapper

__all__ = ["KernelExperts", "Policy", "unwrap_peft"]

Policy = Literal["save", "recompute"]


class _KernelCall(nn.Module):
    """Holds adopted LoRA buffers so ``torch.func.functional_call`` can substitute PEFT views."""

    def __init__(self, weights: kt_kernel.ExpertWeights, lora: kt_kernel.LoraBuffers) -> None:
        """Keep the kernel weights and the adopted LoRA buffers (shared with PEFT's storage)."""
        super().__init__()
        self.weights = weights
        self.lora = lora

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, policy: Policy
    ) -> torch.Tensor:
        """Run the kernel with whatever tensors ``self.lora`` currently holds."""
        return kt_kernel.moe_experts_forward(x, ids, w, self.weights, self.lora, policy=policy)


@dataclass
class _PeftAdoption:
    """PEFT ``ParamWrapper`` LoRA adopted by a :class:`KernelExperts` (not a submodule)."""

    caller: _KernelCall  # kernel buffers that share storage with PEFT's parameters
    wrappers: tuple[ParamWrapper, ...]  # the ParamWrapper chain, outermost first
    adapter: str  # PEFT adapter name, e.g. "default"
    # kernel buffer name -> (PEFT Parameter, "a" | "b"); names absent here are zero (untargeted)
    sources: Mapping[str, tuple[nn.Parameter, str]]


class KernelExperts(nn.Module):
    """Routed SwiGLU experts of one MoE block, running on kt-kernel.

    Attributes:
        expert_weights: the frozen base weights in kernel-owned storage.
        spec: the :class:`kt_kernel.ExpertSpec`.
        lora: :class:`kt_kernel.LoraBuffers` created by :func:`moe_experts.adapt`, or ``None``.
        policy: kt-kernel activation policy (``"save"`` or ``"recompute"``).
        num_experts: E (transformers code reads this attribute).
        shared_by: how many local ranks map ``expert_weights`` (1: this process's own copy).
    """

    def __init__(
        self,
        weights: kt_kernel.ExpertWeights,
        *,
        gate_up_like: torch.Tensor,
        down_like: torch.Tensor,
        gate_up_name: str,
        down_name: str,
        label: str,
        policy: Policy = "save",
        arch: MoEArchitecture | None = None,
        bias_like: Mapping[str, torch.Tensor] | None = None,
        order: Sequence[str] = (),
        shared_by: int = 1,
    ) -> None:
        """Register placeholders named like the original parameters and keep the weights.

        Args:
            weights: the frozen base in kernel storage (kt-kernel's layout, biases included).
            gate_up_like: the original gate_up tensor (or its description), any layout.
            down_like: the original down tensor (or its description).
            gate_up_name: gate_up's parameter name in the original module.
            down_name: down's parameter name in the original module.
            label: the experts module's qualified name, for placeholder errors.
            policy: kt-kernel activation policy.
            arch: the family's spec; its gate/up row order decides how the fused LoRA B
                (rows in the family's order, like PEFT's) reaches the kernel. ``None``:
                gate rows first.
            bias_like: ``{parameter name: original tensor}`` of the expert biases, which
                get placeholders too (their values live in ``weights``).
            order: the original module's parameter names in order; placeholders follow it.
            shared_by: local ranks mapping ``weights`` (one copy per machine), else 1.
        """
        super().__init__()
        self.expert_weights = weights
        self.spec = weights.spec
        self.num_experts = weights.spec.num_experts
        self.hidden_dim = weights.spec.hidden_size
        self.intermediate_dim = weights.spec.intermediate_size
        self.policy: Policy = policy
        self.shared_by = shared_by
        self.gate_up_name = gate_up_name
        self.down_name = down_name
        self.register_parameter(
            gate_up_name, make_placeholder(gate_up_like, f"{label}.{gate_up_name}")
        )
        self.register_parameter(down_name, make_placeholder(down_like, f"{label}.{down_name}"))
        for name, like in (bias_like or {}).items():
            self.register_parameter(name, make_placeholder(like, f"{label}.{name}"))
        if order:
            # The original module's parameter order (GPT-OSS: each bias after its weight), so
            # named_parameters() and state_dict() list the same names in the same order.
            rank = {n: i for i, n in enumerate(order)}
            self._parameters = dict(
                sorted(self._parameters.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            )
        self.arch = arch
        self.lora: kt_kernel.LoraBuffers | None = None
        # Extra dense "LoRA experts" (moe_experts.adapt(lora_experts=N)), child module
        # ``lora_experts``; their mean output is added to the routed experts' output.
        self.lora_experts: LoraExperts | None = None
        self._peft: _PeftAdoption | None = None
        # The host hand-over (moe_experts.hybrid): overlapped with the dense device's
        # independent work, and the most-routed experts resident on the dense device.
        self.overlap = False
        self.shared_cache: Any = None  # hybrid._SharedCache of the block's shared experts
        self.hot: Any = None  # hot_experts.HotExperts
        # False: the kernel runs without LoRA (no buffers passed) and the extra LoRA experts
        # are skipped; moe_experts.adapters_disabled switches it for the reference model.
        self.adapter_enabled = True

    @property
    def adopted_peft(self) -> bool:
        """True when the LoRA comes from PEFT ``ParamWrapper`` parameters (adopted in place)."""
        return self._peft is not None

    @property
    def kernel_lora(self) -> kt_kernel.LoraBuffers | None:
        """The LoRA buffers the kernel reads: own ``lora``, or the views of adopted PEFT tensors."""
        return self._peft.caller.lora if self._peft is not None else self.lora

    @property
    def peft_adapter(self) -> str | None:
        """Name of the adopted PEFT adapter (e.g. ``"default"``), or ``None``."""
        return None if self._peft is None else self._peft.adapter

    @property
    def peft_parameter_names(self) -> tuple[str, ...]:
        """Targeted expert parameter names in PEFT's wrapping order (innermost first)."""
        if self._peft is None:
            return ()
        return tuple(w.parameter_name for w in reversed(self._peft.wrappers))

    def set_lora(self, lora: kt_kernel.LoraBuffers) -> None:
        """Attach LoRA buffers as the child module ``lora`` (names ``<fqn>.lora.<buffer>``)."""
        self.lora = lora

    def adopt_peft(self, wrappers: tuple[ParamWrapper, ...], label: str) -> None:
        """Use the LoRA of PEFT's ``ParamWrapper`` chain (through views) instead of own buffers.

        The chain stays in the tree (PEFT keeps saving and loading its keys); only the
        outermost wrapper's forward changes, because PEFT would parametrize a weight that now
        lives in the kernel. Everything is validated before anything changes.

        Args:
            wrappers: the chain around the original experts module, outermost first.
            label: the experts module's qualified name, for messages.

        Raises:
            WrapError: targets other than the expert weights, several active adapters, or
                ranks/scalings that differ between the two projections.
        """
        gate_up_param = self.arch.gate_up_param if self.arch is not None else self.gate_up_name
        down_param = self.arch.down_param if self.arch is not None else self.down_name
        by_param = {w.parameter_name: w for w in wrappers}
        unknown = sorted(set(by_param) - {gate_up_param, down_param})
        if unknown:
            raise WrapError(
                f"{label}: PEFT target_parameters {unknown} are not expert weights "
                f"({gate_up_param}, {down_param}); remove them from target_parameters"
            )
        adapters = [a for a in wrappers[0].active_adapters if a in wrappers[0].lora_A]
        if len(adapters) != 1:
            raise WrapError(
                f"{label}: exactly one active PEFT adapter is supported on experts, "
                f"got {adapters}; call peft_model.set_adapter(name) first"
            )
        adapter = adapters[0]
        ranks = {w.r[adapter] for w in wrappers}
        scalings = {float(w.scaling[adapter]) for w in wrappers}
        if len(ranks) != 1 or len(scalings) != 1:
            raise WrapError(
                f"{label}: PEFT adapters on {sorted(by_param)} use ranks {sorted(ranks)} "
                f"and scalings {sorted(scalings)}; kt-kernel needs one rank and alpha per "
                "experts module (drop rank_pattern/alpha_pattern for experts)"
            )
        rank = ranks.pop()
        alpha = scalings.pop() * rank
        spec = self.spec
        sources: dict[str, tuple[nn.Parameter, str]] = {}
        tensors: dict[str, torch.Tensor] = {}
        for param_name, ours in ((gate_up_param, "gate_up"), (down_param, "down")):
            wrapper = by_param.get(param_name)
            out_dim = 2 * spec.intermediate_size if ours == "gate_up" else spec.hidden_size
            in_dim = spec.hidden_size if ours == "gate_up" else spec.intermediate_size
            if wrapper is None:
                # An untargeted projection contributes exactly zero (A = B = 0, no gradient).
                tensors[f"{ours}_lora_a"] = torch.zeros(spec.num_experts, rank, in_dim)
                tensors[f"{ours}_lora_b"] = torch.zeros(spec.num_experts, out_dim, rank)
                continue
            # peft types ModuleDict items as Module; a LoRA factor's ``weight`` is a Parameter.
            a = cast(nn.Parameter, wrapper.lora_A[adapter].weight)
            b = cast(nn.Parameter, wrapper.lora_B[adapter].weight)
            sources[f"{ours}_lora_a"] = (a, "a")
            sources[f"{ours}_lora_b"] = (b, "b")
            # Views of PEFT's storage: the kernel's buffers *are* PEFT's memory, no copy.
            tensors[f"{ours}_lora_a"] = peft_mapping.unstack_lora_a(a.detach(), spec.num_experts)
            tensors[f"{ours}_lora_b"] = peft_mapping.unstack_lora_b(b.detach(), spec.num_experts)
        buffers = kt_kernel.LoraBuffers.from_tensors(spec, rank, alpha, "fused", tensors)
        for p in buffers.parameters():
            p.requires_grad_(False)  # gradients go to PEFT's parameters through the views
        self._peft = _PeftAdoption(
            caller=_KernelCall(self.expert_weights, buffers),
            wrappers=wrappers,
            adapter=adapter,
            sources=sources,
        )
        # Instance-level override of PEFT's forward (see the docstring): deliberate.
        wrappers[0].forward = self.peft_forward  # type: ignore[method-assign, assignment]

    def call_lora(self, use_lora: bool = True) -> kt_kernel.LoraBuffers | None:
        """The LoRA as the kernel reads it, differentiable into the trained parameters.

        Own buffers (fused B rows reordered to gate first for an interleaved family), or views
        of adopted PEFT parameters; ``None`` without LoRA or when ``use_lora`` is false.
        """
        if not use_lora:
            return None
        if self._peft is None:
            return self._kernel_buffers(self.lora)
        lora = self._peft.caller.lora
        e = self.spec.num_experts
        views = {}
        for name, (param, kind) in self._peft.sources.items():
            stacked = (
                peft_mapping.unstack_lora_a(param, e)
                if kind == "a"
                else peft_mapping.unstack_lora_b(param, e)
            )
            views[name] = self._kernel_factor(name, stacked)
        for name in lora.names:  # untargeted factors: the zero buffers adopted with PEFT's
            views.setdefault(name, getattr(lora, name))
        return kt_kernel.LoraBuffers.from_tensors(
            lora.spec, lora.rank, lora.alpha, lora.layout, views
        )

    def lora_leaves(self, use_lora: bool = True) -> tuple[torch.Tensor, ...]:
        """The trainable leaf tensors behind :meth:`call_lora` (the parameters it reads)."""
        if not use_lora:
            return ()
        params: list[torch.Tensor]
        if self._peft is not None:
            params = [p for p, _ in self._peft.sources.values()]
        elif self.lora is not None:
            params = list(self.lora.tensors())
        else:
            params = []
        return tuple(p for p in params if p.requires_grad)

    def _run(
        self, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, use_lora: bool
    ) -> torch.Tensor:
        from moe_experts import hybrid

        if self.overlap or self.hot is not None or hybrid.host_replay() is not None:
            return hybrid.routed_experts(self, hidden, ids, w, use_lora)
        if hidden.device != self.expert_weights.device:
            return _on_kernel_device(self, hidden, ids, w, use_lora)
        x = hidden.to(self.expert_weights.dtype)
        if self._peft is not None and use_lora:
            views = {}
            e = self.spec.num_experts
            for name, (param, kind) in self._peft.sources.items():
                # Differentiable views: autograd delivers the gradient to PEFT's own parameter.
                views[f"lora.{name}"] = self._kernel_factor(
                    name,
                    peft_mapping.unstack_lora_a(param, e)
                    if kind == "a"
                    else peft_mapping.unstack_lora_b(param, e),
                )
            y: torch.Tensor = torch.func.functional_call(
                self._peft.caller, views, (x, ids, w, self.policy), strict=False
            )
        else:
            lora = self._kernel_buffers(self.lora) if use_lora else None
            y = kt_kernel.moe_experts_forward(
                x, ids, w, self.expert_weights, lora, policy=self.policy
            )
        if use_lora and self.lora_experts is not None:
            # torch types Module.__call__ as returning Any; LoraExperts.forward returns a Tensor.
            return y.to(hidden.dtype) + cast(torch.Tensor, self.lora_experts(hidden))
        return y.to(hidden.dtype)

    def _kernel_factor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A LoRA factor as the kernel reads it: fused B rows reordered to gate first."""
        if name != "gate_up_lora_b" or self.arch is None:
            return t
        return self.arch.kernel_rows(t, dim=1)

    def _kernel_buffers(self, lora: kt_kernel.LoraBuffers | None) -> kt_kernel.LoraBuffers | None:
        """``lora``, or for an interleaved family the same tensors with B's rows reordered."""
        if lora is None or self.arch is None or not self.arch.interleaved:
            return lora
        if lora.layout != "fused":  # split gate/up factors are already separate
            return lora
        tensors = {n: self._kernel_factor(n, getattr(lora, n)) for n in lora.names}
        # Parameters stay the same objects (registered again here); the reordered B is a
        # differentiable copy, so its gradient flows back into the trained B.
        return kt_kernel.LoraBuffers.from_tensors(
            lora.spec, lora.rank, lora.alpha, lora.layout, tensors
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``[T, H]`` routed expert output, same contract as transformers' experts module.

        Args:
            hidden_states: ``[T, H]`` tokens.
            top_k_index: ``[T, k]`` expert ids chosen by the model's own router.
            top_k_weights: ``[T, k]`` routing weights (gradients flow back into the router).

        Returns:
            ``[T, H]`` in ``hidden_states.dtype``.
        """
        return self._run(hidden_states, top_k_index, top_k_weights, use_lora=self.adapter_enabled)

    def peft_forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Forward installed on PEFT's outermost ``ParamWrapper``: honours disabled adapters.

        PEFT's own forward would parametrize the base weight, which now lives in the kernel;
        the kernel applies the same LoRA from the same PEFT tensors instead.
        """
        peft = self._peft
        enabled = peft is not None and not any(
            getattr(wr, "disable_adapters", False) for wr in peft.wrappers
        )
        if enabled and peft is not None:
            active = getattr(peft.wrappers[0], "active_adapters", [peft.adapter])
            enabled = peft.adapter in active
        return self._run(
            hidden_states, top_k_index, top_k_weights, use_lora=enabled and self.adapter_enabled
        )

    def extra_repr(self) -> str:
        """Spec, storage dtype and policy."""
        return (
            f"{self.spec}, weight_dtype={self.expert_weights.weight_dtype}, "
            f"policy={self.policy!r}, peft={self.adopted_peft}"
        )


def _peft_param_wrapper_type() -> type[ParamWrapper] | None:
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # peft is optional: without it no model can hold ParamWrappers
        return None
    return ParamWrapper


def unwrap_peft(module: nn.Module) -> tuple[tuple[ParamWrapper, ...], nn.Module]:
    """Split a PEFT ``ParamWrapper`` chain into (wrappers outermost first, innermost base)."""
    wrapper_type = _peft_param_wrapper_type()
    chain: list[ParamWrapper] = []
    while wrapper_type is not None and isinstance(module, wrapper_type):
        chain.append(module)
        module = module.base_layer
    return tuple(chain), module


def _on_kernel_device(
    experts: KernelExperts,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    use_lora: bool,
) -> torch.Tensor:
    """Dense layers on an accelerator, experts on the CPU kernel: copy over and back.

    ``Tensor.to`` is differentiable, so autograd carries ``dx`` and ``d topk_weights`` back to
    the caller's device. The device-to-host copies are asynchronous into pinned memory and then
    waited for once; the result goes back from pinned memory without blocking the host.
    """
    kernel_device = experts.expert_weights.device
    pinned = hidden.device.type == "cuda"
    x_c = hidden.to(kernel_device, non_blocking=pinned)
    ids_c = ids.to(kernel_device, non_blocking=pinned)
    w_c = w.to(kernel_device, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(hidden.device).synchronize()
    y = experts._run(x_c, ids_c, w_c, use_lora)
    if pinned:
        y = y.pin_memory()
    return y.to(hidden.device, non_blocking=pinned)
