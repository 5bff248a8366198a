"""Per-expert LoRA tensors for the expert op, in the kernel's contiguous layouts."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch
from torch import nn

from kt_kernel.errors import KernelDTypeError, KernelInputError
from kt_kernel.spec import ExpertSpec, check_shape

__all__ = ["FUSED_NAMES", "SPLIT_NAMES", "LoraBuffers", "LoraLayout"]

LoraLayout = Literal["split", "fused"]
# Names are part of the public contract: moe-experts and checkpoints key on them.
SPLIT_NAMES: tuple[str, ...] = (
    "gate_lora_a",
    "gate_lora_b",
    "up_lora_a",
    "up_lora_b",
    "down_lora_a",
    "down_lora_b",
)
FUSED_NAMES: tuple[str, ...] = ("gate_up_lora_a", "gate_up_lora_b", "down_lora_a", "down_lora_b")


def lora_shapes(spec: ExpertSpec, rank: int, layout: str) -> dict[str, tuple[int, ...]]:
    """Return ``name -> shape`` of every LoRA tensor for ``layout``."""
    e, h, i, r = spec.num_experts, spec.hidden_size, spec.intermediate_size, rank
    if layout == "split":
        return {
            "gate_lora_a": (e, r, h),
            "gate_lora_b": (e, i, r),
            "up_lora_a": (e, r, h),
            "up_lora_b": (e, i, r),
            "down_lora_a": (e, r, i),
            "down_lora_b": (e, h, r),
        }
    if layout == "fused":
        return {
            "gate_up_lora_a": (e, r, h),
            "gate_up_lora_b": (e, 2 * i, r),
            "down_lora_a": (e, r, i),
            "down_lora_b": (e, h, r),
        }
    raise KernelInputError(f"layout must be 'split' or 'fused', got {layout!r}")


class LoraBuffers(nn.Module):
    """Trainable LoRA factors for every expert's gate, up and down projection.

    ``layout="split"`` holds an adapter per projection (per-expert ``nn.Linear`` PEFT):
    ``gate_lora_a [E, r, H]``, ``gate_lora_b [E, I, r]``, ``up_lora_a [E, r, H]``,
    ``up_lora_b [E, I, r]``, ``down_lora_a [E, r, I]``, ``down_lora_b [E, H, r]``.
    ``layout="fused"`` is PEFT ``target_parameters`` on fused experts: one adapter on gate_up
    (``gate_up_lora_a [E, r, H]``, ``gate_up_lora_b [E, 2I, r]``, gate rows first) and one on
    down. Each projection computes ``W x + scaling * B (A x)`` with ``scaling = alpha / rank``.
    The factors are ``nn.Parameter``s; the op's backward accumulates into their ``.grad``.

    Args:
        spec: expert shapes.
        rank: LoRA rank ``r`` (> 0).
        alpha: LoRA alpha; defaults to ``rank`` (scaling 1).
        layout: ``"split"`` or ``"fused"``.
        dtype: parameter dtype (the op casts to the compute dtype; gradients come back in this).
        init: optional ``init(name, tensor)`` called under ``torch.no_grad()`` to fill each
            tensor; without it every factor starts at zero (callers may copy values in).

    Raises:
        KernelInputError: non-positive rank or alpha, unknown layout.
    """

    def __init__(
        self,
        spec: ExpertSpec,
        rank: int,
        alpha: float | None = None,
        layout: LoraLayout = "split",
        *,
        dtype: torch.dtype = torch.float32,
        init: Callable[[str, torch.Tensor], None] | None = None,
        _tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Allocate (or adopt, via :meth:`from_tensors`) the LoRA factors."""
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise KernelInputError(f"rank must be a positive int, got {rank!r}")
        alpha = float(rank) if alpha is None else float(alpha)
        if not alpha > 0:
            raise KernelInputError(f"alpha must be > 0, got {alpha!r}")
        if not dtype.is_floating_point:
            raise KernelDTypeError(f"dtype must be a floating-point dtype, got {dtype}")
        self.spec = spec
        self.rank = rank
        self.alpha = alpha
        self.layout: LoraLayout = layout
        shapes = lora_shapes(spec, rank, layout)
        for name, shape in shapes.items():
            if _tensors is not None:
                tensor = check_shape(name, _tensors.get(name), shape)
                if not isinstance(tensor, nn.Parameter):
                    # A differentiable view of a tensor owned elsewhere: keep it as is so
                    # gradients flow back to its source (it is then not in parameters()).
                    setattr(self, name, tensor)
                    continue
                param = tensor
            else:
                param = nn.Parameter(torch.zeros(shape, dtype=dtype))
                if init is not None:
                    with torch.no_grad():
                        init(name, param)
            self.register_parameter(name, param)

    @classmethod
    def from_tensors(
        cls,
        spec: ExpertSpec,
        rank: int,
        alpha: float | None,
        layout: LoraLayout,
        tensors: Mapping[str, torch.Tensor],
    ) -> LoraBuffers:
        """Adopt existing tensors (shared, never copied).

        ``nn.Parameter`` values are registered as this module's parameters. Other tensors (for
        example a non-contiguous view of PEFT's stacked ``lora_B``) are kept as plain
        attributes, so the op's gradients flow through them to the tensor they view; they
        do not appear in ``parameters()`` but do in :meth:`named_lora_parameters`.

        Raises:
            KernelInputError: a name is missing or unexpected, or a shape is wrong.
        """
        expected = set(lora_shapes(spec, rank, layout))
        unknown = sorted(set(tensors) - expected)
        missing = sorted(expected - set(tensors))
        if unknown or missing:
            raise KernelInputError(
                f"tensors for layout {layout!r} must have keys {sorted(expected)}; "
                f"missing {missing}, unexpected {unknown}"
            )
        return cls(spec, rank, alpha, layout, _tensors=tensors)

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor on every low-rank term."""
        return self.alpha / self.rank

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in kernel order (stable, part of the public contract)."""
        return SPLIT_NAMES if self.layout == "split" else FUSED_NAMES

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The factors in :attr:`names` order."""
        return tuple(getattr(self, n) for n in self.names)

    def named_lora_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in :attr:`names` order, including adopted non-Parameter tensors."""
        for n in self.names:
            yield n, getattr(self, n)

    def extra_repr(self) -> str:
        """Spec, rank, alpha and layout."""
        return f"{self.spec}, rank={self.rank}, alpha={self.alpha}, layout={self.layout!r}"
