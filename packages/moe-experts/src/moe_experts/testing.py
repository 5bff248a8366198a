"""Tiny, locally built configs of every supported family, for tests, demos and benchmarks.

Nothing is downloaded: each config is constructed in code with random-initialised weights.
One row of :data:`TINY_CONFIGS` per family of :data:`moe_experts.ARCHITECTURES`; the shared
parametrised test suite runs every row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from moe_experts.architectures import ARCHITECTURES, find_architecture, iter_moe_blocks
from moe_experts.errors import LoadError, UnsupportedModelError

__all__ = [
    "FP8_QUANTIZATION_CONFIG",
    "TINY_CONFIGS",
    "TINY_FAMILIES",
    "save_fp8_checkpoint",
    "save_mxfp4_checkpoint",
    "tiny_config",
    "tiny_model",
    "unstack_experts",
]

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    # A wide init makes the router's top-k decisive, so tiny dtype differences between two
    # implementations never flip a routing choice and comparisons stay meaningful.
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    # Several families default these ids far outside a 96-token vocabulary.
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# Multi-head latent attention (DeepSeek-V2/V3 style) at the smallest legal sizes.
_MLA: dict[str, Any] = {
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "num_key_value_heads": 4,
    "head_dim": 4,
}
# Grouped sigmoid routing with one leading dense layer (DeepSeek-V3, GLM-4.5, dots1 style).
_GROUPED: dict[str, Any] = {
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
    "routed_scaling_factor": 2.5,
}
# DeepSeek sparse attention: an indexer picks each query's top-16 keys, so the selection bites
# past 16 tokens. Not fewer: the indexer's ReLU'd scores tie at exactly 0 on tiny random
# weights, and torch.topk breaks ties differently at other lengths, so an example alone and
# packed (the shared suite's examples are up to 13 tokens) would pick different tied keys.
_DSA: dict[str, Any] = {"index_topk": 16, "index_head_dim": 8, "index_n_heads": 2}
_QWEN_LINEAR: dict[str, Any] = {
    # One linear-attention (gated delta net) and one full-attention layer.
    "layer_types": ["linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "shared_expert_intermediate_size": 24,
    "norm_topk_prob": True,
}

# family -> (model_type to build, config fields). A ``text_config`` field builds the
# multimodal model with that text config and a minimal vision tower (text-only batches).
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "qwen3_moe",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "shared_expert_intermediate_size": 24,
            "norm_topk_prob": False,
        },
    ),
    "qwen3_5_moe": ("qwen3_5_moe_text", _QWEN_LINEAR),
    "qwen3_next": ("qwen3_next", _QWEN_LINEAR),
    "qwen3_vl_moe": (
        "qwen3_vl_moe",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [1, 1, 2],
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 32,
                "deepstack_visual_indexes": [],
            },
        },
    ),
    "mixtral": ("mixtral", {"intermediate_size": 16, "num_local_experts": 4}),
    "minimax": ("minimax", {"intermediate_size": 16, "num_local_experts": 4}),
    "minimax_m2": ("minimax_m2", {"intermediate_size": 16, "num_local_experts": 4}),
    "phimoe": ("phimoe", {"intermediate_size": 16, "num_local_experts": 4}),
    "olmoe": ("olmoe", {"intermediate_size": 16, "num_experts": 8, "norm_topk_prob": False}),
    "flex_olmo": ("flex_olmo", {"intermediate_size": 16, "num_experts": 4}),
    "deepseek_v2": (
        "deepseek_v2",
        {
            **_GROUPED,
            **_MLA,
            "head_dim": None,
            "n_group": None,
            "topk_group": None,
            "topk_method": "greedy",
            "routed_scaling_factor": 1.0,
        },
    ),
    "deepseek_v3": ("deepseek_v3", {**_GROUPED, **_MLA, "head_dim": None, "rope_interleave": True}),
    "deepseek_v32": ("deepseek_v32", {**_GROUPED, **_MLA, **_DSA, "head_dim": None}),
    "glm4_moe": ("glm4_moe", _GROUPED),
    "glm4_moe_lite": ("glm4_moe_lite", {**_GROUPED, **_MLA}),
    "glm4v_moe": (
        "glm4v_moe",
        {
            **_GROUPED,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [1, 1, 2],
                "partial_rotary_factor": 0.5,
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 32,
            },
        },
    ),
    "dots1": ("dots1", _GROUPED),
    "exaone_moe": ("exaone_moe", {**_GROUPED, "num_experts": 8}),
    "solar_open": ("solar_open", _GROUPED),
    "mimo_v2_flash": ("mimo_v2_flash", _GROUPED),
    "hy_v3": ("hy_v3", _GROUPED),
    "laguna": ("laguna", {**_GROUPED, "num_experts": 8}),
    "afmoe": ("afmoe", {**_GROUPED, "num_experts": 8}),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        {
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "moe_num_shared_experts": 1,
        },
    ),
    "hunyuan_v1_moe": (
        "hunyuan_v1_moe",
        {"intermediate_size": 16, "num_experts": 4, "moe_topk": 2},
    ),
    "granitemoe": ("granitemoe", {"intermediate_size": 16, "num_local_experts": 4}),
    "granitemoeshared": (
        "granitemoeshared",
        {"intermediate_size": 16, "num_local_experts": 4, "shared_intermediate_size": 24},
    ),
    "granitemoe_swa": ("granitemoe_swa", {"intermediate_size": 16, "num_local_experts": 4}),
    "cohere2_moe": (
        "cohere2_moe",
        {"intermediate_size": 16, "num_experts": 4, "num_shared_experts": 1},
    ),
    "mellum": ("mellum", {"intermediate_size": 16, "moe_intermediate_size": 16, "num_experts": 4}),
    "kolibri1": (
        "kolibri1",
        {"intermediate_size": 16, "moe_intermediate_size": 16, "num_experts": 4},
    ),
    "lfm2_moe": (
        "lfm2_moe",
        {
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "layer_types": ["conv", "full_attention"],
            "num_dense_layers": 0,
        },
    ),
    # Text model: dense mlp + experts in every decoder layer (sliding and full attention), no
    # per-layer embeddings (their table would be 262144 rows).
    "gemma4": (
        "gemma4_text",
        {
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "top_k_experts": 2,
            "enable_moe_block": True,
            "hidden_size_per_layer_input": 0,
            "global_head_dim": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "hidden_act": None,
        },
    ),
    # One hash-routed and one top-k layer, both compressed attention types; a clamp of 1.0
    # cuts many tiny gate/up values, so a missed or wrong clamp shows in every comparison.
    "deepseek_v4": (
        "deepseek_v4",
        {
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "num_key_value_heads": 1,
            "q_lora_rank": 16,
            "o_groups": 2,
            "o_lora_rank": 8,
            "index_n_heads": 2,
            "index_head_dim": 8,
            "index_topk": 4,
            "sliding_window": 4,
            "hc_mult": 2,
            "hc_sinkhorn_iters": 3,
            "partial_rotary_factor": 0.5,
            "swiglu_limit": 1.0,
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            "mlp_layer_types": ["hash_moe", "moe"],
        },
    ),
    # Transposed, interleaved experts with biases and a clamped SwiGLU. A limit below the
    # default 7.0 makes the clamps bite on tiny random weights (the self-check and the
    # equality suite then prove them); full attention only, sliding windows are not ours.
    # Text model of Aria: experts stored transposed ([E, H, 2I] / [E, I, H]), concatenated.
    "aria": (
        "aria_text",
        {"intermediate_size": 16, "moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 1},
    ),
    "gpt_oss": (
        "gpt_oss",
        {
            "intermediate_size": 24,
            "num_local_experts": 4,
            "swiglu_limit": 1.5,
            "layer_types": ["full_attention"] * 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # DeepSeek-style MLA with a DSA indexer (top-4 keys) in every layer.
    "glm_moe_dsa": ("glm_moe_dsa", {**_GROUPED, **_MLA, **_DSA}),
    # One KDA (linear attention + short conv) and one MLA layer, both with routed experts.
    "kimi_linear": (
        "kimi_linear",
        {
            **_MLA,
            "head_dim": None,
            "q_lora_rank": None,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_local_experts": 8,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "layer_types": ["linear_attention", "full_attention"],
            "mlp_layer_types": ["sparse", "sparse"],
            "linear_head_dim": 8,
            "linear_num_heads": 4,
            "linear_conv_kernel_dim": 2,
        },
    ),
    # A Mamba layer, then an attention layer; experts in both.
    "jamba": (
        "jamba",
        {
            "intermediate_size": 16,
            "num_experts": 4,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 2,
            "mamba_dt_rank": 4,
        },
    ),
    # A Mamba-2 layer, then an attention layer; experts and a shared MLP in both.
    "granitemoehybrid": (
        "granitemoehybrid",
        {
            "intermediate_size": 16,
            "num_local_experts": 4,
            "shared_intermediate_size": 24,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_d_conv": 2,
            "mamba_chunk_size": 8,
        },
    ),
    # The released YaRN context (factor x original length): a shorter one only makes
    # transformers warn that the two disagree.
    "mistral4": (
        "mistral4",
        {**_GROUPED, **_MLA, "head_dim": None, "n_group": 2, "max_position_embeddings": 2**20},
    ),
    # The text model of the multimodal model (its only class), with a minimal Pixtral tower;
    # logits soft-capped at 30 as released.
    "mistral_large4": (
        "mistral_large4",
        {
            **_GROUPED,
            **_MLA,
            **_DSA,
            "max_position_embeddings": 2**20,  # the released YaRN context, as for mistral4
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "head_dim": 8,
                "patch_size": 4,
                "image_size": 16,
            },
        },
    ),
    "axk1": ("axk1", {**_GROUPED, **_MLA, "head_dim": None}),
    "axk2": ("axk2", {**_GROUPED, **_MLA, **_DSA, "gated_norm_rank": 4}),
    # One gated-delta-net and one sliding-window attention layer (window 8).
    "lara_mini": (
        "lara_mini",
        {**_QWEN_LINEAR, "sliding_window": 8},
    ),
    # Two DSA layers, then a sliding-window MLA layer (its own per-layer sizes: swa_*).
    "dots3_note": (
        "dots3_note_text",
        {
            **_GROUPED,
            **_MLA,
            **_DSA,
            "head_dim": 8,
            "shared_experts_intermediate_size": 16,
            "sliding_window": 4,
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 4,
            "swa_q_lora_rank": 16,
            "swa_kv_lora_rank": 16,
            "swa_head_dim": 8,
            "swa_qk_nope_head_dim": 4,
            "swa_v_head_dim": 8,
        },
    ),
}


def _hash_routes(model: PreTrainedModel) -> None:
    """Give DeepSeek-V4's hash routers a random token -> distinct experts table.

    transformers initialises ``tid2eid`` to zeros (real tables come from the checkpoint), which
    would send every token to expert 0 twice and make the routing weights constant.
    """
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    gen = torch.Generator().manual_seed(4321)
    for module in model.modules():
        if isinstance(module, DeepseekV4HashRouter):
            vocab, k = module.tid2eid.shape
            table = torch.stack(
                [torch.randperm(module.num_experts, generator=gen)[:k] for _ in range(vocab)]
            )
            module.tid2eid.copy_(table)


# family -> what a real checkpoint would set after the random initialisation.
_AFTER_INIT: dict[str, Callable[[PreTrainedModel], None]] = {"deepseek_v4": _hash_routes}


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """Return a tiny config (H=32, 2-3 layers, 4-8 experts) of ``family``.

    Args:
        family: a key of :data:`moe_experts.ARCHITECTURES`.
        **overrides: config fields to change (e.g. ``hidden_size=1024``); for multimodal
            families they apply to the text config.

    Returns:
        A transformers config ready for :func:`tiny_model` (or ``AutoModelForCausalLM``
        for text-only families).

    Raises:
        UnsupportedModelError: unknown ``family``.
    """
    if family not in TINY_CONFIGS:
        raise UnsupportedModelError(
            f"tiny_config has no family {family!r}; choose one of {list(TINY_FAMILIES)}"
        )
    model_type, fields = TINY_CONFIGS[family]
    kw = {k: v for k, v in {**_COMMON, **fields, **overrides}.items() if v is not None}
    if "vision_config" in kw:
        text = {k: v for k, v in kw.items() if k not in ("vision_config", "top")}
        top = dict(kw.get("top", {}))
        return AutoConfig.for_model(
            model_type, text_config=text, vision_config=kw["vision_config"], **top
        )
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(family: str, **overrides: Any) -> PreTrainedModel:
    """Build a randomly initialised tiny model of ``family`` with a language-model head.

    Raises:
        UnsupportedModelError: unknown ``family``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(family, **overrides)
    # As the CLI picks (finetune.models.pretrained_class): Mistral 4's causal LM is mapped
    # only as an image-text-to-text model.
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        # transformers: _BaseAutoModelClass.from_config is unannotated
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    else:
        model = AutoModelForImageTextToText.from_config(config)  # type: ignore[no-untyped-call]
    if family in _AFTER_INIT:
        with torch.no_grad():
            _AFTER_INIT[family](model)
    _random_expert_biases(model, family, config)
    return model


def _random_expert_biases(model: PreTrainedModel, family: str, config: PretrainedConfig) -> None:
    """Expert biases get random values: transformers initialises them to zero, and a zero
    bias would let a kernel that drops or misorders biases pass every test."""
    from moe_experts.architectures import iter_moe_blocks

    arch = ARCHITECTURES[family]
    if not arch.bias_params:
        return
    std = float(getattr(config.get_text_config(), "initializer_range", 0.02))
    with torch.no_grad():
        for site in iter_moe_blocks(model, arch):
            experts = getattr(site.block, arch.experts_attr)
            for name in arch.bias_params:
                bias = getattr(experts, name)
                bias.copy_(torch.randn(bias.shape, dtype=torch.float32).to(bias.dtype) * std)


TINY_FAMILIES: tuple[str, ...] = tuple(ARCHITECTURES)


# What DeepSeek-V3's config.json says about its FP8 weights.
FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}
# Projections quantised like DeepSeek-V3's release: every *proj* linear (attention, dense and
# shared MLPs, experts; fused expert tensors too), never embeddings, norms, routers or lm_head.
_FP8_KEY = re.compile(r"(proj[a-z_]*\.weight|experts\.(gate_up_proj|down_proj|w1|w2|w3))$")


def _shards(path: Path) -> tuple[list[str], dict[str, Any] | None]:
    """A saved checkpoint's shard file names and its index (``None`` for one file)."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    return (sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]), index


def unstack_experts(model: PreTrainedModel, path: str | Path) -> Path:
    """Rewrite ``path``'s fused routed experts as per-expert ``nn.Linear`` weights.

    ``path`` must hold ``model`` saved with ``save_original_format=False`` (its fused expert
    tensors under the model's names). Each becomes ``<experts>.<e>.gate_proj.weight`` and
    ``up_proj.weight`` ``[I, H]`` and ``down_proj.weight`` ``[H, I]``, in the same shard: the
    layout of the FP8 releases of families whose bf16 checkpoints are fused (Qwen3.5/3.6-MoE,
    Qwen3-VL-MoE); transformers has a converter for some of them only.

    Args:
        model: the saved model.
        path: the checkpoint directory, rewritten in place.

    Returns:
        ``path``.

    Raises:
        UnsupportedModelError: the family has expert biases (no per-expert names exist).
        LoadError: ``path`` lacks one of the model's fused expert tensors (saved in another
            layout); nothing is rewritten then.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    arch = find_architecture(model)
    if arch.bias_params:
        raise UnsupportedModelError(f"{arch.family}: experts with biases have no per-expert form")
    fused: dict[str, tuple[str, bool]] = {}  # key -> (experts module name, is gate_up)
    for site in iter_moe_blocks(model, arch):
        fused[f"{site.experts_name}.{arch.gate_up_param}"] = (site.experts_name, True)
        fused[f"{site.experts_name}.{arch.down_param}"] = (site.experts_name, False)
    shards, index = _shards(path)
    present: set[str] = set()
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            present.update(f.keys())
    if missing := sorted(fused.keys() - present):
        raise LoadError(
            f"{path}: has no fused expert tensor {missing[0]!r} (and {len(missing) - 1} more) of "
            "this model; save the model with save_original_format=False first"
        )
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        out: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            if key not in fused:
                out[key] = t
                continue
            name, gate_up = fused[key]
            if gate_up:
                view = arch.kernel_gate_up(t)  # [E, 2, I, H]: gate, then up
                parts = {"gate_proj": view[:, 0], "up_proj": view[:, 1]}
            else:
                parts = {"down_proj": arch.kernel_down(t)}
            if index:
                del index["weight_map"][key]
            for proj, w in parts.items():
                for e in range(w.shape[0]):
                    out[f"{name}.{e}.{proj}.weight"] = w[e].contiguous()
                    if index:
                        index["weight_map"][f"{name}.{e}.{proj}.weight"] = shard
        save_file(out, str(path / shard), metadata={"format": "pt"})
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def save_fp8_checkpoint(
    model: PreTrainedModel,
    path: str | Path,
    *,
    per_expert: bool = True,
    unstacked: bool = False,
    max_shard_size: str = "5GB",
) -> Path:
    """Save ``model`` as a DeepSeek-V3-style FP8-block checkpoint (for tests and benchmarks).

    Every projection weight ``W [..., N, K]`` is stored as ``float8_e4m3fn`` plus
    ``<key>_scale_inv`` float32 ``[..., ceil(N/128), ceil(K/128)]`` (kt-kernel's
    :meth:`kt_kernel.Fp8Block.quantize`: ``scale_inv = max|block| / 448``), and
    ``config.json`` gets :data:`FP8_QUANTIZATION_CONFIG`.

    Args:
        model: the model to save (any dtype).
        path: output directory.
        per_expert: hub-style per-expert expert keys (``save_original_format``) or fused ones.
        unstacked: per-expert expert keys whatever the family's hub layout
            (:func:`unstack_experts`), as Qwen's FP8 releases of fused families ship them.
        max_shard_size: as in ``save_pretrained``.

    Returns:
        ``path``.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kt_kernel import Fp8Block

    path = Path(path)
    model.save_pretrained(
        path, max_shard_size=max_shard_size, save_original_format=per_expert and not unstacked
    )
    if unstacked:
        unstack_experts(model, path)
    shards, index = _shards(path)
    fmt = Fp8Block()
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        out = {}
        for key, t in tensors.items():
            if t.dim() >= 2 and t.dtype.is_floating_point and _FP8_KEY.search(key):
                out[key], out[key + "_scale_inv"] = fmt.quantize(t)
                if index:
                    index["weight_map"][key + "_scale_inv"] = shard
            else:
                out[key] = t
        save_file(out, str(path / shard), metadata={"format": "pt"})
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# What GPT-OSS's config.json says about its MXFP4 experts.
MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def save_mxfp4_checkpoint(model: PreTrainedModel, path: str | Path) -> Path:
    """Save ``model`` as GPT-OSS ships it: fused experts as MXFP4 ``*_blocks``/``*_scales``.

    Each fused expert tensor ``P`` (``gate_up_proj``, ``down_proj``) is stored ``[E, out,
    in]`` (transposed back for a family that stores ``[E, in, out]``, rows in the family's
    order) quantised by :meth:`kt_kernel.Mxfp4.quantize` as ``P_blocks`` uint8
    ``[E, out, in/32, 16]`` and ``P_scales`` uint8 ``[E, out, in/32]``; everything else (biases
    too) as saved; ``config.json`` gets :data:`MXFP4_QUANTIZATION_CONFIG`.
    """
    from safetensors.torch import load_file, save_file

    from kt_kernel import Mxfp4

    path = Path(path)
    arch = find_architecture(model)
    model.save_pretrained(path, save_original_format=False)
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for key, t in tensors.items():
        param = key.rsplit(".", 1)[-1]
        if t.dim() == 3 and param in (arch.gate_up_param, arch.down_param):
            w = t.transpose(1, 2) if arch.transposed else t
            out[key + "_blocks"], out[key + "_scales"] = Mxfp4().quantize(w)
        else:
            out[key] = t
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
