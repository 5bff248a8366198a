"""Architecture specs: where each supported MoE family keeps its experts, router and weights.

transformers 5.x stores the routed experts of every family below as one module holding fused
3D parameters ``gate_up_proj [E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up, split with
``chunk(2, dim=-1)`` after ``F.linear``) and ``down_proj [E, H, I]``, called by the MoE block
as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. The block's router is
left untouched by :func:`moe_experts.wrap`, so routing stays bit-identical to transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn

from moe_experts.errors import UnsupportedModelError

__all__ = [
    "ARCHITECTURES",
    "MoEArchitecture",
    "MoEBlockSite",
    "find_architecture",
    "iter_moe_blocks",
]


@dataclass(frozen=True)
class MoEArchitecture:
    """Where one MoE family keeps its routed experts, router and shared experts.

    Attributes:
        family: registry key, e.g. ``"qwen3_moe"``.
        model_types: ``config.model_type`` values this spec serves.
        modeling_module: the transformers module defining the classes below.
        block_class: class name of the sparse MoE block (the module that owns router + experts).
        experts_attr: attribute of the block holding the routed experts module.
        router_attr: attribute of the block holding the router (gets dense LoRA, not ours).
        shared_expert_attrs: attributes of the block with always-on dense experts (and their
            gate); they stay ordinary modules that ``lora_core.enable_lora_training`` can target.
        gate_up_param: fused ``[E, 2I, H]`` parameter name inside the experts module.
        down_param: ``[E, H, I]`` parameter name inside the experts module.
        num_experts_config: config attribute giving E.
        intermediate_config: config attribute giving the routed expert width I.
    """

    family: str
    model_types: tuple[str, ...]
    modeling_module: str
    block_class: str
    experts_attr: str = "experts"
    router_attr: str = "gate"
    shared_expert_attrs: tuple[str, ...] = ()
    gate_up_param: str = "gate_up_proj"
    down_param: str = "down_proj"
    num_experts_config: str = "num_experts"
    intermediate_config: str = "moe_intermediate_size"
    # Only fused 3D experts exist in transformers 5.x for these families; per-expert Linear
    # (transformers 4.x) would be a second layout.
    layout: Literal["fused_3d"] = "fused_3d"

    def block_type(self) -> type[nn.Module]:
        """Import and return the MoE block class from transformers.

        Raises:
            UnsupportedModelError: the installed transformers lacks the module or class.
        """
        try:
            module = importlib.import_module(self.modeling_module)
            return getattr(module, self.block_class)
        except (ImportError, AttributeError) as exc:
            raise UnsupportedModelError(
                f"architecture {self.family!r} expects {self.modeling_module}.{self.block_class}, "
                "which the installed transformers does not provide; install transformers>=5.0"
            ) from exc


ARCHITECTURES: dict[str, MoEArchitecture] = {
    spec.family: spec
    for spec in (
        MoEArchitecture(
            family="qwen3_moe",
            model_types=("qwen3_moe",),
            modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
            block_class="Qwen3MoeSparseMoeBlock",
        ),
        MoEArchitecture(
            family="qwen2_moe",
            model_types=("qwen2_moe",),
            modeling_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
            block_class="Qwen2MoeSparseMoeBlock",
            shared_expert_attrs=("shared_expert", "shared_expert_gate"),
        ),
        MoEArchitecture(
            family="mixtral",
            model_types=("mixtral",),
            modeling_module="transformers.models.mixtral.modeling_mixtral",
            block_class="MixtralSparseMoeBlock",
            num_experts_config="num_local_experts",
            intermediate_config="intermediate_size",
        ),
        MoEArchitecture(
            family="deepseek_v3",
            model_types=("deepseek_v3",),
            modeling_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
            block_class="DeepseekV3MoE",
            shared_expert_attrs=("shared_experts",),
            num_experts_config="n_routed_experts",
        ),
        MoEArchitecture(
            family="olmoe",
            model_types=("olmoe",),
            modeling_module="transformers.models.olmoe.modeling_olmoe",
            block_class="OlmoeSparseMoeBlock",
            intermediate_config="intermediate_size",
        ),
    )
}


@dataclass(frozen=True)
class MoEBlockSite:
    """One MoE block found in a model: its qualified name, the block and its spec."""

    name: str  # fully-qualified block name, e.g. "model.layers.3.mlp"
    block: nn.Module
    arch: MoEArchitecture

    @property
    def experts_name(self) -> str:
        """Fully-qualified name of the routed experts module."""
        return f"{self.name}.{self.arch.experts_attr}" if self.name else self.arch.experts_attr


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return model_type if isinstance(model_type, str) else None


def find_architecture(model: nn.Module) -> MoEArchitecture:
    """Return the spec for ``model`` (a transformers model or a PEFT model around one).

    Args:
        model: the model, identified by ``model.config.model_type`` or by the MoE block classes
            it contains.

    Returns:
        The matching :class:`MoEArchitecture`.

    Raises:
        UnsupportedModelError: no spec matches; the message lists the supported families.
    """
    model_type = _model_type(model)
    for spec in ARCHITECTURES.values():
        if model_type in spec.model_types:
            return spec
    classes = {type(m) for m in model.modules()}
    for spec in ARCHITECTURES.values():
        try:
            if spec.block_type() in classes:
                return spec
        except UnsupportedModelError:
            continue
    supported = ", ".join(f"{s.family} ({s.block_class})" for s in ARCHITECTURES.values())
    raise UnsupportedModelError(
        f"model {type(model).__name__} (model_type={model_type!r}) is not a supported MoE "
        f"family; supported families: {supported}. Add a MoEArchitecture to "
        "moe_experts.ARCHITECTURES for a new family."
    )


def iter_moe_blocks(model: nn.Module, arch: MoEArchitecture) -> Iterator[MoEBlockSite]:
    """Yield every MoE block of ``arch`` in ``model`` in module order (dense layers are skipped)."""
    block_type = arch.block_type()
    for name, module in model.named_modules():
        if isinstance(module, block_type):
            yield MoEBlockSite(name=name, block=module, arch=arch)
