"""Tiny, locally built configs of every supported family, for tests, demos and benchmarks.

Nothing is downloaded: each config is constructed in code with random-initialised weights.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from moe_experts.architectures import ARCHITECTURES
from moe_experts.errors import UnsupportedModelError

__all__ = ["TINY_FAMILIES", "tiny_config"]

TINY_FAMILIES: tuple[str, ...] = tuple(ARCHITECTURES)

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    # A wide init makes the router's top-k decisive, so tiny dtype differences between two
    # implementations never flip a routing choice and comparisons stay meaningful.
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """Return a tiny config (H=32, 2 layers, 4-8 experts) of ``family``.

    Args:
        family: a key of :data:`moe_experts.ARCHITECTURES`.
        **overrides: config fields to change (e.g. ``hidden_size=1024``).

    Returns:
        A transformers config ready for ``AutoModelForCausalLM.from_config``.

    Raises:
        UnsupportedModelError: unknown ``family``.
    """
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        kw = {**_COMMON, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_experts": 8, "norm_topk_prob": True}
        return Qwen3MoeConfig(**{**kw, **overrides})
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        kw = {**_COMMON, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
              "shared_expert_intermediate_size": 24, "norm_topk_prob": False}
        return Qwen2MoeConfig(**{**kw, **overrides})
    if family == "mixtral":
        from transformers import MixtralConfig

        kw = {**_COMMON, "head_dim": 8, "intermediate_size": 16, "num_local_experts": 4}
        return MixtralConfig(**{**kw, **overrides})
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        kw = {**_COMMON, "intermediate_size": 48, "moe_intermediate_size": 16,
              "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
              "first_k_dense_replace": 1, "num_hidden_layers": 3, "q_lora_rank": 16,
              "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
              "v_head_dim": 8, "num_key_value_heads": 4, "routed_scaling_factor": 2.5,
              "rope_interleave": True}
        return DeepseekV3Config(**{**kw, **overrides})
    if family == "olmoe":
        from transformers import OlmoeConfig

        kw = {**_COMMON, "intermediate_size": 16, "num_experts": 8, "norm_topk_prob": False,
              "eos_token_id": 1, "pad_token_id": 1}
        return OlmoeConfig(**{**kw, **overrides})
    raise UnsupportedModelError(
        f"tiny_config has no family {family!r}; choose one of {list(TINY_FAMILIES)}"
    )
