"""Typed contracts shared by every package of the toolkit.

Packages never reach into each other's modules: a producer (``lora_core.enable_lora_training``,
``moe_experts.adapt``) publishes an :class:`AdaptationResult`, and consumers (the optimizer
builder, ``lora_core.fsdp``, ``lora_checkpoint.save``) read only its typed fields.
"""

from __future__ import annotations

import collections
import enum
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lora_core.config import LoraConfig

__all__ = [
    "ADAPTATION_RESULT_SCHEMA_VERSION",
    "AdaptationResult",
    "ComponentVersion",
    "ContractError",
    "ParameterOwnership",
    "PeftExport",
    "PeftTensorLayout",
    "peft_lora_key",
]

# Bumped whenever a field is added, removed or changes meaning; readers refuse others.
ADAPTATION_RESULT_SCHEMA_VERSION = 1


class ContractError(ValueError):
    """A contract value is malformed or two contracts cannot be combined."""


class ParameterOwnership(enum.StrEnum):
    """Who holds the authoritative copy of a trainable tensor in a distributed run."""

    REPLICATED = "replicated"  # identical on every rank; gradients are averaged
    SHARDED = "sharded"  # split across ranks (an FSDP/DTensor shard)
    RANK_LOCAL = "rank_local"  # differs per rank by design; saved per rank
    RANK0 = "rank0"  # only rank 0 holds it


class PeftTensorLayout(enum.StrEnum):
    """How a tensor of ours maps onto the tensor PEFT stores under the same adapter key.

    The one place that codes PEFT's stacking of per-expert LoRA (``target_parameters`` on
    fused 3-D experts, ``peft.tuners.lora.layer.ParamWrapper``): :meth:`to_peft` and
    :meth:`from_peft`. moe-experts (adopting and exporting expert LoRA) and lora-checkpoint
    (writing ``adapter_model.safetensors``) both convert through it.
    """

    IDENTITY = "identity"  # same shape and element order
    # Per-expert A ``[E, r, in]`` <-> PEFT's stacked ``lora_A [E*r, in]`` (row e*r + j = A[e, j]).
    EXPERT_STACKED_A = "expert_stacked_a"
    # Per-expert B ``[E, out, r]`` <-> PEFT's stacked ``lora_B [out, r*E]``, rank-major:
    # col j*E + e = B[e, :, j]. PEFT's ParamWrapper reshapes lora_B to [out, r, E] (verified
    # against peft 0.21 in moe-experts' peft_mapping tests), unlike A, which is expert-major.
    EXPERT_STACKED_B = "expert_stacked_b"

    def to_peft(self, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor in the layout PEFT stores (a view where the layout allows one).

        Args:
            tensor: IDENTITY: any shape; EXPERT_STACKED_A: ``A [E, r, in]``;
                EXPERT_STACKED_B: ``B [E, out, r]``.

        Returns:
            IDENTITY: ``tensor``; A: ``[E*r, in]`` (row ``e*r + j`` = ``A[e, j]``); B:
            ``[out, r*E]`` (column ``j*E + e`` = ``B[e, :, j]``).

        Raises:
            ContractError: a stacked layout and a tensor that is not 3-D.
        """
        if self is PeftTensorLayout.IDENTITY:
            return tensor
        if tensor.dim() != 3:
            raise ContractError(
                f"PEFT layout {self.value} needs a 3-D tensor ([E, r, in] or [E, out, r]), "
                f"got shape {list(tensor.shape)}"
            )
        e, a, b = tensor.shape
        if self is PeftTensorLayout.EXPERT_STACKED_A:
            return tensor.reshape(e * a, b)
        return tensor.permute(1, 2, 0).reshape(a, b * e)

    def from_peft(self, tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The inverse of :meth:`to_peft`: a view of PEFT's tensor in our layout.

        Args:
            tensor: IDENTITY: any shape; EXPERT_STACKED_A: ``lora_A [E*r, in]``;
                EXPERT_STACKED_B: ``lora_B [out, r*E]``.
            num_experts: ``E``.

        Returns:
            IDENTITY: ``tensor``; A: ``[E, r, in]``; B: ``[E, out, r]`` (a non-contiguous
            view, so gradients through it reach PEFT's parameter).

        Raises:
            ContractError: a stacked layout and a tensor that is not 2-D with a stacked dim
                divisible by ``num_experts``.
        """
        if self is PeftTensorLayout.IDENTITY:
            return tensor
        stacked = 0 if self is PeftTensorLayout.EXPERT_STACKED_A else 1
        if tensor.dim() != 2 or num_experts < 1 or tensor.shape[stacked] % num_experts:
            raise ContractError(
                f"PEFT layout {self.value} needs a 2-D tensor whose dim {stacked} is a "
                f"multiple of num_experts={num_experts}, got shape {list(tensor.shape)}"
            )
        if self is PeftTensorLayout.EXPERT_STACKED_A:
            return tensor.reshape(num_experts, -1, tensor.shape[-1])
        return tensor.reshape(tensor.shape[0], -1, num_experts).permute(2, 0, 1)


def peft_lora_key(prefix: str, factor: str) -> str:
    """PEFT's key of a LoRA factor: ``f"{prefix}.lora_{factor}.weight"`` (factor ``A``/``B``).

    Raises:
        ContractError: ``factor`` is neither ``"A"`` nor ``"B"``.
    """
    if factor not in ("A", "B"):
        raise ContractError(f"a LoRA factor is 'A' or 'B', got {factor!r}")
    return f"{prefix}.lora_{factor}.weight"


@dataclass(frozen=True)
class PeftExport:
    """Where PEFT keeps one of our tensors: its key in ``adapter_model.safetensors`` and layout."""

    key: str  # e.g. "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    layout: PeftTensorLayout = PeftTensorLayout.IDENTITY

    def __post_init__(self) -> None:
        """Reject an empty key or a layout that is not a PeftTensorLayout."""
        if not isinstance(self.key, str) or not self.key:
            raise ContractError(f"PeftExport.key must be a non-empty str, got {self.key!r}")
        if not isinstance(self.layout, PeftTensorLayout):
            raise ContractError(
                f"PeftExport.layout must be a PeftTensorLayout, got {self.layout!r}"
            )


@dataclass(frozen=True, order=True)
class ComponentVersion:
    """A component (distribution) name and the version that produced a value."""

    name: str
    version: str

    def __post_init__(self) -> None:
        """Reject empty names or versions."""
        if not isinstance(self.name, str) or not self.name:
            raise ContractError(f"ComponentVersion.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.version, str) or not self.version:
            raise ContractError(
                f"ComponentVersion.version must be a non-empty str, got {self.version!r}"
            )

    @classmethod
    def of(cls, distribution: str) -> ComponentVersion:
        """Return the installed version of ``distribution`` (e.g. ``"lora-core"``)."""
        try:
            return cls(distribution, importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError as exc:
            raise ContractError(
                f"distribution {distribution!r} is not installed, so its version is unknown"
            ) from exc

    def to_json(self) -> dict[str, str]:
        """Return ``{"name": ..., "version": ...}``."""
        return {"name": self.name, "version": self.version}


def _freeze_mapping(value: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


@dataclass(frozen=True, eq=False)
class AdaptationResult:
    """What an adapter producer did to a model, as a frozen, typed value.

    Attributes:
        adapted_layers: fully-qualified names of the modules adapted by this call.
        already_adapted_layers: names that were already adapted and left as they were
            (a repeated call never double-wraps); ``len()`` counts the repeats.
        named_optimizer_parameters: ``(unique fqn, Parameter)`` for every trainable tensor,
            in a stable order shared by every rank.
        placeholders: names of zero-storage parameters kept only for their name and shape.
        rank_local_names: names of parameters that legitimately differ per rank.
        checkpoint_key_aliases: base checkpoint key -> key in the adapted module tree
            (``x.weight`` -> ``x.base_layer.weight``), for loaders that map state dicts.
        ownership: fqn -> :class:`ParameterOwnership` for every optimizer parameter.
        lora_config: the :class:`lora_core.LoraConfig` that drove the adaptation.
        producer: the component that produced this value.
        components: every component that contributed (grows through :meth:`merge`).
        peft_exports: fqn -> :class:`PeftExport` for every tensor PEFT can read; tensors
            without an entry are saved only in this toolkit's own files.
        peft_target_modules: module names for ``adapter_config.json`` ``target_modules``.
        peft_target_parameters: parameter names for PEFT's ``target_parameters``.
        missing_parameter_initializer: for the FSDP/meta-device path, a callable that fills
            adapter tensors a base checkpoint does not contain; returns how many it filled.
        schema_version: the contract version; unknown versions are refused.
    """

    adapted_layers: tuple[str, ...]
    named_optimizer_parameters: tuple[tuple[str, nn.Parameter], ...]
    ownership: Mapping[str, ParameterOwnership]
    producer: ComponentVersion
    lora_config: LoraConfig | None = None
    already_adapted_layers: tuple[str, ...] = ()
    placeholders: tuple[str, ...] = ()
    rank_local_names: tuple[str, ...] = ()
    checkpoint_key_aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    components: tuple[ComponentVersion, ...] = ()
    peft_exports: Mapping[str, PeftExport] = field(default_factory=lambda: MappingProxyType({}))
    peft_target_modules: tuple[str, ...] = ()
    peft_target_parameters: tuple[str, ...] = ()
    missing_parameter_initializer: Callable[[nn.Module], int] | None = None
    schema_version: int = ADAPTATION_RESULT_SCHEMA_VERSION

    def __post_init__(self) -> None:
        """Validate field types, name uniqueness and ownership coverage."""
        if self.schema_version != ADAPTATION_RESULT_SCHEMA_VERSION:
            raise ContractError(
                f"AdaptationResult.schema_version {self.schema_version!r} is not supported; "
                f"this lora-core reads version {ADAPTATION_RESULT_SCHEMA_VERSION}"
            )
        for name in (
            "adapted_layers",
            "already_adapted_layers",
            "named_optimizer_parameters",
            "placeholders",
            "rank_local_names",
            "components",
            "peft_target_modules",
            "peft_target_parameters",
        ):
            if not isinstance(getattr(self, name), tuple):
                raise ContractError(
                    f"AdaptationResult.{name} must be a tuple, got "
                    f"{type(getattr(self, name)).__name__}; build it with AdaptationResult.create"
                )
        for name in ("ownership", "checkpoint_key_aliases", "peft_exports"):
            if not isinstance(getattr(self, name), MappingProxyType):
                raise ContractError(
                    f"AdaptationResult.{name} must be a read-only mapping, got "
                    f"{type(getattr(self, name)).__name__}; build it with AdaptationResult.create"
                )
        if not isinstance(self.producer, ComponentVersion):
            raise ContractError(
                f"AdaptationResult.producer must be a ComponentVersion, got {self.producer!r}"
            )
        names = [n for n, _ in self.named_optimizer_parameters]
        # Counter, not names.count(): results with tens of thousands of expert tensors exist.
        dupes = sorted(n for n, c in collections.Counter(names).items() if c > 1)
        if dupes:
            raise ContractError(f"AdaptationResult has duplicate parameter names: {dupes}")
        for n, p in self.named_optimizer_parameters:
            if not isinstance(n, str) or not isinstance(p, torch.Tensor):
                raise ContractError(
                    f"named_optimizer_parameters entries must be (str, Parameter); got "
                    f"({n!r}, {type(p).__name__})"
                )
        missing = [n for n in names if n not in self.ownership]
        if missing:
            raise ContractError(f"AdaptationResult.ownership has no entry for {missing[:8]}")
        for n, o in self.ownership.items():
            if not isinstance(o, ParameterOwnership):
                raise ContractError(
                    f"AdaptationResult.ownership[{n!r}] must be a ParameterOwnership, got {o!r}"
                )
        stray = sorted(set(self.peft_exports) - set(names))
        if stray:
            raise ContractError(
                f"AdaptationResult.peft_exports names unknown parameters {stray[:8]}"
            )
        for n, e in self.peft_exports.items():
            if not isinstance(e, PeftExport):
                raise ContractError(
                    f"AdaptationResult.peft_exports[{n!r}] must be a PeftExport, got {e!r}"
                )
        if self.lora_config is not None:
            from lora_core.config import LoraConfig

            if not isinstance(self.lora_config, LoraConfig):
                raise ContractError(
                    "AdaptationResult.lora_config must be a lora_core.LoraConfig, got "
                    f"{type(self.lora_config).__name__}"
                )

    @classmethod
    def create(
        cls,
        *,
        adapted_layers: Iterable[str],
        named_optimizer_parameters: Iterable[tuple[str, nn.Parameter]],
        ownership: Mapping[str, ParameterOwnership | str],
        producer: ComponentVersion,
        lora_config: LoraConfig | None = None,
        already_adapted_layers: Iterable[str] = (),
        placeholders: Iterable[str] = (),
        rank_local_names: Iterable[str] = (),
        checkpoint_key_aliases: Mapping[str, str] | None = None,
        components: Iterable[ComponentVersion] | None = None,
        peft_exports: Mapping[str, PeftExport] | None = None,
        peft_target_modules: Iterable[str] = (),
        peft_target_parameters: Iterable[str] = (),
        missing_parameter_initializer: Callable[[nn.Module], int] | None = None,
    ) -> AdaptationResult:
        """Build a result from ordinary lists and dicts, freezing every container."""
        try:
            own = {k: ParameterOwnership(v) for k, v in ownership.items()}
        except ValueError as exc:
            raise ContractError(
                f"ownership values must be one of {[o.value for o in ParameterOwnership]}: {exc}"
            ) from exc
        comps = tuple(components) if components is not None else (producer,)
        return cls(
            adapted_layers=tuple(adapted_layers),
            named_optimizer_parameters=tuple((n, p) for n, p in named_optimizer_parameters),
            ownership=_freeze_mapping(own),
            producer=producer,
            lora_config=lora_config,
            already_adapted_layers=tuple(already_adapted_layers),
            placeholders=tuple(placeholders),
            rank_local_names=tuple(rank_local_names),
            checkpoint_key_aliases=_freeze_mapping(checkpoint_key_aliases or {}),
            components=comps,
            peft_exports=_freeze_mapping(peft_exports or {}),
            peft_target_modules=tuple(dict.fromkeys(peft_target_modules)),
            peft_target_parameters=tuple(dict.fromkeys(peft_target_parameters)),
            missing_parameter_initializer=missing_parameter_initializer,
        )

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Names of the optimizer parameters, in order."""
        return tuple(n for n, _ in self.named_optimizer_parameters)

    def parameters(self) -> list[nn.Parameter]:
        """The optimizer parameters, in order (ready for ``torch.optim``)."""
        return [p for _, p in self.named_optimizer_parameters]

    def merge(self, other: AdaptationResult) -> AdaptationResult:
        """Combine two results (e.g. dense and expert LoRA) into one.

        Raises:
            ContractError: if a parameter or placeholder name appears in both, if the same
                tensor is published under two names, or if the LoRA configs disagree.
        """
        if not isinstance(other, AdaptationResult):
            raise ContractError(f"merge expects an AdaptationResult, got {type(other).__name__}")
        clash = sorted(set(self.parameter_names) & set(other.parameter_names))
        clash += sorted(set(self.placeholders) & set(other.placeholders))
        if clash:
            raise ContractError(f"cannot merge AdaptationResults: duplicate names {clash}")
        ids = {id(p): n for n, p in self.named_optimizer_parameters}
        shared = [(ids[id(p)], n) for n, p in other.named_optimizer_parameters if id(p) in ids]
        if shared:
            raise ContractError(
                f"cannot merge AdaptationResults: the same tensor is published twice {shared}"
            )
        cfg = self.lora_config
        if cfg is None:
            cfg = other.lora_config
        elif other.lora_config is not None and other.lora_config != cfg:
            raise ContractError(
                "cannot merge AdaptationResults with different lora_config: "
                f"{cfg.model_dump()} vs {other.lora_config.model_dump()}"
            )
        alias_clash = sorted(
            k
            for k in set(self.checkpoint_key_aliases) & set(other.checkpoint_key_aliases)
            if self.checkpoint_key_aliases[k] != other.checkpoint_key_aliases[k]
        )
        if alias_clash:
            raise ContractError(f"cannot merge: conflicting checkpoint_key_aliases {alias_clash}")
        inits = [
            f
            for f in (self.missing_parameter_initializer, other.missing_parameter_initializer)
            if f is not None
        ]

        def _init_both(module: nn.Module) -> int:
            return sum(f(module) for f in inits)

        comps = tuple(dict.fromkeys(self.components + other.components))
        return AdaptationResult.create(
            adapted_layers=self.adapted_layers + other.adapted_layers,
            already_adapted_layers=self.already_adapted_layers + other.already_adapted_layers,
            named_optimizer_parameters=self.named_optimizer_parameters
            + other.named_optimizer_parameters,
            ownership={**self.ownership, **other.ownership},
            producer=self.producer,
            lora_config=cfg,
            placeholders=self.placeholders + other.placeholders,
            rank_local_names=self.rank_local_names + other.rank_local_names,
            checkpoint_key_aliases={**self.checkpoint_key_aliases, **other.checkpoint_key_aliases},
            components=comps,
            peft_exports={**self.peft_exports, **other.peft_exports},
            peft_target_modules=self.peft_target_modules + other.peft_target_modules,
            peft_target_parameters=self.peft_target_parameters + other.peft_target_parameters,
            missing_parameter_initializer=(
                inits[0] if len(inits) == 1 else _init_both if inits else None
            ),
        )

    def describe(self) -> dict[str, Any]:
        """Return a JSON-able summary without tensor values (shapes and dtypes only)."""
        return {
            "schema_version": self.schema_version,
            "producer": self.producer.to_json(),
            "components": [c.to_json() for c in self.components],
            "lora_config": None
            if self.lora_config is None
            else self.lora_config.model_dump(mode="json"),
            "adapted_layers": list(self.adapted_layers),
            "already_adapted_layers": list(self.already_adapted_layers),
            "parameters": [
                {
                    "name": n,
                    "shape": list(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "ownership": self.ownership[n].value,
                }
                for n, p in self.named_optimizer_parameters
            ],
            "placeholders": list(self.placeholders),
            "rank_local_names": list(self.rank_local_names),
            "checkpoint_key_aliases": dict(sorted(self.checkpoint_key_aliases.items())),
            "peft_exports": {
                n: {"key": e.key, "layout": e.layout.value}
                for n, e in sorted(self.peft_exports.items())
            },
            "peft_target_modules": list(self.peft_target_modules),
            "peft_target_parameters": list(self.peft_target_parameters),
        }
