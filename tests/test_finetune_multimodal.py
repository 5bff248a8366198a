"""Multimodal MoE checkpoints fine-tune from the CLI (text only) and load back with PEFT.

Qwen3-VL-MoE and GLM-4.5V have no ``AutoModelForCausalLM`` mapping; the CLI loads them with
``AutoModelForImageTextToText`` (vision tower frozen, untouched) and ``generate``/``export``
load the adapter the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file

from lora_checkpoint import resolve_checkpoint
from moe_experts.finetune.adapters import load_with_adapter
from moe_experts.finetune.cli import finetune_main
from moe_experts.finetune.data import ByteTokenizer
from moe_experts.finetune.tokenizer import save_byte_tokenizer
from moe_experts.testing import tiny_model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "glm4v_moe"])
def test_multimodal_checkpoint_fine_tunes_on_text(family: str, tmp_path: Path, capsys) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    base_dir = tmp_path / family
    tiny_model(family, vocab_size=ByteTokenizer.vocab_size).save_pretrained(base_dir)
    save_byte_tokenizer(base_dir)
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_pretrained(base_dir)  # why the CLI needs another class

    run = tmp_path / "run"
    rc = finetune_main(
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
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "from transformers import AutoModelForImageTextToText; from peft import" in out

    ckpt = resolve_checkpoint(run / "checkpoints")
    keys = list(load_file(ckpt / "adapter_model.safetensors"))
    assert any(".language_model.layers." in k and "self_attn" in k for k in keys)
    assert any(".mlp.experts." in k for k in keys)
    assert not any("visual" in k for k in keys), [k for k in keys if "visual" in k][:3]

    # The CLI's loader for generate/export runs the adapter on the image-text model: it
    # changes the text logits, exactly as plain PEFT does.
    ids = torch.tensor([[256, *b"hello there"]])
    base = AutoModelForImageTextToText.from_pretrained(base_dir).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        cli_logits = load_with_adapter(None, run / "checkpoints").model(input_ids=ids).logits
    assert float((cli_logits - plain).abs().max()) > 1e-4
    if family == "glm4v_moe" and Version(transformers.__version__).release < (5, 17):
        # transformers 5.1's GLM MoE blocks read gate.e_score_correction_bias through the
        # router, which PEFT's router LoRA wraps, so a plain PEFT forward raises there
        # (load_with_adapter exposes the buffer; tests/test_export_vllm_mla.py checks it).
        return
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, ckpt).eval()(input_ids=ids).logits
    torch.testing.assert_close(cli_logits, peft_logits, rtol=1e-5, atol=1e-6)
