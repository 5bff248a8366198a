"""``LoRALinear``: a frozen ``nn.Linear`` plus a trainable low-rank update.

The attribute layout (``base_layer``, ``lora_A``, ``lora_B``) is a contract: it gives the
state-dict suffixes ``.base_layer.weight``, ``.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]`` that PEFT uses in ``adapter_model.safetensors``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lora_core.initialization import init_lora_tensor

__all__ = ["AdapterStateError", "LoRALinear", "LoRAParameter", "adapters_disabled"]


class AdapterStateError(RuntimeError):
    """An adapter cannot be switched off in its current state (it is merged into the base)."""


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def _full(t: torch.Tensor) -> torch.Tensor:
    """Plain tensor with the global value of ``t`` (gathers a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class _LoRAFactors(nn.Module):
    """The trainable pair ``lora_A [r, in]`` / ``lora_B [out, r]`` around a frozen base.

    Shared by :class:`LoRALinear` and :class:`LoRAParameter`: building the factors, their
    deterministic values, the delta ``scaling * B @ A`` and folding it into the base weight
    are the same whatever the base is; only how the delta reaches the output differs.
    """

    base_layer: nn.Module

    def _init_factors(
        self,
        base_layer: nn.Module,
        weight: torch.Tensor,
        rank: int,
        alpha: float,
        *,
        fqn: str,
        init_seed: int,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"{type(self).__name__} rank must be a positive int, got {rank!r}")
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, int | float)
            or not (math.isfinite(alpha) and alpha > 0)
        ):
            raise ValueError(
                f"{type(self).__name__} alpha must be a positive number, got {alpha!r}"
            )
        out_features, in_features = weight.shape
        device = weight.device if device is None else torch.device(device)
        dtype = weight.dtype if dtype is None else dtype
        self.base_layer = base_layer
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.merged = False
        # False: the layer computes its base alone (see adapters_disabled); the factors stay.
        self.adapter_enabled = True
        self.fqn = fqn
        self.init_seed = init_seed
        self.lora_A = nn.Linear(in_features, rank, bias=False, device="meta", dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device="meta", dtype=dtype)
        # Built on meta first: nn.Linear's own init would consume the global RNG for nothing.
        if device.type != "meta":
            self.lora_A.to_empty(device=device)
            self.lora_B.to_empty(device=device)
            self.reset_lora_parameters()
        for p in base_layer.parameters():
            p.requires_grad_(False)

    @property
    def base_weight(self) -> torch.Tensor:
        """The frozen ``[out, in]`` weight that the update applies to."""
        raise NotImplementedError

    @torch.no_grad()
    def reset_lora_parameters(self) -> int:
        """Fill ``lora_A``/``lora_B`` from :func:`lora_core.init_lora_tensor`; returns 2.

        Handles DTensor parameters (e.g. sharded by FSDP2): the full value is computed on
        every rank and only the local shard is copied, with no communication.

        Raises:
            RuntimeError: if the parameters are still on the meta device.
        """
        for leaf, lin in (("lora_A", self.lora_A), ("lora_B", self.lora_B)):
            _fill(lin.weight, _join(self.fqn, leaf), self.init_seed)
        return 2

    def delta_weight(self) -> torch.Tensor:
        """The update ``scaling * B @ A`` as a plain ``[out, in]`` tensor in float32."""
        a = _full(self.lora_A.weight).float()
        b = _full(self.lora_B.weight).float()
        return (b @ a) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the base weight (no-op if already merged).

        The delta is computed in float32 and rounded once into the base dtype, so
        :meth:`unmerge` restores the weight up to that dtype's rounding.
        """
        if self.merged:
            return
        _add_into(self.base_weight, self.delta_weight())
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update from the base weight again (no-op if not merged)."""
        if not self.merged:
            return
        _add_into(self.base_weight, -self.delta_weight())
        self.merged = False

    @property
    def adds_update(self) -> bool:
        """Whether the forward adds ``scaling * B @ A`` (enabled and not folded into the base)."""
        return self.adapter_enabled and not self.merged

    def extra_repr(self) -> str:
        """Rank, alpha, scaling and merge state for ``repr``."""
        off = "" if self.adapter_enabled else ", adapter_enabled=False"
        return (
            f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}, "
            f"merged={self.merged}{off}"
        )


class LoRALinear(_LoRAFactors):
    """``y = base(x) + (alpha / rank) * B(A(dropout(x)))`` around a frozen ``nn.Linear``.

    Args:
        base_layer: the ``nn.Linear`` to adapt (``[out, in]`` weight, optional bias). Its
            parameters are frozen (``requires_grad=False``) and kept as they are.
        rank: LoRA rank ``r`` (positive).
        alpha: LoRA alpha (positive); ``scaling = alpha / rank``.
        dropout: dropout probability on the LoRA branch input, in ``[0, 1)``.
        fqn: fully-qualified name of this module in its model; the adapter values are
            ``init_lora_tensor(f"{fqn}.lora_A" / f"{fqn}.lora_B", ..., seed=init_seed)``.
        init_seed: ``LoraConfig.init_seed``.
        device: device of ``lora_A``/``lora_B`` (default: the base weight's). On ``meta`` no
            values are built; fill them later with :meth:`reset_lora_parameters`.
        dtype: dtype of ``lora_A``/``lora_B`` (default: the base weight's).

    Attributes:
        base_layer: the wrapped ``nn.Linear``.
        lora_A: ``nn.Linear(in, r, bias=False)``; weight ``[r, in]``.
        lora_B: ``nn.Linear(r, out, bias=False)``; weight ``[out, r]``, zeros at init.
        rank, alpha, scaling: as above.
        merged: whether the update is currently folded into ``base_layer.weight``.

    Raises:
        TypeError: if ``base_layer`` is not an ``nn.Linear``.
        ValueError: if ``rank``, ``alpha`` or ``dropout`` is out of range.
    """

    # Narrows the base class's nn.Module: the constructor accepts only an nn.Linear.
    base_layer: nn.Linear

    def __init__(
        self,
        base_layer: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        *,
        fqn: str = "",
        init_seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(
                f"LoRALinear base_layer must be an nn.Linear, got {type(base_layer).__name__}"
            )
        if not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRALinear dropout must be in [0, 1), got {dropout!r}")
        self._init_factors(
            base_layer,
            base_layer.weight,
            rank,
            alpha,
            fqn=fqn,
            init_seed=init_seed,
            device=device,
            dtype=dtype,
        )
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def base_weight(self) -> torch.Tensor:
        """``base_layer.weight``, ``[out, in]``."""
        return self.base_layer.weight

    @property
    def in_features(self) -> int:
        """Input features of the wrapped layer."""
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        """Output features of the wrapped layer."""
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``[..., in]``; returns ``[..., out]``."""
        result: torch.Tensor = self.base_layer(x)
        if not self.adds_update:
            return result
        lora_dtype = self.lora_A.weight.dtype
        h = self.dropout(x if x.dtype == lora_dtype else x.to(lora_dtype))
        update: torch.Tensor = self.lora_B(self.lora_A(h)) * self.scaling
        return result + update.to(result.dtype)


class LoRAParameter(_LoRAFactors):
    """A module whose 2-D parameter ``W [out, in]`` is used as ``W + (alpha / rank) * B @ A``.

    For weights that are not an ``nn.Linear``'s, such as the routers of Qwen-MoE, Mixtral,
    OLMoE and DeepSeek (a bare ``weight [E, H]`` used by a custom ``forward``). The wrapped
    module runs its own ``forward`` unchanged, with the adapted weight swapped in for the
    call (``torch.func.functional_call``), so gradients reach ``lora_A``/``lora_B`` through
    whatever the module does with the weight. The twin of PEFT's ``target_parameters``
    (``ParamWrapper``) on a 2-D parameter: same ``lora_A [r, in]``/``lora_B [out, r]`` keys,
    same delta. No dropout: the input cannot be factored out of ``B @ A``.

    Attribute reads that this wrapper does not define go to the wrapped module (routers keep
    ``top_k``, ``num_experts`` ...); reading the adapted parameter by its name returns the
    weight the module actually uses (base plus update), not the frozen base alone.

    Args:
        base_layer: the module owning the parameter; its parameters are frozen.
        parameter_name: the attribute name of the 2-D parameter in ``base_layer``.
        rank, alpha, fqn, init_seed, device, dtype: as for :class:`LoRALinear`; ``fqn`` is
            the module's name, so the values are ``init_lora_tensor(f"{fqn}.lora_A", ...)``.

    Raises:
        TypeError: if ``base_layer`` has no tensor parameter ``parameter_name``.
        ValueError: if the parameter is not 2-D, or ``rank``/``alpha`` is out of range.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        parameter_name: str,
        rank: int,
        alpha: float,
        *,
        fqn: str = "",
        init_seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        weight = base_layer._parameters.get(parameter_name)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"LoRAParameter: {type(base_layer).__name__} has no parameter "
                f"{parameter_name!r}; its parameters are {list(base_layer._parameters)}"
            )
        if weight.dim() != 2:
            raise ValueError(
                f"LoRAParameter: {_join(fqn, parameter_name)} has shape {list(weight.shape)}; "
                "only 2-D [out, in] weights take a LoRA update (expert banks get theirs "
                "from moe_experts.adapt)"
            )
        self.parameter_name = parameter_name
        self._init_factors(
            base_layer,
            weight,
            rank,
            alpha,
            fqn=fqn,
            init_seed=init_seed,
            device=device,
            dtype=dtype,
        )

    @property
    def base_weight(self) -> torch.Tensor:
        """The wrapped module's frozen parameter, ``[out, in]``."""
        weight = self.base_layer._parameters[self.parameter_name]
        if weight is None:
            raise TypeError(
                f"LoRAParameter {self.fqn!r}: the wrapped {type(self.base_layer).__name__} no "
                f"longer has parameter {self.parameter_name!r}; do not reassign it to None"
            )
        return weight

    def adapted_weight(self) -> torch.Tensor:
        """``W + scaling * B @ A`` in ``W``'s dtype, differentiable in ``lora_A``/``lora_B``."""
        w = self.base_weight
        if not self.adds_update:
            return w
        a, b = _local(self.lora_A.weight), _local(self.lora_B.weight)
        # Same association and rounding as PEFT: (B @ A) * scaling, cast, then added to W.
        return w + ((b @ a) * self.scaling).to(w.dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's own ``forward`` with the adapted weight in place."""
        if not self.adds_update:
            return self.base_layer(*args, **kwargs)
        return torch.func.functional_call(
            self.base_layer, {self.parameter_name: self.adapted_weight()}, args, kwargs
        )

    def __getattr__(self, name: str) -> Any:
        """Fall back to the wrapped module for attributes this wrapper does not define."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_layer", "parameter_name", "lora_A", "lora_B"):
                raise
            if name == self.parameter_name:
                return self.adapted_weight()
            return getattr(super().__getattr__("base_layer"), name)

    def extra_repr(self) -> str:
        """The adapted parameter, rank, alpha, scaling and merge state for ``repr``."""
        return f"parameter={self.parameter_name!r}, {super().extra_repr()}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a replicated DTensor adapter (differentiable), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_target(p: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(destination, value)``: the local shard of ``p`` and the matching slice."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        full = full.to(device=p.to_local().device)
        # Every rank computes the same full value, so no data needs to travel from rank 0.
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        return p.to_local(), local.to_local()
    return p, full


def _fill(p: torch.Tensor, name: str, seed: int) -> None:
    if p.is_meta:
        raise RuntimeError(
            f"cannot initialise {name}: its parameter is on the meta device; materialise the "
            "model first (e.g. model.to_empty(device=...))"
        )
    full = init_lora_tensor(name, tuple(p.shape), p.dtype, seed=seed)
    dst, value = _local_target(p, full)
    dst.copy_(value)


def _add_into(w: torch.Tensor, delta: torch.Tensor) -> None:
    dst, value = _local_target(w, delta)
    dst.copy_((dst.float() + value.to(dst.device)).to(dst.dtype))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with every lora-core adapter switched off: the frozen base alone.

    Each :class:`LoRALinear` and :class:`LoRAParameter` under ``model`` computes its base
    layer only (no LoRA matmul, no dropout); the factors are kept and their previous state
    comes back on exit, also when the block raises. Nesting is allowed. This is the reference
    model of preference training without a second copy of the weights.

    Args:
        model: any module; adapters are found by type, wherever they sit.

    Raises:
        AdapterStateError: an adapter is merged into its base weight (unmerge it first).
    """
    layers = [m for m in model.modules() if isinstance(m, _LoRAFactors)]
    merged = [m.fqn or type(m).__name__ for m in layers if m.merged]
    if merged:
        raise AdapterStateError(
            f"cannot switch off adapters that are merged into their base weights "
            f"({', '.join(merged[:3])}{' ...' if len(merged) > 3 else ''}); call unmerge() first"
        )
    before = [m.adapter_enabled for m in layers]
    for m in layers:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m, state in zip(layers, before, strict=True):
            m.adapter_enabled = state
