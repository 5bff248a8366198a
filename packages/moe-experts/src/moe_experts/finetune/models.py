"""The built-in tiny model and loading of local Hugging Face model directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_experts.finetune.data import ByteTokenizer, encode_text
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.tokenizer import save_byte_tokenizer

__all__ = ["BUILTIN_MODELS", "LoadedModel", "builtin_model_dir", "load_model", "pretrained_class"]

# Small enough to train on two CPU cores in well under a minute, large enough to have real
# routing (8 experts, top-2) and every kind of layer the toolkit adapts.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe",
        "vocab_size": ByteTokenizer.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 512,
        "bos_token_id": ByteTokenizer.bos_token_id,
        "eos_token_id": ByteTokenizer.eos_token_id,
        "pad_token_id": ByteTokenizer.pad_token_id,
        "tie_word_embeddings": False,
    },
}
BUILTIN_SEED = 1234


@dataclass
class LoadedModel:
    """A causal LM ready for adaptation, with the tokenizer's encode function."""

    model: nn.Module
    encode: Any  # Callable[[str], list[int]]
    source: Path
    builtin: bool
    tokenizer: Any = None  # the Hugging Face tokenizer (chat template, decode, generation)
    # Local ranks mapping the kernel's expert storage (one copy per machine); None: the
    # experts are still the model's own modules (no weight_dtype was asked for).
    shared_by: int | None = None
    # The experts' kernel storage and, for "auto", how it was chosen, e.g.
    # "fp32 (auto: the checkpoint's float32 weights)"; None without a weight_dtype.
    storage: str | None = None


def _cache_root() -> Path:
    env = os.environ.get("MOE_EXPERTS_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe-experts"


def builtin_model_dir(name: str) -> Path:
    """Return the cached directory of a built-in model, creating it on first use.

    The weights are random, drawn from a fixed seed, and saved with ``save_pretrained`` so
    that training then loads them through the ordinary ``from_pretrained`` path.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    target = _cache_root() / name
    if (target / "config.json").is_file():
        if not (target / "tokenizer.json").is_file():  # a cache written before 0.3
            save_byte_tokenizer(target)
        return target
    spec = dict(BUILTIN_MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(BUILTIN_SEED)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # unannotated
    target.parent.mkdir(parents=True, exist_ok=True)
    # Publish with one rename so a concurrent or interrupted first run never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        save_byte_tokenizer(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def pretrained_class(source: Path) -> Any:
    """The transformers auto class that loads ``source`` with its language-model head.

    ``AutoModelForCausalLM`` where transformers maps the checkpoint's ``model_type`` to a causal
    LM; a multimodal checkpoint that it maps only to an image-text-to-text model (Qwen3-VL-MoE,
    GLM-4.5V, Aria, Mistral-Large-3; Mistral 4) gets ``AutoModelForImageTextToText``
    (:func:`moe_experts.architectures.lm_class`): the model, vision tower included and frozen,
    trains on text (it is called with ``input_ids`` only).

    Args:
        source: a local Hugging Face model directory.

    Returns:
        ``AutoModelForCausalLM`` or ``AutoModelForImageTextToText``.

    Raises:
        LoadError: ``source`` has no readable ``config.json``.
    """
    from moe_experts.architectures import checkpoint_model_type, lm_class

    return lm_class(checkpoint_model_type(source))


def load_model(
    model: str,
    *,
    dtype: torch.dtype = torch.float32,
    weight_dtype: str | None = None,
    share_experts: bool | None = None,
    dense_device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load a built-in model name or a local Hugging Face directory, with its tokenizer.

    Args:
        model: a name in :data:`BUILTIN_MODELS` or a local model directory.
        dtype: the dense weights' dtype.
        weight_dtype: when given, the routed experts come up on kt-kernel in this storage
            (``"auto"`` or a name in ``kt_kernel.FORMATS``, resolved once by
            :meth:`moe_experts.storage.StoragePlan.for_checkpoint`): they stream straight
            from the checkpoint's safetensors (:func:`moe_experts.load_pretrained`, never
            holding the experts twice), a multimodal checkpoint's too (its vision tower loads
            as transformers loads it, frozen). ``None``: plain load of the whole model.
        share_experts: as in :func:`moe_experts.wrap` (one copy per machine under torchrun);
            every rank must call this together when ``weight_dtype`` is given.
        dense_device: where the dense weights go (``"cuda:0"``); the experts of a
            ``weight_dtype`` load stay in the host kernel.

    Raises:
        FinetuneError: if the path does not exist or holds no loadable MoE causal LM.
    """
    from transformers import AutoTokenizer

    builtin = model in BUILTIN_MODELS
    if builtin:
        source = builtin_model_dir(model)
    else:
        source = Path(model)
        if not (source / "config.json").is_file():
            raise FinetuneError(
                f"--model {model}: not a built-in model ({', '.join(BUILTIN_MODELS)}) and not a "
                "local Hugging Face model directory (no config.json there)"
            )
    import moe_experts
    from moe_experts import LoadError, UnsupportedModelError, WrapError, find_architecture
    from moe_experts.architectures import checkpoint_model_type, require_transformers
    from moe_experts.checkpoint_experts import streams_with_installed_transformers
    from moe_experts.storage import StoragePlan

    try:
        model_type = checkpoint_model_type(source)
        # Before transformers parses the config: an old release does not know a new type.
        require_transformers(model_type)
    except (LoadError, UnsupportedModelError) as exc:
        raise FinetuneError(f"--model {model}: {exc}") from exc
    shared_by = storage = None
    try:
        if weight_dtype is not None:  # "auto" resolved once, from the checkpoint
            plan = StoragePlan.for_checkpoint(source, weight_dtype)
            weight_dtype = plan.weight_dtype
            storage = f"{weight_dtype} ({plan.reason})" if plan.reason else weight_dtype
        if weight_dtype is not None and streams_with_installed_transformers(model_type):
            # Streamed, multimodal checkpoints included (built with pretrained_class's class).
            lm = moe_experts.load_pretrained(
                source,
                weight_dtype=weight_dtype,
                dtype=dtype,
                share_experts=share_experts,
                dense_device=dense_device,
            )
        else:  # a plain load, or an older transformers' layout: load whole, then wrap
            lm = pretrained_class(source).from_pretrained(source, dtype=dtype)
            find_architecture(lm)
            if weight_dtype is not None:
                moe_experts.wrap(lm, weight_dtype=weight_dtype, share_experts=share_experts)
            lm.to(dense_device)  # placeholders move as metadata; kernel storage stays put
    except (LoadError, UnsupportedModelError, WrapError) as exc:
        # e.g. a malformed checkpoint, or no memory for the shared copy: each names the fix
        raise FinetuneError(f"--model {model}: {exc}") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise FinetuneError(f"--model {model}: transformers could not load it: {exc}") from exc
    if weight_dtype is not None:
        shared_by = max(
            (m.shared_by for m in lm.modules() if isinstance(m, moe_experts.KernelExperts)),
            default=1,
        )
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:
        raise FinetuneError(
            f"--model {model}: the directory has no tokenizer transformers can load ({exc})"
        ) from exc

    def encode(text: str) -> list[int]:
        return encode_text(tok, text)

    return LoadedModel(lm, encode, source, builtin, tok, shared_by, storage)
