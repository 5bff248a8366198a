"""Loading a trained adapter the way users do: transformers for the base, PEFT for the adapter."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "LoadedAdapter",
    "load_with_adapter",
    "read_adapter_config",
    "resolve_adapter",
    "verified_adapter",
]


def resolve_adapter(ckpt: Path) -> Path:
    """The checkpoint directory for ``ckpt``: a checkpoint root (its ``latest``) or one checkpoint.

    Raises:
        FinetuneError: if ``ckpt`` holds no checkpoint with a PEFT adapter.
    """
    import lora_checkpoint

    try:
        resolved = lora_checkpoint.resolve_checkpoint(ckpt)
    except (lora_checkpoint.CheckpointError, OSError) as exc:
        raise FinetuneError(f"{ckpt}: not a checkpoint or checkpoint root ({exc})") from exc
    for name in (lora_checkpoint.ADAPTER_CONFIG, lora_checkpoint.ADAPTER_MODEL):
        if not (resolved / name).is_file():
            raise FinetuneError(
                f"{resolved}: no {name}; not a checkpoint written by moe-experts finetune "
                "(or a file of it was deleted; restore it or use another checkpoint)"
            )
    return resolved


def read_adapter_config(ckpt: Path) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of checkpoint directory ``ckpt``.

    Raises:
        FinetuneError: the file cannot be read or is not a JSON object.
    """
    path = ckpt / "adapter_config.json"
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8
        raise FinetuneError(
            f"{path}: cannot be read as JSON ({exc}); the adapter is damaged"
        ) from exc
    if not isinstance(config, dict):
        raise FinetuneError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def verified_adapter(ckpt: Path) -> Path:
    """Resolve ``ckpt`` and verify it as ``lora-checkpoint verify`` does, before any use.

    Every file's size and digest is checked against the manifest (a truncated or altered
    adapter fails here), and the adapter config must parse.

    Returns:
        The checkpoint directory.

    Raises:
        FinetuneError: ``ckpt`` is no checkpoint, or it fails verification.
    """
    import lora_checkpoint

    resolved = resolve_adapter(ckpt)
    try:
        lora_checkpoint.verify(resolved)
    except (lora_checkpoint.CheckpointError, OSError) as exc:
        raise FinetuneError(
            f"checkpoint {resolved} fails verification: {exc}; use another checkpoint "
            f"(`lora-checkpoint verify {resolved}` shows the same)"
        ) from exc
    read_adapter_config(resolved)
    return resolved


def _base_source(model: str | None, ckpt: Path) -> Path:
    from moe_experts.finetune.models import BUILTIN_MODELS, builtin_model_dir

    if model is None:
        config = read_adapter_config(ckpt)
        model = config.get("base_model_name_or_path")
        if not model:
            raise FinetuneError(f"{ckpt}: adapter_config.json names no base model; pass --model")
    if model in BUILTIN_MODELS:
        return builtin_model_dir(model)
    source = Path(model)
    if not (source / "config.json").is_file():
        raise FinetuneError(
            f"--model {model}: not a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "and not a local Hugging Face model directory (no config.json there)"
        )
    return source


@dataclass
class LoadedAdapter:
    """A ``PeftModel`` over its base, the base's tokenizer, and where each came from."""

    model: Any  # peft.PeftModel
    tokenizer: Any
    base: Path
    checkpoint: Path


def load_with_adapter(model: str | None, ckpt: Path, *, verify: bool = True) -> LoadedAdapter:
    """``AutoModelForCausalLM.from_pretrained(base)`` + ``PeftModel.from_pretrained(..., ckpt)``.

    A multimodal base loads with the class :func:`~moe_experts.finetune.models.pretrained_class`
    picks, as training did.

    Args:
        model: built-in model name or local directory; None: the base the adapter names.
        ckpt: checkpoint root or one checkpoint directory.
        verify: check the checkpoint first (:func:`verified_adapter`); False only where the
            caller just verified this very directory.

    Raises:
        FinetuneError: if peft is missing, the checkpoint fails verification, or the base or
            adapter cannot be loaded.
    """
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise FinetuneError("peft is not installed; install moe-experts[train]") from exc
    from safetensors import SafetensorError
    from transformers import AutoTokenizer

    from moe_experts.finetune.models import pretrained_class

    resolved = verified_adapter(ckpt) if verify else resolve_adapter(ckpt)
    base_dir = _base_source(model, resolved)
    try:
        base = pretrained_class(Path(base_dir)).from_pretrained(base_dir)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        peft_model = PeftModel.from_pretrained(base, resolved)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise FinetuneError(
            f"could not load {base_dir} with the adapter {resolved}: {exc}"
        ) from exc
    _expose_router_buffers(peft_model)
    return LoadedAdapter(peft_model.eval(), tokenizer, base_dir, resolved)


def _expose_router_buffers(peft_model: Any) -> None:
    """Make each LoRA-wrapped parameter owner's buffers readable on PEFT's wrapper.

    transformers before 5.17 has DeepSeek-V3, GLM-4.5(V), dots1, EXAONE-MoE and Solar-Open
    blocks read ``self.gate.e_score_correction_bias``; with router LoRA ``gate`` is PEFT's
    ``ParamWrapper``, which does not forward attribute reads, so the forward raised
    AttributeError. The wrapper gets a reference to the same tensor (no copy, no new buffer).
    """
    from peft.tuners.lora.layer import ParamWrapper

    for module in peft_model.modules():
        if isinstance(module, ParamWrapper):
            for name, buf in module.get_base_layer().named_buffers(recurse=False):
                if name not in module.__dict__ and name not in module._buffers:
                    module.__dict__[name] = buf
