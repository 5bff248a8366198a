"""The registry: one :class:`~moe_experts.spec.MoEArchitecture` row per supported family, and
the families refused by name with the reason.

This table is the only place a family is added; its tiny config goes in
:data:`moe_experts.testing.TINY_CONFIGS`, and the shared parametrised suite then runs it.
"""

from __future__ import annotations

from typing import Any

from moe_experts.isolation import Packing
from moe_experts.spec import MoEArchitecture

__all__ = ["ARCHITECTURES", "UNSUPPORTED_FAMILIES"]


def _spec(family: str, block_class: str, *, text: bool = False, **fields: Any) -> MoEArchitecture:
    """A spec for ``transformers.models.<family>.modeling_<family>.<block_class>``."""
    types = (family, f"{family}_text") if text else (family,)
    return MoEArchitecture(
        family=family,
        model_types=fields.pop("model_types", types),
        modeling_module=f"transformers.models.{family}.modeling_{family}",
        block_class=block_class,
        **fields,
    )


# Fields spread into _spec rows (typed Any: each value goes to its own MoEArchitecture field).
_SHARED: dict[str, Any] = {"shared_expert_attrs": ("shared_experts",)}
_QWEN_SHARED: dict[str, Any] = {
    "shared_expert_attrs": ("shared_expert",),
    "shared_expert_gate_attr": "shared_expert_gate",
}
_GROUPED = "sigmoid, grouped top-k, bias, scaling"
# Packing (moe_experts.isolation): families whose restarting position_ids alone do not keep
# packed examples apart. Each claim is proved per family by the shared suite
# (tests/test_architectures.py: a packed row equals each example run alone).
_OWN_MASKS: dict[str, Any] = {
    "packing": Packing.MASKS,
    "packing_reason": "transformers builds this family's masks without position_ids",
}
_NO_RESET = (
    "; transformers resets it at example boundaries only through {} (CUDA), "
    "never on its PyTorch path"
)
_GATED_DELTA_NET: dict[str, Any] = {
    "packing": Packing.ONE_PER_ROW,
    "packing_reason": "linear-attention (gated delta net) and short-convolution state runs "
    "across examples" + _NO_RESET.format("flash-linear-attention and causal-conv1d"),
}
# min_transformers: the lowest release each family was verified with (its tiny model wrapped,
# self-checked and fine-tuned one step through the CLI) among 5.1, 5.17, 5.18 and 5.24. A
# family absent from 5.1 (or laid out otherwise there) and passing on 5.17 gets 5.17, although
# it may have appeared in a release in between; a too-high minimum refuses with an upgrade
# hint, a too-low one would let a mismatched layout through.
_V5_17 = "5.17"
# Families absent from 5.18 (kolibri1, mistral_large4, lara_mini, dots3_note): 5.24 is the
# oldest release they were verified with.
_V5_24 = "5.24"

# One row per family; every row is run by the shared parametrised test suite
# (tests/test_adapt.py, test_wrap.py, test_architectures.py) through moe_experts.testing.
ARCHITECTURES: dict[str, MoEArchitecture] = {
    spec.family: spec
    for spec in (
        _spec("qwen3_moe", "Qwen3MoeSparseMoeBlock", router="softmax top-k (norm_topk_prob)"),
        _spec("qwen2_moe", "Qwen2MoeSparseMoeBlock", **_QWEN_SHARED),
        _spec(
            "qwen3_5_moe",
            "Qwen3_5MoeSparseMoeBlock",
            text=True,
            router="softmax top-k, renormalised",
            min_transformers=_V5_17,
            **_QWEN_SHARED,
            **_GATED_DELTA_NET,
        ),
        _spec(
            "qwen3_next",
            "Qwen3NextSparseMoeBlock",
            router="softmax top-k (norm_topk_prob)",
            **_QWEN_SHARED,
            **_GATED_DELTA_NET,
        ),
        _spec(
            "qwen3_vl_moe",
            "Qwen3VLMoeTextSparseMoeBlock",
            text=True,
            router="softmax top-k, renormalised",
        ),
        _spec("mixtral", "MixtralSparseMoeBlock", router="softmax top-k, renormalised"),
        _spec(
            "minimax",
            "MiniMaxSparseMoeBlock",
            router="softmax top-k, renormalised",
            packing=Packing.ONE_PER_ROW,
            packing_reason="lightning (linear) attention layers carry their state across "
            "examples; transformers has no boundary reset for them",
        ),
        _spec("minimax_m2", "MiniMaxM2SparseMoeBlock", router="sigmoid top-k, bias"),
        _spec("phimoe", "PhimoeSparseMoeBlock", router_attr="router", router="sparsemixer top-2"),
        _spec("olmoe", "OlmoeSparseMoeBlock"),
        _spec("flex_olmo", "FlexOlmoSparseMoeBlock"),
        _spec(
            "deepseek_v2",
            "DeepseekV2Moe",
            router="softmax (group-limited) top-k, scaling",
            **_SHARED,
        ),
        _spec("deepseek_v3", "DeepseekV3MoE", router=_GROUPED, **_SHARED),
        _spec(
            "deepseek_v32", "DeepseekV32MoE", router=_GROUPED, min_transformers=_V5_17, **_SHARED
        ),
        _spec("glm4_moe", "Glm4MoeMoE", router=_GROUPED, **_SHARED),
        _spec("glm4_moe_lite", "Glm4MoeLiteMoE", router=_GROUPED, **_SHARED),
        _spec(
            "glm4v_moe",
            "Glm4vMoeTextMoE",
            text=True,
            router=_GROUPED,
            packing=Packing.MASKS,
            packing_reason="its text model reads restarting positions only from 4-row "
            "(text + 3-D rope) position_ids, not from the 2-D ones of packed text",
            **_SHARED,
        ),
        _spec("dots1", "Dots1MoE", router=_GROUPED, **_SHARED),
        _spec("exaone_moe", "ExaoneMoeSparseMoEBlock", router=_GROUPED, **_SHARED),
        _spec("solar_open", "SolarOpenMoE", router=_GROUPED, **_SHARED),
        _spec("mimo_v2_flash", "MiMoV2FlashMoE", router=_GROUPED, min_transformers=_V5_17),
        _spec("hy_v3", "HYV3MoE", router="sigmoid top-k, bias", min_transformers=_V5_17, **_SHARED),
        _spec(
            "laguna",
            "LagunaSparseMoeBlock",
            router="sigmoid top-k, bias",
            min_transformers=_V5_17,
            **_SHARED,
        ),
        # 5.1 has afmoe without an AfmoeSparseMoeBlock.
        _spec(
            "afmoe",
            "AfmoeSparseMoeBlock",
            router_attr="router",
            router_param="gate.weight",
            router="sigmoid top-k, bias",
            min_transformers=_V5_17,
            **_SHARED,
            **_OWN_MASKS,
        ),
        _spec(
            "ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", router="softmax top-k, bias", **_SHARED
        ),
        _spec(
            "hunyuan_v1_moe",
            "HunYuanMoEV1Moe",
            router_param="wg.weight",
            shared_expert_attrs=("shared_mlp",),
            router="softmax top-k, renormalised",
        ),
        # 5.1's GraniteMoe blocks keep their experts as input_linear/output_linear (no
        # ``experts`` attribute).
        _spec(
            "granitemoe",
            "GraniteMoeMoE",
            router_attr="router",
            router="top-k logits, softmax",
            min_transformers=_V5_17,
        ),
        _spec(
            "granitemoeshared",
            "GraniteMoeSharedMoE",
            router_attr="router",
            router="top-k logits, softmax",
            min_transformers=_V5_17,
        ),
        _spec(
            "granitemoe_swa",
            "GraniteMoeSWAMoE",
            router_attr="router",
            router="top-k logits, softmax",
            min_transformers=_V5_17,
        ),
        _spec("cohere2_moe", "Cohere2MoeSparseMoeBlock", min_transformers=_V5_17, **_SHARED),
        _spec("mellum", "MellumSparseMoeBlock", min_transformers=_V5_17),
        _spec("kolibri1", "Kolibri1SparseMoeBlock", min_transformers=_V5_24, **_SHARED),
        _spec(
            "lfm2_moe",
            "Lfm2MoeSparseMoeBlock",
            router="sigmoid top-k, bias",
            packing=Packing.ONE_PER_ROW,
            packing_reason="short-convolution layers mix each token with the ones before it, "
            "across examples" + _NO_RESET.format("causal-conv1d"),
        ),
        # Experts and router sit in the decoder layer itself, beside a dense mlp whose output
        # is added; gated tanh-GELU experts (kt_kernel.GeluTanhGated).
        _spec(
            "gemma4",
            "Gemma4TextDecoderLayer",
            text=True,
            router_attr="router",
            router_param="proj.weight",
            block_enabled_attr="enable_moe_block",
            router="RMS-normed softmax top-k, renormalised, per-expert scale",
            min_transformers=_V5_17,
        ),
        # SwiGLU clamped at swiglu_limit (kt_kernel.SwiGLULimit). Hash layers pick experts by
        # a token-id table but call the experts module the same way, so they run as well.
        _spec(
            "deepseek_v4",
            "DeepseekV4SparseMoeBlock",
            router="sqrt-softplus top-k, bias, scaling (hash layers: token-id table)",
            min_transformers=_V5_17,
            packing=Packing.ONE_PER_ROW,
            packing_reason="compressed attention pools windows of consecutive tokens counted "
            "from the row's start, so a window spans examples; no mask can undo that",
            **_SHARED,
        ),
        # Up to 5.17 Aria's experts are per-expert nn.Linear; 5.18 fuses them (transposed).
        _spec(
            "aria",
            "AriaTextMoELayer",
            text=True,
            router_attr="router",
            router="top-k logits, softmax",
            transposed=True,
            min_transformers="5.18",
            **_SHARED,
        ),
        _spec("glm_moe_dsa", "GlmMoeDsaMoE", router=_GROUPED, min_transformers=_V5_17, **_SHARED),
        _spec(
            "kimi_linear",
            "KimiLinearMoE",
            router=_GROUPED,
            min_transformers=_V5_17,
            packing=Packing.ONE_PER_ROW,
            packing_reason="linear-attention (Kimi delta attention) and short-convolution state "
            "runs across examples" + _NO_RESET.format("flash-linear-attention and causal-conv1d"),
            **_SHARED,
        ),
        _spec(
            "jamba",
            "JambaSparseMoeBlock",
            router_attr="router",
            router="softmax top-k, not renormalised",
            min_transformers=_V5_17,
            packing=Packing.ONE_PER_ROW,
            packing_reason="Mamba layers carry their convolution and SSM state across examples"
            + _NO_RESET.format("mamba-ssm and causal-conv1d"),
        ),
        # The shared MLP sits in the decoder layer (shared_mlp), not in the MoE block.
        _spec(
            "granitemoehybrid",
            "GraniteMoeHybridMoE",
            router_attr="router",
            router="top-k logits, softmax",
            min_transformers=_V5_17,
            packing=Packing.ONE_PER_ROW,
            packing_reason="Mamba-2 layers carry their convolution and SSM state across examples"
            + _NO_RESET.format("mamba-ssm and causal-conv1d"),
        ),
        _spec(
            "mistral4",
            "Mistral4MoE",
            router="softmax, grouped top-k, renormalised, scaling",
            min_transformers=_V5_17,
            **_SHARED,
        ),
        _spec(
            "mistral_large4",
            "MistralLarge4TextMoE",
            text=True,
            router="softmax (fp32), grouped top-k, renormalised, scaling",
            min_transformers=_V5_24,
            **_SHARED,
        ),
        # DeepSeek-V3's MoE with a post_mlp_layernorm on the block output (outside the experts).
        _spec("axk1", "AXK1MoE", router=_GROUPED, min_transformers=_V5_17, **_SHARED),
        _spec(
            "axk2",
            "AXK2MoE",
            router="sigmoid, (grouped) top-k, bias, scaling",
            min_transformers=_V5_17,
            **_SHARED,
        ),
        # The shared expert is added in full, without a gate.
        _spec(
            "lara_mini",
            "LaraMiniSparseMoeBlock",
            router="softmax (fp32) top-k, renormalised",
            shared_expert_attrs=("shared_expert",),
            min_transformers=_V5_24,
            **_GATED_DELTA_NET,
        ),
        # The text model's MoE; the vision tower's Dots3NoteVisionMoE blocks stay transformers'.
        _spec(
            "dots3_note",
            "Dots3NoteTextMoE",
            text=True,
            router=_GROUPED,
            min_transformers=_V5_24,
            **_SHARED,
        ),
        _spec(
            "gpt_oss",
            "GptOssMLP",
            router_attr="router",
            router="top-k logits, softmax, bias",
            transposed=True,
            interleaved=True,
            gate_up_bias_param="gate_up_proj_bias",
            down_bias_param="down_proj_bias",
            **_OWN_MASKS,
        ),
    )
}

_NOT_YET = "; not yet registered with a tiny config and equality tests"
_LIMIT = "SwiGLU clamped at swiglu_limit, the formula of kt_kernel.SwiGLULimit" + _NOT_YET
_SOFTCAPPED = "soft-capped SwiGLU experts (tanh caps on the gate factor and up); kt-kernel has "
_SOFTCAPPED += "no such activation"
# Model types transformers ships that are refused by name, each with why; a multimodal family's
# text model type (``<type>_text``, loadable on its own) is refused with it. Every name is a
# model type of the pinned transformers (tests/test_architectures.py checks both).
_REFUSED: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("openai_privacy_filter",),
        "a token-classification encoder, not a causal LM; moe-experts fine-tunes causal LMs "
        "(its GPT-OSS-style experts would fit MoEArchitecture's layout fields: transposed, "
        "concatenated, biases)",
    ),
    (
        ("diffusion_gemma", "diffusion_gemma_text"),
        "a block-diffusion model (DiffusionGemmaForBlockDiffusion), not a causal LM, with its "
        "MoE in two layer classes (encoder and decoder); its gated tanh-GELU experts are "
        "Gemma-4's, which kt-kernel computes, but no spec or equality test covers this model",
    ),
    (("glm5_next", "glm5_next_text"), _LIMIT),
    (("hy_v4",), _LIMIT),
    (("hy_v4_vl", "hy_v4_vl_text"), _LIMIT),
    (("step3p7",), "SwiGLU clamped after the activation; kt-kernel has no such activation"),
    (
        ("minimax_m3_vl", "minimax_m3_vl_text"),
        "clamped SwiGLU (alpha, limit; gate and up concatenated), the formula of "
        "kt_kernel.ClampedSwiGLU" + _NOT_YET,
    ),
    (
        ("llama4", "llama4_text"),
        "Llama 4 scales each chosen expert's *input* by the sigmoid of its router logit "
        "(expert(w * x), not w * expert(x); top-1 in the released models), and SwiGLU is not "
        "linear, so the weight cannot move to the output; its experts module takes no expert "
        "ids (every expert runs on every token, unchosen ones on zeroed inputs) and stores "
        "experts transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H]); kt-kernel applies "
        "routing weights to expert outputs",
    ),
    (
        ("longcat_flash",),
        "routes tokens to zero (identity) experts beside the SwiGLU experts; kt-kernel "
        "computes SwiGLU experts only",
    ),
    (
        ("muse_spark", "muse_spark_text"),
        "applies an RMSNorm inside every expert after down_proj; kt-kernel has no per-expert "
        "output norm",
    ),
    (
        ("inkling_mm_model", "inkling_text"),
        "plain SwiGLU experts in the fused layout, but the router's weight is [E + shared, H] "
        "and it returns shared-expert weights beside the routed ones (a router shape "
        "MoEArchitecture does not describe)" + _NOT_YET,
    ),
    (("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text"), _SOFTCAPPED),
    (
        ("beam",),
        "SwiGLU computed in fp32 inside an overridden _apply_gate, which wrap does not read "
        "as kt_kernel.SwiGLU" + _NOT_YET,
    ),
)
UNSUPPORTED_FAMILIES: dict[str, str] = {t: why for types, why in _REFUSED for t in types}
