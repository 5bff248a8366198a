"""Hot experts: each MoE layer's most-routed experts resident on the dense device.

:func:`enable_gpu_experts` counts, per MoE layer, how many (token, slot) pairs each expert
receives over the first training forwards, then fixes the ``n`` most-routed experts (ties to
the lower id; summed over ranks under torch.distributed, so every rank holds the same set).
Their base weights are dequantised once from the kernel's storage and kept on the dense
device (bf16 on a GPU, fp32 on the CPU, where tests compare them with the host kernel
exactly); their LoRA stays the kernel's own parameters, sliced and copied for each call, so
there is one set of trained factors. The plain-PyTorch computation is the reference's math:
``W x (+ b) + (alpha / r) * B (A x)`` per projection, the expert's activation in between.
The host kernel runs the other experts' pairs. The set can be read back
(:meth:`GpuExperts.sets`) into a checkpoint and given to a resumed run
(:meth:`GpuExperts.restore`), which then skips the counting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import kt_kernel
from moe_experts.errors import WrapError

if TYPE_CHECKING:
    from moe_experts.kernel_experts import KernelExperts

__all__ = ["GpuExperts", "GpuExpertsError", "HotExperts", "enable_gpu_experts"]


class GpuExpertsError(WrapError):
    """A hot-expert setting does not fit the model (count, layer names, ids)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class HotExperts:
    """One MoE layer's routing counts and, once fixed, its resident experts.

    Attributes:
        n: how many experts to keep resident.
        ids: the resident experts' ids (ascending), once fixed.
        cold: ``[E]`` bool on the host: the experts the kernel still runs.
    """

    def __init__(
        self,
        experts: KernelExperts,
        n: int,
        device: torch.device,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Start counting for ``experts``; nothing is resident yet."""
        self.experts_ref = experts
        self.n = n
        self.device = torch.device(device)
        # bf16 on an accelerator (what it computes in); fp32 on the CPU: exact against the host.
        default = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.dtype = default if dtype is None else dtype
        e = experts.spec.num_experts
        self.counts = torch.zeros(e, dtype=torch.int64, device=self.device)
        self.counting = True
        self.ids: torch.Tensor | None = None
        self.cold: torch.Tensor | None = None
        self._lut: torch.Tensor | None = None
        self._gate_up: torch.Tensor | None = None
        self._down: torch.Tensor | None = None
        self._gate_up_bias: torch.Tensor | None = None
        self._down_bias: torch.Tensor | None = None

    @property
    def resident(self) -> bool:
        """Whether the set is fixed and its weights are on the dense device."""
        return self.ids is not None

    def observe(self, ids: torch.Tensor) -> None:
        """Count a training call's routing (``[T, k]`` ids; nothing once the set is fixed)."""
        if self.counting and torch.is_grad_enabled():
            e = self.counts.numel()
            flat = ids.reshape(-1).to(self.device, torch.int64)
            self.counts += torch.bincount(flat, minlength=e)[:e]

    def fix(self, ids: list[int] | None = None, counts: torch.Tensor | None = None) -> list[int]:
        """Make ``ids`` (or the ``n`` most-routed by ``counts``) resident; returns the ids.

        Raises:
            GpuExpertsError: an id outside ``[0, E)`` or a repeated id.
        """
        experts = self.experts_ref
        e = experts.spec.num_experts
        if ids is None:
            c = (self.counts if counts is None else counts).cpu().to(torch.int64)
            # Most routed first, the lower id on ties (a stable sort of -count).
            order = torch.sort(-c, stable=True).indices
            ids = sorted(int(i) for i in order[: self.n])
        if len(set(ids)) != len(ids) or any(not 0 <= i < e for i in ids):
            raise GpuExpertsError(f"hot experts {ids} must be distinct ids in [0, {e})")
        weights = experts.expert_weights
        self.ids = torch.tensor(ids, dtype=torch.int64)
        self.cold = torch.ones(e, dtype=torch.bool)
        self.cold[self.ids] = False
        lut = torch.full((e,), -1, dtype=torch.int64)
        lut[self.ids] = torch.arange(len(ids))
        self._lut = lut.to(self.device)

        def stack(get: Any) -> torch.Tensor:
            if not ids:
                return torch.empty(0, device=self.device, dtype=self.dtype)
            return torch.stack([get(i).to(self.dtype) for i in ids]).to(self.device)

        self._gate_up = stack(weights.expert_gate_up)  # [N, 2I, H], gate rows first
        self._down = stack(weights.expert_down)  # [N, H, I]
        gu_b, dn_b = weights.gate_up_bias, weights.down_bias
        self._gate_up_bias = None if gu_b is None else gu_b[self.ids].to(self.device, self.dtype)
        self._down_bias = None if dn_b is None else dn_b[self.ids].to(self.device, self.dtype)
        self.counting = False
        return list(ids)

    def resident_bytes(self) -> int:
        """Bytes the resident experts take on the dense device."""
        parts = (self._gate_up, self._down, self._gate_up_bias, self._down_bias)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def _factors(self, lora: kt_kernel.LoraBuffers) -> dict[str, torch.Tensor]:
        """The resident experts' LoRA factors on the dense device (differentiable copies)."""
        assert self.ids is not None
        return {
            name: t[self.ids].to(self.device, self.dtype)
            for name, t in lora.named_lora_parameters()
        }

    def forward(
        self,
        experts: KernelExperts,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        w: torch.Tensor,
        use_lora: bool,
    ) -> torch.Tensor:
        """``[T, H]`` fp32: the resident experts' share of the routed output.

        Args:
            experts: the layer's :class:`~moe_experts.KernelExperts` (for its LoRA).
            hidden: ``[T, H]`` on the dense device.
            ids: ``[T, k]`` expert ids.
            w: ``[T, k]`` routing weights.
            use_lora: whether the LoRA applies.
        """
        assert self.ids is not None
        assert self._lut is not None
        assert self._gate_up is not None
        assert self._down is not None
        t, k = ids.shape
        inter = experts.spec.intermediate_size
        act = experts.spec.activation
        y = torch.zeros(t, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        local = self._lut[ids.reshape(-1)]  # [T*k]: resident index, or -1
        rows = (local >= 0).nonzero().squeeze(1)
        which = local[rows]
        order = torch.sort(which, stable=True).indices
        rows, which = rows[order], which[order]
        sizes = torch.bincount(which, minlength=len(self.ids)).tolist()  # one sync per layer
        lora = experts.call_lora(use_lora)
        f = self._factors(lora) if lora is not None else {}
        s = lora.scaling if lora is not None else 0.0
        xc = hidden.to(self.dtype)
        wc = w.reshape(-1).to(self.dtype)
        start = 0
        for n, size in enumerate(sizes):
            if size == 0:
                continue
            r = rows[start : start + size]
            start += size
            tok = r // k
            xe = xc[tok]
            gu = xe @ self._gate_up[n].t()
            if self._gate_up_bias is not None:
                gu = gu + self._gate_up_bias[n]
            if lora is not None:
                if lora.layout == "fused":
                    gu = gu + s * ((xe @ f["gate_up_lora_a"][n].t()) @ f["gate_up_lora_b"][n].t())
                else:
                    gate = s * ((xe @ f["gate_lora_a"][n].t()) @ f["gate_lora_b"][n].t())
                    up = s * ((xe @ f["up_lora_a"][n].t()) @ f["up_lora_b"][n].t())
                    gu = gu + torch.cat([gate, up], dim=-1)
            h = act(gu[:, :inter], gu[:, inter:])
            o = h @ self._down[n].t()
            if self._down_bias is not None:
                o = o + self._down_bias[n]
            if lora is not None:
                o = o + s * ((h @ f["down_lora_a"][n].t()) @ f["down_lora_b"][n].t())
            y = y.index_add(0, tok, (o * wc[r].unsqueeze(-1)).float())
        return y


class GpuExperts:
    """The hot experts of a whole model: counting, fixing, checkpoint record, restore."""

    def __init__(self, model: nn.Module, layers: dict[str, HotExperts], count_calls: int) -> None:
        """Keep the per-layer state; :func:`enable_gpu_experts` builds this."""
        self.layers = layers
        self.count_calls = count_calls
        self.calls = 0
        self._hook = model.register_forward_pre_hook(self._before_forward)

    @property
    def fixed(self) -> bool:
        """Whether every layer's set is fixed."""
        return all(h.resident for h in self.layers.values())

    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        if self.fixed or not (module.training and torch.is_grad_enabled()):
            return
        if self.calls >= self.count_calls:
            self.fix()
        else:
            self.calls += 1

    def fix(self) -> dict[str, list[int]]:
        """Fix every layer's set from its counts (summed over ranks); returns the sets."""
        import torch.distributed as dist

        names = list(self.layers)
        counts = torch.stack([self.layers[n].counts.cpu() for n in names]) if names else None
        if counts is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)  # every rank the same set
        for i, name in enumerate(names):
            assert counts is not None
            self.layers[name].fix(counts=counts[i])
        return self.sets()

    def sets(self) -> dict[str, list[int]]:
        """``{experts module name: resident ids}`` of the fixed layers (for a checkpoint)."""
        return {
            name: [int(i) for i in h.ids] for name, h in self.layers.items() if h.ids is not None
        }

    def restore(self, sets: Mapping[str, Any]) -> None:
        """Make a recorded set resident again (a resumed run), skipping the counting.

        Raises:
            GpuExpertsError: the record names other layers, or another count of experts.
        """
        if set(sets) != set(self.layers):
            missing = sorted(set(self.layers) - set(sets))[:3]
            extra = sorted(set(sets) - set(self.layers))[:3]
            raise GpuExpertsError(
                f"the recorded hot experts do not match this model's MoE layers (missing "
                f"{missing}, unknown {extra}); resume with the model the checkpoint was "
                "trained on"
            )
        for name, ids in sets.items():
            hot = self.layers[name]
            if not isinstance(ids, list) or len(ids) != hot.n:
                raise GpuExpertsError(
                    f"{name}: the checkpoint records {ids!r} as hot experts, but this run "
                    f"keeps {hot.n} per layer; resume with --gpu-experts "
                    f"{len(ids) if isinstance(ids, list) else '?'}"
                )
            hot.fix(ids=[int(i) for i in ids])

    def resident_bytes(self) -> int:
        """Bytes of every resident expert on the dense device."""
        return sum(h.resident_bytes() for h in self.layers.values())

    def remove(self) -> None:
        """Put every expert back on the host kernel."""
        self._hook.remove()
        for h in self.layers.values():
            h.experts_ref.hot = None


def enable_gpu_experts(
    model: nn.Module,
    n: int,
    *,
    count_calls: int = 1,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> GpuExperts:
    """Keep each MoE layer's ``n`` most-routed experts resident on the dense device.

    Args:
        model: a wrapped model (experts on kt-kernel).
        n: experts per layer, ``1 <= n <= E``.
        count_calls: training forwards counted before the sets are fixed (at the start of
            the next training forward).
        device: the dense device (default: the input embedding's).
        dtype: the resident weights' dtype (default: bf16 on an accelerator, fp32 on the CPU).

    Returns:
        The :class:`GpuExperts` handle (``fix``, ``sets``, ``restore``, ``remove``).

    Raises:
        GpuExpertsError: ``n`` outside ``[1, E]`` or a model without routed experts on kt-kernel.
    """
    from moe_experts.wrapping import experts_sites

    sites = experts_sites(model)
    if not sites:
        raise GpuExpertsError("the model has no routed experts on kt-kernel; wrap it first")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GpuExpertsError(f"n must be a positive int (experts per layer), got {n!r}")
    if device is None:
        getter: Any = getattr(model, "get_input_embeddings", None)
        embed = getter() if callable(getter) else None
        weight = getattr(embed, "weight", None)
        device = _local(weight).device if isinstance(weight, torch.Tensor) else "cpu"
    layers: dict[str, HotExperts] = {}
    for site, experts in sites:
        e = experts.spec.num_experts
        if n > e:
            raise GpuExpertsError(
                f"n={n} hot experts, but {site.experts_name} has {e} routed experts; pass at "
                f"most {e}"
            )
        hot = HotExperts(experts, n, torch.device(device), dtype)
        experts.hot = layers[site.experts_name] = hot
    return GpuExperts(model, layers, count_calls)
