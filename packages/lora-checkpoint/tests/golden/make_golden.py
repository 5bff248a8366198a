"""Regenerate the golden fixtures of the current format (when it changes on purpose).

Usage: ``python tests/golden/make_golden.py`` from ``packages/lora-checkpoint``. It writes
``manifest_schema_v{N}.json``, ``manifest_v{N}_normalised.json`` and ``root_v{N}/`` for
``N = FORMAT_VERSION``. Fixtures of older formats (``*_v1*``, ``root_v1/``, written by
lora-checkpoint 0.1.0) are never regenerated: they prove old checkpoints stay readable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import lora_checkpoint as lc
from lora_core import LoraConfig
from lora_core.contracts import AdaptationResult, ComponentVersion, PeftExport, PeftTensorLayout

HERE = Path(__file__).parent


def golden_result() -> AdaptationResult:
    """A small result whose values depend on nothing but this code."""
    a = torch.nn.Parameter(torch.arange(8.0).reshape(2, 4))
    b = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2) / 8)
    ea = torch.nn.Parameter(torch.arange(12.0).reshape(2, 2, 3).bfloat16())
    rl = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    return AdaptationResult.create(
        adapted_layers=["lin"],
        named_optimizer_parameters=[
            ("lin.lora_A.weight", a),
            ("lin.lora_B.weight", b),
            ("experts.lora_A", ea),
            ("bias.rank", rl),
        ],
        ownership={
            "lin.lora_A.weight": "replicated",
            "lin.lora_B.weight": "replicated",
            "experts.lora_A": "replicated",
            "bias.rank": "rank_local",
        },
        producer=ComponentVersion("lora-core", "0.1.0"),
        lora_config=LoraConfig(enable=True, rank=2, alpha=4, target_modules=("lin",)),
        rank_local_names=["bias.rank"],
        peft_exports={
            "lin.lora_A.weight": PeftExport("base_model.model.lin.lora_A.weight"),
            "lin.lora_B.weight": PeftExport("base_model.model.lin.lora_B.weight"),
            "experts.lora_A": PeftExport(
                "base_model.model.experts.lora_A.weight", PeftTensorLayout.EXPERT_STACKED_A
            ),
        },
        peft_target_modules=["lin"],
        peft_target_parameters=["experts.weight"],
    )


def schema_summary() -> dict:
    """Every manifest model's fields, annotations and required flags (pydantic-independent)."""
    models = [
        lc.Manifest,
        lc.TensorEntry,
        lc.FileEntry,
        lc.ParameterEntry,
        lc.RankShard,
        lc.TrainingStateInfo,
    ]
    return {
        m.__name__: {
            name: {"annotation": str(f.annotation), "required": f.is_required()}
            for name, f in m.model_fields.items()
        }
        for m in models
    }


def normalised_manifest(manifest: lc.Manifest) -> dict:
    """The manifest as JSON with the fields that change every run or release blanked."""
    raw = json.loads(manifest.to_json())
    raw["created_at"] = "<created_at>"
    for c in raw["components"]:
        if c["name"] == "lora-checkpoint":
            c["version"] = "<version>"
    return raw


def main() -> None:
    """Write the current format's schema, normalised manifest and committed checkpoint."""
    v = lc.FORMAT_VERSION
    (HERE / f"manifest_schema_v{v}.json").write_text(
        json.dumps(schema_summary(), indent=2, sort_keys=True) + "\n"
    )
    shutil.rmtree(HERE / f"root_v{v}", ignore_errors=True)
    m = lc.save(HERE / f"root_v{v}", golden_result(), step=1)
    (HERE / f"manifest_v{v}_normalised.json").write_text(
        json.dumps(normalised_manifest(m), indent=2, sort_keys=True) + "\n"
    )


if __name__ == "__main__":
    main()
