"""The finetune CLI streams a checkpoint's experts onto kt-kernel instead of loading them twice.

A causal-LM checkpoint goes through ``moe_experts.load_pretrained`` (never through
``from_pretrained``, which would hold every expert in the model dtype before ``wrap`` copies it),
bitwise equal to ``from_pretrained`` + ``wrap``; a DeepSeek-V3-style FP8 checkpoint fine-tunes on
its shipped E4M3 bytes with ``--weight-dtype fp8`` and with the default ``auto``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moe_experts
from lora_checkpoint import resolve_checkpoint
from moe_experts.finetune.cli import finetune_main
from moe_experts.finetune.data import ByteTokenizer
from moe_experts.finetune.models import load_model
from moe_experts.finetune.tokenizer import save_byte_tokenizer
from moe_experts.testing import save_fp8_checkpoint, tiny_model


def _kernels(model: torch.nn.Module) -> list[moe_experts.KernelExperts]:
    return [m for m in model.modules() if isinstance(m, moe_experts.KernelExperts)]


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE saved as the hub ships it: per-expert 2-D keys, two shards."""
    path = tmp_path_factory.mktemp("hub") / "qwen3_moe"
    model = tiny_model("qwen3_moe", vocab_size=ByteTokenizer.vocab_size)
    model.save_pretrained(path, max_shard_size="100KB", save_original_format=True)
    save_byte_tokenizer(path)
    return path


def test_load_model_streams_and_equals_from_pretrained_and_wrap(
    hub_checkpoint: Path, monkeypatch
) -> None:
    want = AutoModelForCausalLM.from_pretrained(hub_checkpoint, dtype=torch.float32)
    moe_experts.wrap(want, weight_dtype="bf16")

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded the whole model with from_pretrained")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    loaded = load_model(str(hub_checkpoint), weight_dtype="bf16")
    assert loaded.shared_by == 1
    kernels = _kernels(loaded.model)
    assert len(kernels) == len(_kernels(want)) > 0
    assert all(k.expert_weights.weight_dtype == "bf16" for k in kernels)
    ids = torch.tensor([[256, *b"streamed experts"]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, want(ids).logits)


def test_cli_fine_tunes_without_from_pretrained(
    hub_checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded the whole model with from_pretrained")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    run = tmp_path / "run"
    rc = finetune_main(
        [
            "--model",
            str(hub_checkpoint),
            "--steps",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--weight-dtype",
            "bf16",
            "--output",
            str(run),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "expert storage: bf16\n" in err  # a named format: no resolution to report
    assert (resolve_checkpoint(run / "checkpoints") / "adapter_model.safetensors").is_file()


def test_load_model_streams_a_multimodal_checkpoint(tmp_path: Path, monkeypatch) -> None:
    # Qwen3-VL-MoE as the hub ships it (experts transposed: gate_up [E, H, 2I]); the whole
    # image-text model would hold every expert before wrap copies it, so the CLI must stream
    # it through load_pretrained, with --weight-dtype auto resolved from the checkpoint.
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from moe_experts.checkpoint_experts import streams_with_installed_transformers

    if not streams_with_installed_transformers("qwen3_vl_moe"):
        pytest.skip("this transformers has Qwen3-VL-MoE's older expert layout: the CLI loads whole")

    path = tmp_path / "qwen3_vl_moe"
    model = tiny_model(
        "qwen3_vl_moe", vocab_size=ByteTokenizer.vocab_size, moe_intermediate_size=24
    )
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    tensors = load_file(path / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    want = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    moe_experts.wrap(want, weight_dtype="fp32")
    with torch.no_grad():  # own the weights (not views of the file mapping): same BLAS paths
        for p in want.parameters():
            if not moe_experts.is_placeholder(p):
                p.data = p.data.clone()

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded the whole model with from_pretrained")

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", refuse)
    loaded = load_model(str(path), weight_dtype="auto")
    assert loaded.storage == "fp32 (auto: the checkpoint's float32 weights)"
    assert type(loaded.model) is type(want)
    kernels = _kernels(loaded.model)
    assert len(kernels) == len(_kernels(want)) > 0
    for got, ref in zip(kernels, _kernels(want), strict=True):
        assert torch.equal(got.expert_weights.gate_up, ref.expert_weights.gate_up)
        assert torch.equal(got.expert_weights.down, ref.expert_weights.down)
    ids = torch.tensor([[256, *b"streamed vision-language experts"]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, want(ids).logits)


def test_load_pretrained_names_transformers_when_it_cannot_stream_qwen3_vl(tmp_path: Path) -> None:
    # transformers 5.1 (the lowest cell) converts Qwen3-VL-MoE's experts by a chain the
    # streaming reader does not follow: one error naming the version and the fix, not a
    # shape mismatch deep in the load.
    import transformers

    from moe_experts.checkpoint_experts import streams_with_installed_transformers

    if streams_with_installed_transformers("qwen3_vl_moe"):
        pytest.skip("this transformers streams Qwen3-VL-MoE (the test above loads it)")
    path = tmp_path / "qwen3_vl_moe"
    tiny_model("qwen3_vl_moe", moe_intermediate_size=24).save_pretrained(path)
    with pytest.raises(moe_experts.TransformersVersionError) as err:
        moe_experts.load_pretrained(path)
    msg = str(err.value)
    assert str(path / "config.json") in msg
    assert "'qwen3_vl_moe'" in msg
    assert f"transformers {transformers.__version__}" in msg
    assert "transformers>=5.17" in msg


def test_cli_fine_tunes_fp8_checkpoint_on_its_shipped_bytes(tmp_path: Path, capsys) -> None:
    path = save_fp8_checkpoint(
        tiny_model(
            "deepseek_v3",
            vocab_size=ByteTokenizer.vocab_size,
            hidden_size=256,
            moe_intermediate_size=128,
            intermediate_size=256,
        ),
        tmp_path / "fp8",
    )
    save_byte_tokenizer(path)
    loaded = load_model(str(path), weight_dtype="fp8")
    kernels = _kernels(loaded.model)
    assert kernels
    assert all(k.expert_weights.weight_dtype == "fp8" for k in kernels)

    run = tmp_path / "run"
    rc = finetune_main(
        [
            "--model",
            str(path),
            "--steps",
            "3",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--output",
            str(run),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    # --weight-dtype defaults to auto, which keeps the checkpoint's shipped FP8 bytes.
    assert "expert storage: fp8 (auto: the checkpoint's quantization_config (fp8))" in err
    ckpt = resolve_checkpoint(run / "checkpoints")
    from safetensors.torch import load_file

    adapter = load_file(ckpt / "adapter_model.safetensors")
    experts = {k: v for k, v in adapter.items() if ".mlp.experts." in k}
    assert experts
    # B starts at zero; after three steps the expert LoRA has moved.
    assert any(float(v.abs().max()) > 0 for k, v in experts.items() if "lora_B" in k)
