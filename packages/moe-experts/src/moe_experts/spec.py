"""Architecture specs: where each supported MoE family keeps its experts, router and weights.

transformers 5.x stores the routed experts of every supported family
(:mod:`moe_experts.families`) as one module holding fused 3D parameters, by default
``gate_up_proj [E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up, split with
``chunk(2, dim=-1)`` after ``F.linear``) and ``down_proj [E, H, I]``, called by the MoE block
as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. A family that stores
them otherwise (GPT-OSS: transposed ``[E, H, 2I]`` / ``[E, I, H]``, gate and up interleaved,
with biases) says so in its spec's layout fields, and the spec's methods are the one place
that converts that layout into kt-kernel's. The block's router is left untouched by
:func:`moe_experts.wrap`, so routing stays bit-identical to transformers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from moe_experts.errors import TransformersVersionError, UnsupportedModelError
from moe_experts.isolation import Packing

__all__ = ["TRANSFORMERS_FLOOR", "MoEArchitecture"]

# moe-experts' own transformers floor (``transformers>=5.1`` in its pyproject.toml): the
# minimum of every family that does not ask for more.
TRANSFORMERS_FLOOR = "5.1"


def _installed_transformers() -> str:
    """The version of the transformers that ``import transformers`` gives."""
    import transformers

    return str(transformers.__version__)


@dataclass(frozen=True)
class MoEArchitecture:
    """Where one MoE family keeps its routed experts, router and shared experts.

    Attributes:
        family: registry key, e.g. ``"qwen3_moe"``.
        model_types: ``config.model_type`` values this spec serves (a multimodal family lists
            its top-level type and its text model's type).
        modeling_module: the transformers module defining the classes below.
        block_class: class name of the sparse MoE block (the module that owns router + experts).
        experts_attr: attribute of the block holding the routed experts module.
        router_attr: attribute of the block holding the router (gets dense LoRA, not ours).
        router_param: the router's 2-D weight ``[E, H]`` relative to ``router_attr``
            (``"weight"``, or ``"wg.weight"`` where the router wraps an ``nn.Linear``).
        shared_expert_attrs: attributes of the block with always-on dense experts; they stay
            ordinary modules that ``lora_core.enable_lora_training`` can target.
        shared_expert_gate_attr: attribute of the block with the shared experts' sigmoid gate.
        gate_up_param: fused gate/up parameter name inside the experts module.
        down_param: down parameter name inside the experts module.
        router: one line on the routing function, for the documentation table.
        block_enabled_attr: boolean attribute of the block saying whether this instance holds
            routed experts, for a family whose block class also serves dense layers (Gemma-4's
            decoder layer holds ``experts`` beside its dense ``mlp`` only when
            ``enable_moe_block``); blocks where it is false are not MoE blocks.
        transposed: experts are stored ``x @ W`` style, ``gate_up [E, H, 2I]`` and
            ``down [E, I, H]`` (transformers' ``is_transposed``), instead of ``[E, 2I, H]`` /
            ``[E, H, I]``.
        interleaved: gate and up alternate along ``2I`` (gate ``0::2``, up ``1::2``;
            transformers' ``is_concatenated=False``) instead of gate first.
        gate_up_bias_param: frozen ``[E, 2I]`` bias of gate_up inside the experts module (same
            gate/up order as ``gate_up_param``), or ``None``.
        down_bias_param: frozen ``[E, H]`` bias of down, or ``None``.
        min_transformers: the oldest transformers release whose modeling code for this family
            matches this spec; older ones are refused by :meth:`check_transformers`.
        packing: how the examples packed into one row are kept apart
            (:class:`~moe_experts.isolation.Packing`); the fine-tune CLI and
            :meth:`Batch.model_inputs` read it, the coverage report prints it.
        packing_reason: why this family needs :attr:`packing`, for the coverage report.
    """

    family: str
    model_types: tuple[str, ...]
    modeling_module: str
    block_class: str
    experts_attr: str = "experts"
    router_attr: str = "gate"
    router_param: str = "weight"
    shared_expert_attrs: tuple[str, ...] = ()
    shared_expert_gate_attr: str | None = None
    gate_up_param: str = "gate_up_proj"
    down_param: str = "down_proj"
    router: str = "softmax top-k"
    block_enabled_attr: str | None = None
    # Only fused 3D experts exist in transformers 5.x for these families; per-expert Linear
    # (transformers 4.x) would be a second layout.
    layout: Literal["fused_3d"] = "fused_3d"
    # Why these are spec fields and not read from the module: load_pretrained converts the
    # checkpoint before any module exists; the module's own flags are checked against them.
    transposed: bool = False
    interleaved: bool = False
    gate_up_bias_param: str | None = None
    down_bias_param: str | None = None
    # Why a field: an older transformers may lack the family, or define the block with another
    # layout (per-expert Linear, no ``experts`` attribute), which would otherwise surface as a
    # raw AttributeError deep inside wrap.
    min_transformers: str = TRANSFORMERS_FLOOR
    # Why a field: whether restarting position_ids isolate packed examples depends on the
    # family's modeling code (its mask builders, its state-carrying layers), so each row says,
    # and the shared suite proves it against each example run alone.
    packing: Packing = Packing.POSITIONS
    packing_reason: str = "transformers builds block-diagonal masks from restarting position_ids"

    @property
    def bias_params(self) -> tuple[str, ...]:
        """The expert bias parameter names this family has (gate_up's first), maybe none."""
        return tuple(p for p in (self.gate_up_bias_param, self.down_bias_param) if p)

    def expert_dims(self, gate_up: torch.Tensor) -> tuple[int, int, int]:
        """``(E, I, H)`` of a stored gate_up tensor (``[E, 2I, H]``, or ``[E, H, 2I]``)."""
        e, a, b = gate_up.shape
        two_i, h = (b, a) if self.transposed else (a, b)
        return e, two_i // 2, h

    def stored_shapes(self, e: int, i: int, h: int) -> dict[str, tuple[int, ...]]:
        """The shape of every expert tensor this family stores, keyed by parameter name."""
        shapes: dict[str, tuple[int, ...]] = {
            self.gate_up_param: (e, h, 2 * i) if self.transposed else (e, 2 * i, h),
            self.down_param: (e, i, h) if self.transposed else (e, h, i),
        }
        if self.gate_up_bias_param:
            shapes[self.gate_up_bias_param] = (e, 2 * i)
        if self.down_bias_param:
            shapes[self.down_bias_param] = (e, h)
        return shapes

    def kernel_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """A view ``[E, 2, I, H]`` of a stored gate_up: ``[:, 0]`` gate, ``[:, 1]`` up.

        kt-kernel computes gate rows ``[0, I)`` then up rows ``[I, 2I)`` of ``[E, 2I, H]``;
        this view reorders any stored layout into that without copying.
        """
        _, i, _ = self.expert_dims(gate_up)
        if self.transposed:  # [E, H, 2I]
            split = (i, 2) if self.interleaved else (2, i)
            # [E, H, (I, 2) | (2, I)]; torch: Tensor.unflatten is unannotated
            v: torch.Tensor = gate_up.unflatten(2, split)  # type: ignore[no-untyped-call]
            return v.permute(0, 3, 2, 1) if self.interleaved else v.permute(0, 2, 3, 1)
        if self.interleaved:  # [E, 2I, H] with rows gate0, up0, gate1, ...
            # torch: Tensor.unflatten is unannotated
            return gate_up.unflatten(1, (i, 2)).transpose(1, 2)  # type: ignore[no-untyped-call, no-any-return]
        # torch: Tensor.unflatten is unannotated
        return gate_up.unflatten(1, (2, i))  # type: ignore[no-untyped-call, no-any-return]

    def kernel_down(self, down: torch.Tensor) -> torch.Tensor:
        """A view ``[E, H, I]`` (kt-kernel's layout) of a stored down tensor."""
        return down.transpose(1, 2) if self.transposed else down

    def kernel_rows(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Reorder ``dim`` (size 2I, in the family's gate/up order) to gate first, then up.

        Used for the gate_up bias ``[E, 2I]`` and the fused LoRA ``B [E, 2I, r]``, whose rows
        follow the stored weight's (as PEFT's do). Differentiable; a copy only when
        interleaved, else ``t`` itself.
        """
        if not self.interleaved:
            return t
        i = t.shape[dim] // 2
        # torch: Tensor.unflatten is unannotated
        return t.unflatten(dim, (i, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1)  # type: ignore[no-untyped-call, no-any-return]

    def check_transformers(self) -> None:
        """Refuse an installed transformers older than :attr:`min_transformers`.

        Raises:
            TransformersVersionError: names the family, both versions and the pip command.
        """
        from packaging.version import InvalidVersion, Version

        installed = _installed_transformers()
        try:
            # Compare release numbers only, so a 5.17.0.dev0 source build counts as 5.17.
            too_old = Version(installed).release < Version(self.min_transformers).release
        except InvalidVersion:
            return  # an unparsable local build: let the block-class lookup decide
        if too_old:
            raise TransformersVersionError(
                f"architecture {self.family!r} needs transformers>={self.min_transformers}, but "
                f"transformers {installed} is installed (older releases lack this family or "
                "define its MoE block with another layout); upgrade with: "
                f"pip install -U 'transformers>={self.min_transformers}'"
            )

    def block_type(self) -> type[nn.Module]:
        """Import and return the MoE block class from transformers.

        Raises:
            TransformersVersionError: the installed transformers is older than this family needs.
            UnsupportedModelError: the installed transformers lacks the module or class.
        """
        self.check_transformers()
        try:
            module = importlib.import_module(self.modeling_module)
            return cast("type[nn.Module]", getattr(module, self.block_class))
        except (ImportError, AttributeError) as exc:
            raise UnsupportedModelError(
                f"architecture {self.family!r} expects {self.modeling_module}.{self.block_class}, "
                "which the installed transformers does not provide; upgrade with: "
                f"pip install -U 'transformers>={self.min_transformers}'"
            ) from exc
