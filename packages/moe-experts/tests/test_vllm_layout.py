"""The names and layout ``export --format vllm`` gives LoRA, against what transformers saves.

vLLM loads LoRA by the names the base checkpoint gives its weights; ``checkpoint_rows`` finds
them by reversing transformers' load-time conversion. The oracle here is the checkpoint that
``save_pretrained`` really writes: every row the function places must be that checkpoint
tensor's row, for every family. (vLLM itself reading the exports: tests/serving.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_experts import ARCHITECTURES
from moe_experts.finetune.vllm_serving import (
    VLLM_LORA_ARCHITECTURES,
    ServingInfo,
    checkpoint_rows,
    conversion_twin,
    serve_command,
    serving_info,
)
from moe_experts.testing import tiny_model


def _saved(model: torch.nn.Module, tmp_path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_checkpoint_rows_are_the_saved_checkpoints_rows(family: str, tmp_path: Path) -> None:
    model = tiny_model(family).eval()
    saved = _saved(model, tmp_path)
    twin = conversion_twin(model)  # what the export passes: no weights, same conversions
    state = model.state_dict()
    spec = ARCHITECTURES[family]
    layer = next(n.split(".experts.")[0] for n in state if n.endswith("experts.gate_up_proj"))
    names = [f"{layer}.experts.gate_up_proj", f"{layer}.experts.down_proj"]
    names += [n for n in state if n.endswith("self_attn.o_proj.weight")][:1]
    for name in names:
        param = state[name]
        out_dim = (2 if spec.transposed else 1) if param.ndim == 3 else 0
        where = checkpoint_rows(twin, name, tuple(param.shape), out_dim=out_dim)
        covered = 0
        for w in where:
            stored = saved.get(f"{w.key}.weight", saved.get(w.key))
            assert stored is not None, (name, w.key, sorted(saved)[:8])
            if w.rows is None:  # kept whole, perhaps renamed
                assert stored.numel() == param.numel(), (name, w.key)
                covered = param.shape[out_dim]
                continue
            matrix = param[w.expert] if param.ndim == 3 else param
            if spec.transposed and param.ndim == 3:
                matrix = matrix.T  # [out, in]
            torch.testing.assert_close(stored, matrix[w.rows], rtol=0, atol=0)
            covered += len(w.rows)
        n_experts = param.shape[0] if param.ndim == 3 and where[0].rows is not None else 1
        assert covered == param.shape[out_dim] * n_experts, (name, covered)


def test_serve_command_is_json_lora_modules_with_the_rank_it_needs(tmp_path: Path) -> None:
    cmd = serve_command("base", tmp_path / "a", name="a", rank=8, is_3d_lora_weight=False)
    assert cmd[:4] == ("vllm", "serve", "base", "--enable-lora")
    assert "--max-lora-rank" not in cmd  # vLLM's default (16) holds rank 8
    assert json.loads(cmd[-1]) == {
        "name": "a",
        "path": str(tmp_path / "a"),
        "is_3d_lora_weight": False,
    }
    cmd = serve_command("base", tmp_path, name="b", rank=24, is_3d_lora_weight=True)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "32"
    assert json.loads(cmd[-1])["is_3d_lora_weight"] is True


def test_serving_info_follows_the_model_class(tmp_path: Path) -> None:
    gpt_oss = serving_info("GptOssForCausalLM", "b", tmp_path, name="x", rank=8)
    assert gpt_oss.is_3d_lora_weight
    assert gpt_oss.vllm_lora_model
    qwen = serving_info("Qwen3MoeForCausalLM", "b", tmp_path, name="x", rank=8)
    assert not qwen.is_3d_lora_weight
    assert qwen.vllm_lora_model
    unknown = serving_info("AriaTextForCausalLM", "b", tmp_path, name="x", rank=8)
    assert not unknown.vllm_lora_model
    assert not unknown.is_3d_lora_weight
    path = qwen.write(tmp_path)
    data = json.loads(path.read_text())
    assert data["command"] == list(qwen.command)
    assert data["architecture"] == "Qwen3MoeForCausalLM"
    assert isinstance(qwen, ServingInfo)
    assert all(isinstance(v.experts_3d, bool) for v in VLLM_LORA_ARCHITECTURES.values())
