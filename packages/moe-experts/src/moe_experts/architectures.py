"""Finding a model's family and its MoE blocks; the registry itself is in :mod:`.families`.

:data:`ARCHITECTURES` (one :class:`MoEArchitecture` per family, see :mod:`moe_experts.spec` for
what a row says) and :data:`UNSUPPORTED_FAMILIES` are re-exported here, with the functions that
match a model or a checkpoint directory to a row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from moe_experts.errors import LoadError, UnsupportedModelError
from moe_experts.families import ARCHITECTURES, UNSUPPORTED_FAMILIES
from moe_experts.spec import TRANSFORMERS_FLOOR, MoEArchitecture

__all__ = [
    "ARCHITECTURES",
    "TRANSFORMERS_FLOOR",
    "UNSUPPORTED_FAMILIES",
    "MoEArchitecture",
    "MoEBlockSite",
    "checkpoint_model_type",
    "find_architecture",
    "iter_moe_blocks",
    "lm_class",
    "require_transformers",
]


def require_transformers(model_type: str | None) -> None:
    """Refuse early when the installed transformers is too old for ``model_type``'s family.

    Called with a checkpoint's ``config.json`` ``model_type`` before transformers parses it, so
    an old release that does not know the type yields this error rather than its own.

    Args:
        model_type: ``config.model_type``; an unknown or missing type passes (the model is
            identified later by :func:`find_architecture`).

    Raises:
        TransformersVersionError: names the family, both versions and the pip command.
    """
    spec = _by_model_type(model_type)
    if spec is not None:
        spec.check_transformers()


def lm_class(model_type: str | None) -> Any:
    """The transformers auto class that builds ``model_type`` with its language-model head.

    ``AutoModelForCausalLM`` where transformers maps ``model_type`` to a causal LM; a multimodal
    type that it maps only to an image-text-to-text model (Qwen3-VL-MoE, GLM-4.5V, Aria,
    Mistral-Large-3) and Mistral 4 get ``AutoModelForImageTextToText``: the whole model, vision
    tower included, called with ``input_ids`` only.

    Args:
        model_type: ``config.model_type`` (e.g. from :func:`checkpoint_model_type`).

    Returns:
        ``AutoModelForCausalLM`` or ``AutoModelForImageTextToText``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if (
        model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _by_model_type(model_type: str | None) -> MoEArchitecture | None:
    """The registered family that lists ``model_type``, or ``None``."""
    for spec in ARCHITECTURES.values():
        if model_type in spec.model_types:
            return spec
    return None


def checkpoint_model_type(directory: str | os.PathLike[str]) -> str | None:
    """Read ``model_type`` from ``directory/config.json`` as plain JSON, before transformers.

    An old transformers does not know a new family's type; reading it here lets
    :func:`require_transformers` say which release is needed instead.

    Args:
        directory: a local Hugging Face model directory.

    Returns:
        The ``model_type`` string, or ``None`` when the config does not give one (transformers
        then identifies the model itself).

    Raises:
        LoadError: ``config.json`` is missing, cannot be read, is not valid JSON or is not a
            JSON object; the message names the file.
    """
    config = Path(directory) / "config.json"
    try:
        text = config.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise LoadError(
            f"{directory} has no config.json; pass a directory written by "
            "save_pretrained (or a downloaded model)"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadError(f"cannot read {config}: {exc}") from exc
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested
        raise LoadError(f"{config} is not valid JSON ({exc}); re-save the model's config") from exc
    if not isinstance(data, dict):
        raise LoadError(
            f"{config} holds a JSON {type(data).__name__}, not an object with the "
            "model's config; re-save the model's config"
        )
    model_type = data.get("model_type")
    return model_type if isinstance(model_type, str) else None


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

    def target(self, path: str) -> str:
        """The ``target_parameters`` suffix (PEFT, lora-core) naming ``path`` in every block.

        The block's own attribute name comes first (``mlp.experts.gate_up_proj``), except for a
        block that is a layer of a ``ModuleList`` (Gemma-4's decoder layer), whose name is an
        index: there the suffix starts inside the block (``experts.gate_up_proj``), so one
        entry still matches every layer.
        """
        leaf = self.name.rpartition(".")[2]
        return f"{leaf}.{path}" if leaf and not leaf.isdigit() else path


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
    if model_type in UNSUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported by moe-experts: "
            f"{UNSUPPORTED_FAMILIES[model_type]}"
        )
    spec = _by_model_type(model_type)
    if spec is not None:
        spec.check_transformers()
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
    flag = arch.block_enabled_attr
    for name, module in model.named_modules():
        enabled = flag is None or getattr(module, flag, False) is True
        if isinstance(module, block_type) and enabled:
            yield MoEBlockSite(name=name, block=module, arch=arch)
