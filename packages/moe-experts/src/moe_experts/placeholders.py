"""Zero-storage placeholders for expert weights that moved into kt-kernel.

Choice: a tensor *wrapper subclass* (``torch.Tensor._make_wrapper_subclass``) with no backing
allocation. Compared with the alternatives:

* a ``meta`` tensor breaks ``model.to("cpu")`` / ``model.cuda()`` ("cannot copy out of meta");
* a zero-stride ``expand`` view still owns one element, and ``.to(dtype)`` materialises the
  full logical tensor;
* the wrapper subclass keeps shape, dtype, device and ``requires_grad=False``, survives
  ``named_parameters()``, ``state_dict()`` (keys unchanged), ``model.to(dtype/device)`` and
  ``copy.deepcopy`` (which yield new placeholders), and is passed to FSDP2 as
  ``fully_shard(..., ignored_params=...)`` so FSDP never allocates, shards or broadcasts it.
  Any attempt to read its values raises :class:`~moe_experts.errors.PlaceholderAccessError`
  naming the parameter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from moe_experts.errors import PlaceholderAccessError

__all__ = ["ExpertPlaceholder", "is_placeholder", "make_placeholder", "named_placeholders"]

_aten = torch.ops.aten


class ExpertPlaceholder(torch.Tensor):
    """A tensor with a logical shape/dtype/device and no storage; its values live in kt-kernel."""

    label: str

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        label: str = "",
    ) -> ExpertPlaceholder:
        """Create a placeholder of ``shape``/``dtype`` on ``device`` (nothing is allocated)."""
        out = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=torch.device(device), requires_grad=False
        )
        out.label = label
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """All state is set in ``__new__``."""

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """Describe the placeholder without touching data."""
        return (
            f"ExpertPlaceholder({self.label or 'expert weight'}, shape={list(self.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Allow metadata-only ops (detach, alias, dtype/device moves); refuse everything else."""
        kwargs = kwargs or {}
        src = args[0] if args else None
        if isinstance(src, ExpertPlaceholder):
            # clone stays metadata-only so copy.deepcopy(model) works on a wrapped model.
            if func in (_aten.detach.default, _aten.alias.default, _aten.clone.default):
                return cls(src.shape, src.dtype, src.device, src.label)
            if func is _aten._to_copy.default:
                dtype = kwargs.get("dtype") or src.dtype
                device = kwargs.get("device") or src.device
                return cls(src.shape, dtype, device, src.label)
        label = next(
            (a.label for a in args if isinstance(a, ExpertPlaceholder) and a.label), "expert weight"
        )
        raise PlaceholderAccessError(
            f"{label} is a zero-storage placeholder: its values live in kt-kernel "
            f"(moe_experts.wrap moved them there), so {func} cannot run on it. Read the base "
            "weights through the wrapped experts module's `expert_weights` instead, and pass "
            "placeholders to FSDP as ignored_params"
        )


def make_placeholder(like: torch.Tensor, label: str) -> nn.Parameter:
    """Return a frozen zero-storage ``nn.Parameter`` with ``like``'s shape, dtype and device."""
    ph = ExpertPlaceholder(like.shape, like.dtype, like.device, label)
    param = nn.Parameter(ph, requires_grad=False)
    return param


def is_placeholder(tensor: object) -> bool:
    """Return True when ``tensor`` is an :class:`ExpertPlaceholder` (or a Parameter of one)."""
    return isinstance(tensor, ExpertPlaceholder)


def named_placeholders(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield ``(fqn, placeholder)`` for every placeholder parameter in ``model``."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if is_placeholder(param):
            yield name, param
