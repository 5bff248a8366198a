"""Our side of the serving check: tiny models, a few training steps, the export, PEFT's deltas.

Everything here runs in the project's own environment (transformers + PEFT + our packages);
``vllm_check.py`` runs in vLLM's venv and reads what :func:`prepare` writes.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# A Qwen3.5-MoE checkpoint as released: the multimodal class, whose vLLM model reads 3-D
# expert LoRA (the text-only class of the qwen3_5_moe family reads 2-D in vLLM 0.32).
QWEN3_5_MOE_VL = "qwen3_5_moe_vl"
# Config fields a real checkpoint has and vLLM's model requires, which the tiny configs drop
# (LoRA deltas do not depend on them). GPT-OSS: vLLM builds YaRN rotary embeddings only.
SERVING_OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 32,
            "truncate": False,
        }
    },
    # Fields of the released checkpoints' config.json that vLLM 0.32 reads and transformers
    # 5.24's config classes drop or leave unset.
    "minimax_m2": {"rotary_dim": 8, "scoring_func": "sigmoid"},
    "qwen3_vl_moe": {"norm_topk_prob": True},
    "glm4v_moe": {"use_qk_norm": False},
    "hy_v3": {"expert_hidden_dim": 16, "route_norm": True},
    "afmoe": {"score_func": "sigmoid", "route_norm": True},
    "mellum": {"num_nextn_predict_layers": 0},
}


@dataclass
class Prepared:
    """One family's export, ready for vllm_check.py, and what the export said."""

    name: str
    family: str
    architecture: str
    adapter: Path
    serving: dict[str, Any]
    trained: list[str]
    exported: list[str]
    warnings: list[str]
    stdout: str
    case: dict[str, Any] = field(default_factory=dict)


def _model(name: str, vocab: int) -> Any:
    """The tiny model of family ``name`` (or the multimodal Qwen3.5-MoE)."""
    from moe_experts.testing import tiny_config, tiny_model

    if name != QWEN3_5_MOE_VL:
        return tiny_model(name, vocab_size=vocab, **SERVING_OVERRIDES.get(name, {}))
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = tiny_config("qwen3_5_moe", vocab_size=vocab).to_dict()
    text.pop("model_type", None)
    config = AutoConfig.for_model(
        "qwen3_5_moe",
        text_config=text,
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": 32,
        },
    )
    return AutoModelForImageTextToText.from_config(config)


def _family(name: str) -> str:
    return "qwen3_5_moe" if name == QWEN3_5_MOE_VL else name


def reference_deltas(
    base_dir: Path, checkpoint: Path, *, fused_experts: bool
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """PEFT's merged delta of every LoRA layer of ``checkpoint``, named as the checkpoint does.

    PEFT's ``get_delta_weight`` (what ``merge`` adds) of each trained module is put through
    transformers' own reversed load-time conversion (``revert_weight_conversion``, what
    ``save_pretrained`` runs), so every delta carries the checkpoint name and layout of the
    base weight it adds to: the names vLLM loads base weights by (Mixtral's fused
    ``mlp.experts.gate_up_proj [E, 2I, H]`` becomes ``block_sparse_moe.experts.{e}.w1/w3``).
    Fused experts that the checkpoint keeps fused, or that vLLM's model class reads fused
    (``fused_experts``: ``is_3d_moe_weight``), stay one ``[E, out, in]`` delta named by the
    module path with the checkpoint's prefix.

    Returns:
        ``(deltas, trained)``: checkpoint key -> delta, and trained module -> its checkpoint
        keys. A module LoRA is named by its module, a PEFT ``target_parameters`` wrapper by
        ``<owner>.<parameter>`` (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``), as the
        export's warnings name them.
    """
    from peft import PeftModel
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    from transformers.core_model_loading import revert_weight_conversion

    from moe_experts.finetune.models import pretrained_class

    # The class the fine-tune trained (a causal LM where transformers maps the checkpoint's
    # model_type to one, as Qwen3.5-MoE's multimodal checkpoint), so PEFT's keys match.
    auto = pretrained_class(base_dir)
    model = PeftModel.from_pretrained(auto.from_pretrained(base_dir), checkpoint)
    base = auto.from_pretrained(base_dir)  # PEFT's wrappers hide parameters the revert reads
    deltas: dict[str, torch.Tensor] = {}
    trained: dict[str, list[str]] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
                continue
            delta = module.get_delta_weight("default").detach().float().contiguous()
            if isinstance(module, ParamWrapper):
                owner = name
                while owner.endswith(".base_layer"):
                    owner = owner.removesuffix(".base_layer")
                key = f"{owner.removeprefix('base_model.model.')}.{module.parameter_name}"
                weight = key
            else:
                key = name.removeprefix("base_model.model.")
                weight = f"{key}.weight"
            stored = revert_weight_conversion(base, {weight: delta})
            whole = len(stored) == 1 and next(iter(stored.values())).ndim == 3
            if delta.ndim == 3 and (fused_experts or whole):
                # Experts the checkpoint keeps fused: vLLM reads their LoRA by the module path
                # (with the checkpoint's prefix), whatever the checkpoint calls the tensor.
                probe = f"{owner.removeprefix('base_model.model.')}.probe.weight"
                (path,) = revert_weight_conversion(base, {probe: torch.zeros(1, 1)})
                stored = {f"{path.removesuffix('.probe.weight')}.{module.parameter_name}": delta}
            trained[key] = sorted(stored)
            deltas.update({k: v.contiguous() for k, v in stored.items()})
    return deltas, trained


def prepare(name: str, root: Path) -> Prepared:
    """Build, train two steps, export for vLLM and write PEFT's deltas for family ``name``."""
    from safetensors.torch import load_file, save_file

    from lora_checkpoint import resolve_checkpoint
    from moe_experts import ARCHITECTURES
    from moe_experts.finetune.cli import finetune_main
    from moe_experts.finetune.data import ByteTokenizer
    from moe_experts.finetune.export import export_main
    from moe_experts.finetune.tokenizer import save_byte_tokenizer

    work = root / name
    base = work / "base"
    model = _model(name, ByteTokenizer.vocab_size)
    model.save_pretrained(base)
    save_byte_tokenizer(base)
    architecture = model.config.architectures[0]
    del model
    run = work / "run"
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        code = finetune_main(
            [
                "--model",
                str(base),
                "--steps",
                "2",
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--lr",
                "1e-2",
                # alpha / r = 3: a scaling that is not 1 must reach vLLM's buffers too.
                "--lora-rank",
                "8",
                "--lora-alpha",
                "24",
                "--output",
                str(run),
                "--no-progress",
            ]
        )
    if code != 0:
        raise RuntimeError(f"{name}: finetune failed:\n{quiet.getvalue()[-3000:]}")
    adapter = work / "vllm"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = export_main([str(run / "checkpoints"), "--format", "vllm", "--output", str(adapter)])
    if code != 0:
        raise RuntimeError(f"{name}: export failed:\n{err.getvalue()[-3000:]}")
    checkpoint = resolve_checkpoint(run / "checkpoints")
    serving = json.loads((adapter / "serving.json").read_text())
    reference, trained = reference_deltas(
        base, checkpoint, fused_experts=serving["is_3d_lora_weight"]
    )
    save_file(reference, str(work / "reference.safetensors"))
    exported = sorted(_exported_modules(load_file(adapter / "adapter_model.safetensors"), trained))
    prepared = Prepared(
        name=name,
        family=_family(name),
        architecture=architecture,
        adapter=adapter,
        serving=serving,
        trained=sorted(trained),
        exported=exported,
        warnings=[line for line in err.getvalue().splitlines() if line.startswith("warning: ")],
        stdout=out.getvalue(),
    )
    spec = ARCHITECTURES[_family(name)]
    prepared.case = {
        "name": name,
        "command": serving["command"],
        "reference": str(work / "reference.safetensors"),
        # trained module -> its checkpoint keys, for the modules the export wrote
        "exported": {key: trained[key] for key in exported},
        "interleaved": spec.interleaved,
        "transposed": spec.transposed,
    }
    return prepared


def _exported_modules(tensors: dict[str, torch.Tensor], trained: dict[str, list[str]]) -> set[str]:
    """The trained modules whose LoRA the export wrote (any of their checkpoint names)."""
    owner_of = {module: module for module in trained}
    for module, keys in trained.items():
        for key in keys:
            owner_of[key.removesuffix(".weight")] = module
    out: set[str] = set()
    for key in tensors:
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        if module.endswith(".base_layer"):  # 3-D experts: gate_up under base_layer
            module = f"{module.removesuffix('.base_layer')}.gate_up_proj"
        elif f"{module}.down_proj" in owner_of:  # 3-D experts: down_proj on the wrapper itself
            module = f"{module}.down_proj"
        elif module not in owner_of:  # experts fused in the checkpoint, 2-D in vLLM
            experts, proj = module.rsplit(".", 2)[0], module.rsplit(".", 1)[-1]
            module = f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if module not in owner_of:
            raise KeyError(f"exported key {key} matches no trained module")
        out.add(owner_of[module])
    return out
