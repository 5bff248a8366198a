"""vLLM export of a multi-head-latent-attention model: every trained module is exported or named.

A tiny DeepSeek-V3 is fine-tuned for two steps with the default targets (MLA attention, routers,
experts, lm_head), exported with ``--format vllm``, and the exported module list is compared
with the trained one read back from the checkpoint with safetensors; every exported attention
delta equals what PEFT merges from the checkpoint, and the loader of generate/export runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_checkpoint import resolve_checkpoint
from moe_experts.finetune.adapters import load_with_adapter
from moe_experts.finetune.cli import finetune_main
from moe_experts.finetune.data import ByteTokenizer
from moe_experts.finetune.export import export_main
from moe_experts.finetune.tokenizer import save_byte_tokenizer
from moe_experts.testing import tiny_model

PREFIX = "base_model.model."
MLA_EXPORTED = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"}


def _modules(tensors: dict) -> set[str]:
    return {k.removeprefix(PREFIX).split(".lora_")[0] for k in tensors}


@pytest.mark.timeout(300)
def test_vllm_export_keeps_mla_attention_and_names_what_it_leaves_out(
    tmp_path: Path, capsys
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_model("deepseek_v3", vocab_size=ByteTokenizer.vocab_size).save_pretrained(base_dir)
    save_byte_tokenizer(base_dir)
    run = tmp_path / "run"
    assert (
        finetune_main(
            [
                "--model",
                str(base_dir),
                "--steps",
                "2",
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--output",
                str(run),
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    out = tmp_path / "vllm"
    assert export_main([str(run / "checkpoints"), "--format", "vllm", "--output", str(out)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]

    ckpt = resolve_checkpoint(run / "checkpoints")
    trained = _modules(load_file(ckpt / "adapter_model.safetensors"))
    exported_tensors = load_file(out / "adapter_model.safetensors")
    exported = _modules(exported_tensors)
    cfg = json.loads((out / "adapter_config.json").read_text())

    n_layers = 3
    for i in range(n_layers):
        for leaf in MLA_EXPORTED:
            assert f"model.layers.{i}.self_attn.{leaf}" in exported, (i, leaf, sorted(exported))
    assert set(cfg["target_modules"]) >= MLA_EXPORTED
    # Every trained module is exported (routed experts as per-expert keys) or named in exactly
    # one warning; nothing is dropped without a word.
    for module in trained:
        if ".mlp.experts" in module:  # PEFT's (nested) ParamWrappers on the fused experts
            experts = module[: module.index(".mlp.experts")] + ".mlp.experts."
            assert any(m.startswith(experts) for m in exported), module
            continue
        # A router is named by its parameter (``mlp.gate.weight``), a module by its name.
        named = [
            w
            for w in warnings
            if any(f"{module}{end}" in w for end in (",", ";", ".weight,", ".weight;"))
        ]
        assert (module in exported) != bool(named), (module, named)
        assert len(named) <= 1, named
    kv_b = [w for w in warnings if "kv_b_proj" in w]
    assert len(kv_b) == 1
    assert "never applies it" in kv_b[0]
    assert "vllm-project/vllm#48974" in kv_b[0]
    assert all(f"model.layers.{i}.self_attn.kv_b_proj" in kv_b[0] for i in range(n_layers))
    assert any("lm_head" in w for w in warnings)
    assert any("model.layers.1.mlp.gate.weight" in w for w in warnings)
    assert "kv_b_proj" not in set(cfg["target_modules"])

    # The exported attention LoRA is what PEFT runs: scaling * B @ A == merged - base.
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), ckpt
    ).merge_and_unload()
    scaling = cfg["lora_alpha"] / cfg["r"]
    checked = 0
    for i in range(n_layers):
        for leaf in MLA_EXPORTED:
            name = f"model.layers.{i}.self_attn.{leaf}"
            a = exported_tensors[f"{PREFIX}{name}.lora_A.weight"]
            b = exported_tensors[f"{PREFIX}{name}.lora_B.weight"]
            delta = merged.get_submodule(name).weight - base.get_submodule(name).weight
            torch.testing.assert_close(scaling * b @ a, delta.detach(), rtol=1e-4, atol=1e-6)
            assert float(delta.abs().max()) > 0, name  # two steps moved every B
            checked += 1
    assert checked == n_layers * len(MLA_EXPORTED)

    # generate/export's loader runs the adapter (router LoRA included) as PEFT does: on
    # transformers < 5.17 the block reads gate.e_score_correction_bias through PEFT's wrapper.
    loaded = load_with_adapter(None, run / "checkpoints")
    ids = torch.tensor([[256, *b"hello"]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(input_ids=ids).logits,
            merged.eval()(input_ids=ids).logits,
            rtol=1e-4,
            atol=1e-5,
        )
