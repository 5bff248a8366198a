"""Architecture specs: where each supported MoE family keeps its experts, router and weights.

transformers 5.x stores the routed experts of every family below as one module holding fused
3D parameters, by default ``gate_up_proj [E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up,
split with ``chunk(2, dim=-1)`` after ``F.linear``) and ``down_proj [E, H, I]``, called by the
MoE block as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. A family
that stores them otherwise (GPT-OSS: transposed ``[E, H, 2I]`` / ``[E, I, H]``, gate and up
interleaved, with biases) says so in its spec's layout fields, and the spec's methods are the
one place that converts that layout into kt-kernel's. The block's router is left untouched by
:func:`moe_experts.wrap`, so routing stays bit-identical to transformers.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from moe_experts.errors import LoadError, TransformersVersionError, UnsupportedModelError
from moe_experts.isolation import Packing

__all__ = [
    "ARCHITECTURES",
    "TRANSFORMERS_FLOOR",
    "UNSUPPORTED_FAMILIES",
    "MoEArchitecture",
    "MoEBlockSite",
    "checkpoint_model_type",
    "find_architecture",
    "iter_moe_blocks",
    "require_transformers",
]

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
        shapes = {
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
            v = gate_up.unflatten(2, split)  # [E, H, (I, 2) | (2, I)]
            return v.permute(0, 3, 2, 1) if self.interleaved else v.permute(0, 2, 3, 1)
        if self.interleaved:  # [E, 2I, H] with rows gate0, up0, gate1, ...
            return gate_up.unflatten(1, (i, 2)).transpose(1, 2)
        return gate_up.unflatten(1, (2, i))

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
        return t.unflatten(dim, (i, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1)

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
            return getattr(module, self.block_class)
        except (ImportError, AttributeError) as exc:
            raise UnsupportedModelError(
                f"architecture {self.family!r} expects {self.modeling_module}.{self.block_class}, "
                "which the installed transformers does not provide; upgrade with: "
                f"pip install -U 'transformers>={self.min_transformers}'"
            ) from exc


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


_SHARED = {"shared_expert_attrs": ("shared_experts",)}
_QWEN_SHARED = {
    "shared_expert_attrs": ("shared_expert",),
    "shared_expert_gate_attr": "shared_expert_gate",
}
_GROUPED = "sigmoid, grouped top-k, bias, scaling"
# Packing (moe_experts.isolation): families whose restarting position_ids alone do not keep
# packed examples apart. Each claim is proved per family by the shared suite
# (tests/test_architectures.py: a packed row equals each example run alone).
_OWN_MASKS = {
    "packing": Packing.MASKS,
    "packing_reason": "transformers builds this family's masks without position_ids",
}
_NO_RESET = (
    "; transformers resets it at example boundaries only through {} (CUDA), "
    "never on its PyTorch path"
)
_GATED_DELTA_NET = {
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
        # Not in 5.18; 5.24 is the oldest release it was verified with.
        _spec("kolibri1", "Kolibri1SparseMoeBlock", min_transformers="5.24", **_SHARED),
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

# Families transformers ships whose experts kt-kernel cannot compute (yet): refused by name.
UNSUPPORTED_FAMILIES: dict[str, str] = {
    "openai_privacy_filter": "a token-classification encoder, not a causal LM; moe-experts "
    "fine-tunes causal LMs (its GPT-OSS-style experts would fit MoEArchitecture's layout "
    "fields: transposed, concatenated, biases)",
    "diffusion_gemma": "a block-diffusion model (DiffusionGemmaForBlockDiffusion), not a causal "
    "LM, with its MoE in two layer classes (encoder and decoder); its gated tanh-GELU experts "
    "are Gemma-4's, which kt-kernel computes, but no spec or equality test covers this model",
    "glm5_next": "SwiGLU clamped at swiglu_limit, the formula of kt_kernel.SwiGLULimit, but "
    "not yet registered with a tiny config and equality tests",
    "hy_v4": "SwiGLU clamped at swiglu_limit, the formula of kt_kernel.SwiGLULimit, but "
    "not yet registered with a tiny config and equality tests",
    "hy_v4_vl": "SwiGLU clamped at swiglu_limit, the formula of kt_kernel.SwiGLULimit, but "
    "not yet registered with a tiny config and equality tests",
    "step3p7": "SwiGLU clamped after the activation; kt-kernel has no such activation",
    "minimax_m3_vl": "clamped SwiGLU (alpha, limit); kt-kernel has no clamped_swiglu yet",
    "llama4": "Llama 4 scales each chosen expert's *input* by the sigmoid of its router logit "
    "(expert(w * x), not w * expert(x); top-1 in the released models), and SwiGLU is not "
    "linear, so the weight cannot move to the output; its experts module takes no expert ids "
    "(every expert runs on every token, unchosen ones on zeroed inputs) and stores experts "
    "transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H]); kt-kernel applies routing "
    "weights to expert outputs",
    "longcat_flash": "routes tokens to zero (identity) experts beside the SwiGLU experts; "
    "kt-kernel computes SwiGLU experts only",
    "muse_spark": "applies an RMSNorm inside every expert after down_proj; kt-kernel has no "
    "per-expert output norm",
    "inkling": "soft-capped SwiGLU experts; kt-kernel has no such activation",
    "inkling2": "soft-capped SwiGLU experts; kt-kernel has no such activation",
    "inkling2_loop": "soft-capped SwiGLU experts; kt-kernel has no such activation",
    "beam": "custom gated activation in the experts; kt-kernel computes SwiGLU only",
}


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
    except ValueError as exc:
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
