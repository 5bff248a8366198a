"""load_pretrained: streamed experts bitwise equal to from_pretrained + wrap, clear errors."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from moe_experts import KernelExperts, LoadError, is_placeholder, load_pretrained, wrap
from moe_experts.architectures import ARCHITECTURES, checkpoint_model_type
from moe_experts.testing import tiny_config, tiny_model, unstack_experts

from .conftest import FAMILIES, token_batch

LAYOUTS = ("per_expert", "fused")
# Families transformers builds as a causal LM (the tied-head and MTP checks below look up
# their causal-LM class); load_pretrained builds the others (Qwen3-VL-MoE, GLM-4.5V,
# Mistral-Large-3, and Mistral 4, mapped only as image-text-to-text) as lm_class picks them.
CAUSAL_FAMILIES = tuple(
    f for f in FAMILIES if tiny_config(f).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
)
# Multimodal checkpoints of families whose row is tested on the text model: the whole
# image-text model, vision tower included, in its hub layout (``language_model.model.*``).
MULTIMODAL_CASES = {"aria+vision": "aria"}
CASES = (*FAMILIES, *MULTIMODAL_CASES)
# Qwen3-VL-MoE's hub checkpoints ship their experts transposed (gate_up [E, H, 2I], down
# [E, I, H]); transformers transposes only a tensor not already of the model's shape, so the
# expert width must differ from H/2 and H for the transposition to show (and be tested).
OVERRIDES = {"qwen3_vl_moe": {"moe_intermediate_size": 24}}

# Hub-layout keys whose *dense* weights transformers converts on load (Kimi-Linear's
# q/k/v_conv1d concatenated into conv1d and forget-gate renames, Lara-Mini's fused in_proj split
# in four and out_norm renamed, Mistral-Large-3's vision q/k permuted for rotate-half RoPE): a
# per_expert checkpoint must really ship them.
HUB_DENSE_KEYS = {
    "kimi_linear": (".self_attn.q_conv1d.weight", ".self_attn.f_a_proj.weight"),
    "lara_mini": (".linear_attn.in_proj.weight", ".linear_attn.out_norm.weight"),
    "mistral_large4": (".transformer.layers.0.attention.wq.weight",),
}


def _tiny(case: str) -> PreTrainedModel:
    """The tiny model of a family, or of a multimodal case (its family's text config)."""
    if case not in MULTIMODAL_CASES:
        return tiny_model(case, **OVERRIDES.get(case, {}))
    text = tiny_config(MULTIMODAL_CASES[case])
    vision = {
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 4,
        "image_size": 16,
    }
    config = AutoConfig.for_model("aria", text_config=text.to_dict(), vision_config=vision)
    return AutoModelForImageTextToText.from_config(config)


def _ship_transposed(path: Path) -> None:
    """Rewrite Qwen3-VL-MoE's fused experts as its hub checkpoints ship them: [E, in, out]."""
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no dict)
        moved = [k for k in tensors if re.search(r"experts\.(gate_up|down)_proj$", k)]
        for key in moved:
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
        if moved:
            save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each family saved twice, sharded small: the hub layout (per-expert keys where the hub
    ships them) and fused 3-D keys; multimodal ones whole, vision tower included."""
    out = {}
    for case in CASES:
        torch.manual_seed(1234)
        model = _tiny(case)  # random expert biases where the family has them
        for layout in LAYOUTS:
            path = tmp_path_factory.mktemp(f"ckpt-{case}-{layout}")
            model.save_pretrained(
                path, max_shard_size="16KB", save_original_format=layout == "per_expert"
            )
            if case == "qwen3_vl_moe" and layout == "per_expert":
                _ship_transposed(path)
            out[(case, layout)] = path
    return out


# Families whose experts have per-expert nn.Linear names: each must also load from per-expert
# keys its hub may not ship, as Qwen's FP8 releases of fused families do. Not GPT-OSS (expert
# biases have no per-expert names) nor Mistral-Large-3, whose checkpoints use Mistral's own
# names: transformers' renamings for them rewrite an HF-style key (`.mlp.` becomes `.mlp.mlp.`).
UNSTACKABLE = tuple(
    c
    for c in CASES
    if not ARCHITECTURES[MULTIMODAL_CASES.get(c, c)].bias_params and c != "mistral_large4"
)


@pytest.fixture(scope="module")
def unstacked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The ``checkpoints`` models again, every routed expert as per-expert 2-D keys."""
    out = {}
    for case in UNSTACKABLE:
        torch.manual_seed(1234)  # the same weights as the fixture above
        model = _tiny(case)
        path = tmp_path_factory.mktemp(f"ckpt-{case}-unstacked")
        model.save_pretrained(path, max_shard_size="16KB", save_original_format=False)
        out[case] = unstack_experts(model, path)
    return out


def _reference(path: Path, dtype: torch.dtype, weight_dtype: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        causal = checkpoint_model_type(path) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
        model = auto.from_pretrained(path, dtype=dtype).eval()
    wrap(model, weight_dtype=weight_dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            if not is_placeholder(p):
                # from_pretrained leaves uncast weights as views of the file mapping, at
                # addresses only 16-byte aligned; BLAS rounds differently there, so own them.
                p.data = p.data.clone()
    return model


def _kernels(model) -> dict[str, KernelExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, KernelExperts)}


def test_checkpoints_really_use_both_layouts(checkpoints) -> None:
    # Families whose hub checkpoints store experts per expert (transformers converts them on
    # save_original_format); the newer families have no such conversion and save fused keys.
    hub_per_expert = {
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "deepseek_v3",
        "olmoe",
        "deepseek_v4",
        "kimi_linear",
        "glm4v_moe",
        "mistral_large4",
    }
    for (family, layout), path in checkpoints.items():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        keys = list(index["weight_map"])
        assert len(set(index["weight_map"].values())) > 2  # really sharded
        if family in hub_per_expert:
            per_expert = any(".experts.0." in k for k in keys)
            assert per_expert == (layout == "per_expert"), family
        for suffix in HUB_DENSE_KEYS.get(family, ()):
            shipped = any(k.endswith(suffix) for k in keys)
            assert shipped == (layout == "per_expert"), (family, suffix)
    # Multimodal hub layouts as released: Aria's language_model.model.*, Qwen3-VL-MoE's
    # experts transposed (gate_up [E, H, 2I], down [E, I, H]).
    aria = json.loads(
        (checkpoints[("aria+vision", "per_expert")] / "model.safetensors.index.json").read_text()
    )
    assert any(k.startswith("language_model.model.layers.") for k in aria["weight_map"])
    path = checkpoints[("qwen3_vl_moe", "per_expert")]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for proj, shape in (("gate_up_proj", [8, 32, 48]), ("down_proj", [8, 24, 32])):
        key = f"model.language_model.layers.0.mlp.experts.{proj}"
        with safe_open(str(path / index["weight_map"][key]), framework="pt") as f:
            assert f.get_slice(key).get_shape() == shape


@pytest.mark.parametrize("family", UNSTACKABLE)
def test_unstacked_experts_load_like_the_fused_checkpoint(
    checkpoints, unstacked, family: str
) -> None:
    index = json.loads((unstacked[family] / "model.safetensors.index.json").read_text())
    keys = list(index["weight_map"])
    assert any(k.endswith(".experts.0.up_proj.weight") for k in keys), family
    assert not any(k.endswith("gate_up_proj") for k in keys), family
    want = load_pretrained(checkpoints[(family, "fused")], weight_dtype="bf16")
    got = load_pretrained(unstacked[family], weight_dtype="bf16")
    want_k, got_k = _kernels(want), _kernels(got)
    assert want_k
    assert list(got_k) == list(want_k)
    for name, ref in want_k.items():
        have = got_k[name].expert_weights
        assert torch.equal(have.gate_up, ref.expert_weights.gate_up), name
        assert torch.equal(have.down, ref.expert_weights.down), name
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("dtype", "weight_dtype"), [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]
)
@pytest.mark.parametrize("family", CASES)
def test_bitwise_equal_to_from_pretrained_and_wrap(
    checkpoints, family: str, layout: str, dtype: torch.dtype, weight_dtype: str
) -> None:
    path = checkpoints[(family, layout)]
    ref = _reference(path, dtype, weight_dtype)
    got = load_pretrained(path, weight_dtype=weight_dtype, dtype=dtype)  # type: ignore[arg-type]
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert list(got_sd) == list(ref_sd)
    for name, want in ref_sd.items():
        have = got_sd[name]
        assert have.dtype == want.dtype, name
        if is_placeholder(want):
            assert is_placeholder(have), name
            assert have.shape == want.shape, name
        else:
            assert torch.equal(have, want), name
    for (name, want), (_, have) in zip(
        ref.named_buffers(), got.named_buffers(), strict=True
    ):  # non-persistent buffers too (rotary tables)
        assert torch.equal(have, want), name
    ref_k, got_k = _kernels(ref), _kernels(got)
    assert ref_k
    assert list(got_k) == list(ref_k)
    for name, want in ref_k.items():
        have = got_k[name].expert_weights
        assert have.weight_dtype == want.expert_weights.weight_dtype
        assert torch.equal(have.gate_up, want.expert_weights.gate_up), name
        assert torch.equal(have.down, want.expert_weights.down), name
        for bias in ("gate_up_bias", "down_bias"):  # GPT-OSS: converted like the weights
            a, b = getattr(have, bias), getattr(want.expert_weights, bias)
            assert (a is None) == (b is None), (name, bias)
            assert a is None or (torch.equal(a, b) and a.abs().sum() > 0), (name, bias)
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
    assert not got.training


def test_int8_equal_to_wrap(checkpoints) -> None:
    path = checkpoints[("qwen3_moe", "per_expert")]
    ref = _reference(path, torch.bfloat16, "int8")
    got = load_pretrained(path, weight_dtype="int8", dtype=torch.bfloat16)
    for name, want in _kernels(ref).items():
        have = _kernels(got)[name].expert_weights
        assert have.is_quantized
        assert torch.equal(have.gate_up, want.expert_weights.gate_up), name
        assert torch.equal(have.down, want.expert_weights.down), name
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


def test_weights_do_not_alias_the_files(checkpoints, tmp_path: Path) -> None:
    import shutil

    src = checkpoints[("olmoe", "per_expert")]
    path = tmp_path / "copy"
    shutil.copytree(src, path)
    got = load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    for shard in path.glob("*.safetensors"):
        # Overwritten in place: a tensor still backed by a file mapping would change with it.
        with shard.open("r+b") as f:
            f.write(b"\0" * shard.stat().st_size)
    ids = token_batch()
    ref = _reference(src, torch.float32, "fp32")
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


def _rewrite_shard(path: Path, key: str, new: torch.Tensor | None) -> Path:
    """Replace (or with ``None`` drop) ``key`` in its shard; return the shard file."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = path / index["weight_map"][key]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if new is None:
        del tensors[key]
        del index["weight_map"][key]
        index_file.write_text(json.dumps(index))
    else:
        tensors[key] = new
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


@pytest.fixture
def ckpt_copy(checkpoints, tmp_path: Path):
    import shutil

    def make(family: str, layout: str) -> Path:
        path = tmp_path / f"{family}-{layout}"
        shutil.copytree(checkpoints[(family, layout)], path)
        return path

    return make


def test_missing_expert_key_is_named(ckpt_copy) -> None:
    path = ckpt_copy("mixtral", "per_expert")
    _rewrite_shard(path, "model.layers.1.block_sparse_moe.experts.2.w3.weight", None)
    expected = r"model\.layers\.1\.mlp\.experts: .*no up weight for expert 2"
    with pytest.raises(LoadError, match=expected):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)


def test_wrong_expert_shape_names_key_and_file(ckpt_copy) -> None:
    path = ckpt_copy("qwen3_moe", "per_expert")
    key = "model.layers.0.mlp.experts.3.down_proj.weight"
    shard = _rewrite_shard(path, key, torch.zeros(5, 7))
    with pytest.raises(LoadError, match=rf"{shard.name}: tensor '{key}' has shape \[5, 7\]"):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)


def test_wrong_fused_and_dense_shapes(ckpt_copy) -> None:
    path = ckpt_copy("qwen2_moe", "fused")
    _rewrite_shard(path, "model.layers.1.mlp.experts.down_proj", torch.zeros(4, 32, 3))
    with pytest.raises(LoadError, match=r"experts\.down_proj' has shape \[4, 32, 3\]"):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    path = ckpt_copy("olmoe", "per_expert")
    _rewrite_shard(path, "model.norm.weight", torch.zeros(3))
    with pytest.raises(LoadError, match=r"'model\.norm\.weight' has shape \[3\]"):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)


@pytest.mark.parametrize(
    ("case", "key", "bad"),
    [
        ("qwen3_vl_moe", "model.language_model.layers.1.mlp.experts.down_proj", (8, 5, 32)),
        ("qwen3_vl_moe", "model.visual.blocks.0.attn.qkv.weight", (3, 3)),
        ("glm4v_moe", "model.language_model.layers.1.mlp.experts.2.up_proj.weight", (5, 7)),
        ("aria+vision", "language_model.model.layers.0.mlp.experts.fc2.weight", (4, 5, 7)),
        ("aria+vision", "vision_tower.encoder.layers.0.mlp.fc1.weight", (3, 3)),
    ],
)
def test_multimodal_missing_or_misshaped_tensor_names_file_and_key(
    ckpt_copy, case: str, key: str, bad: tuple[int, ...]
) -> None:
    # Hub layouts (Qwen3-VL-MoE's transposed experts included): one LoadError naming the key
    # and its file (a wrong shape) or the checkpoint directory (a missing tensor).
    path = ckpt_copy(case, "per_expert")
    shard = _rewrite_shard(path, key, torch.zeros(bad))
    shape = re.escape(str(list(bad)))
    with pytest.raises(
        LoadError, match=rf"^{shard.name}: tensor '{re.escape(key)}' has shape {shape}"
    ):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    _rewrite_shard(path, key, None)
    with pytest.raises(LoadError) as info:
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    assert str(path) in str(info.value)
    model_key = key.replace("language_model.model.", "model.language_model.")
    model_key = model_key.replace("vision_tower.", "model.vision_tower.")
    model_key = re.sub(r"experts\.fc2\.weight", "experts.down_proj", model_key)
    if ".experts.2." in key:  # per-expert: named by expert and role
        assert "no up weight for expert 2" in str(info.value)
    else:
        assert model_key in str(info.value)


def test_missing_dense_key_and_files(ckpt_copy, tmp_path: Path) -> None:
    path = ckpt_copy("olmoe", "per_expert")
    _rewrite_shard(path, "model.layers.1.self_attn.q_proj.weight", None)
    with pytest.raises(LoadError, match=r"no tensor for \['model\.layers\.1\.self_attn\.q_proj"):
        load_pretrained(path)
    with pytest.raises(LoadError, match=r"no config\.json"):
        load_pretrained(tmp_path)
    path = ckpt_copy("olmoe", "fused")
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(LoadError, match=r"neither model\.safetensors\.index\.json nor"):
        load_pretrained(path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoadError, match=rf"cannot read {path / 'model.safetensors'} as safet"):
        load_pretrained(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    with pytest.raises(LoadError, match=r"index\.json: 'weight_map' is a JSON list, not an obj"):
        load_pretrained(path)


def _stored(path: Path, key: str) -> torch.Tensor:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    with safe_open(str(path / index["weight_map"][key]), framework="pt") as f:
        return f.get_tensor(key)


def test_bad_converted_dense_weights_name_the_keys(ckpt_copy) -> None:
    # Lara-Mini's in_proj is split by the model's own sizes: one row short cannot split.
    path = ckpt_copy("lara_mini", "per_expert")
    key = "model.layers.0.linear_attn.in_proj.weight"
    shard = _rewrite_shard(path, key, _stored(path, key)[1:]).name
    expected = rf"\[{re.escape(shard)}: '{re.escape(key)}'\] do not convert to .*in_proj_qkv"
    with pytest.raises(LoadError, match=expected):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    # Kimi-Linear's q/k/v_conv1d are concatenated: a missing one gives a short conv1d.
    path = ckpt_copy("kimi_linear", "per_expert")
    _rewrite_shard(path, "model.layers.0.self_attn.k_conv1d.weight", None)
    expected = r"safetensors: '\S+q_conv1d.*v_conv1d\S+\] convert to '\S+self_attn\.conv1d\.weight'"
    with pytest.raises(LoadError, match=expected + r" of shape \[64, 1, 2\], .* has as \[96"):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)


def test_checkpoint_model_type_reads_config_json_or_names_it(checkpoints, tmp_path: Path) -> None:
    assert checkpoint_model_type(checkpoints[("olmoe", "fused")]) == "olmoe"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 8}))
    assert checkpoint_model_type(tmp_path) is None  # transformers identifies it later
    with pytest.raises(LoadError, match=f"{tmp_path / 'nothing'} has no config.json"):
        checkpoint_model_type(tmp_path / "nothing")
    config.write_text('{"model_type": "olmoe",')
    with pytest.raises(LoadError, match=rf"{config} is not valid JSON \(Expecting"):
        checkpoint_model_type(tmp_path)
    with pytest.raises(LoadError, match=rf"{config} is not valid JSON"):  # load_pretrained too
        load_pretrained(tmp_path)
    config.write_text('["olmoe"]')
    with pytest.raises(LoadError, match=rf"{config} holds a JSON list, not an object"):
        checkpoint_model_type(tmp_path)
    config.write_bytes(b"\xff\xfe{}")
    with pytest.raises(LoadError, match=rf"cannot read {config}: 'utf-8' codec"):
        checkpoint_model_type(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_unusable_dense_device_is_a_load_error(checkpoints) -> None:
    with pytest.raises(LoadError, match="dense_device='cuda' is not usable here"):
        load_pretrained(checkpoints[("olmoe", "fused")], dense_device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dense_on_cuda_experts_on_cpu(checkpoints) -> None:
    path = checkpoints[("qwen3_moe", "per_expert")]
    ref = load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    got = load_pretrained(path, weight_dtype="fp32", dtype=torch.float32, dense_device="cuda")
    assert got.lm_head.weight.device.type == "cuda"
    ids = token_batch()
    with torch.no_grad():
        want = ref(ids).logits
        have = got(ids.cuda()).logits
    torch.testing.assert_close(have.cpu(), want, rtol=1e-4, atol=1e-4)


def test_keys_the_model_ignores_are_skipped(ckpt_copy) -> None:
    # DeepSeek-V4 checkpoints ship multi-token-prediction layers (mtp.*) that the model class
    # declares unexpected-and-ignored; from_pretrained skips them, so must load_pretrained.
    path = ckpt_copy("deepseek_v4", "per_expert")
    extra = {
        "mtp.0.ffn.experts.0.w1.weight": torch.ones(16, 32),
        "mtp.0.norm.weight": torch.ones(32),
    }
    save_file(extra, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    index_file.write_text(json.dumps(index))
    ref = _reference(path, torch.float32, "fp32")
    got = load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
    # A key no pattern covers is still refused by name.
    save_file({"extra.weight": torch.ones(2)}, str(path / "mtp.safetensors"))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in extra}
    index["weight_map"]["extra.weight"] = "mtp.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(LoadError, match=r"does not have: \['extra\.weight'\]"):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)


# Families whose config ties lm_head to the embeddings when config.json omits the key (as real
# ERNIE-4.5, Command-A, LFM2 and Gemma 4 checkpoints do, some with a head of their own).
TIED_BY_DEFAULT = tuple(
    f for f in CAUSAL_FAMILIES if getattr(type(tiny_config(f))(), "tie_word_embeddings", False)
)


def test_tied_by_default_families_are_found() -> None:
    assert {"ernie4_5_moe", "cohere2_moe", "lfm2_moe", "gemma4"} <= set(TIED_BY_DEFAULT)


@pytest.mark.parametrize("head", ["distinct", "equal", "absent"])
@pytest.mark.parametrize("family", TIED_BY_DEFAULT)
def test_shipped_head_is_kept_as_from_pretrained_keeps_it(
    tmp_path: Path, family: str, head: str
) -> None:
    # A tied config (key omitted) with a shipped lm_head.weight: from_pretrained ties only when
    # the checkpoint has no head or one equal to the embeddings; otherwise it keeps the head.
    torch.manual_seed(1234)
    model = tiny_model(family, tie_word_embeddings=True)
    model.save_pretrained(tmp_path, save_original_format=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    file = tmp_path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert "lm_head.weight" not in tensors  # saved tied
    embed = tensors["model.embed_tokens.weight"]
    if head != "absent":
        shipped = torch.randn_like(embed) if head == "distinct" else embed.clone()
        tensors["lm_head.weight"] = shipped
        save_file(tensors, str(file), metadata={"format": "pt"})
    ref = _reference(tmp_path, torch.float32, "fp32")
    got = load_pretrained(tmp_path, weight_dtype="fp32", dtype=torch.float32)
    tied = head != "distinct"
    for which, m in (("from_pretrained", ref), ("load_pretrained", got)):
        out, inp = m.get_output_embeddings().weight, m.get_input_embeddings().weight
        assert (out is inp) == tied, which
        if not tied:
            assert torch.equal(out, shipped)
            assert not torch.equal(out, inp)
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


# Families whose model class declares its released checkpoint's multi-token-prediction layer
# (``model\\.layers\\.61.*``: the layer after the last) unexpected-and-ignored.
MTP_FAMILIES = tuple(
    f
    for f in FAMILIES
    if any(
        re.search(r"layers\\\.\d", p)
        for p in getattr(
            transformers,
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(tiny_config(f).model_type)
            or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[tiny_config(f).model_type],
        )._keys_to_ignore_on_load_unexpected
        or ()
    )
)


def test_mtp_families_are_found() -> None:
    assert {"deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm4v_moe"} <= set(MTP_FAMILIES)


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_multi_token_prediction_layer_is_ignored(ckpt_copy, family: str) -> None:
    # DeepSeek-V3 and GLM-4.5 ship their multi-token-prediction layer as the layer after the
    # last (model.layers.61 of 61): a decoder layer (per-expert experts included) plus eh_proj,
    # enorm, hnorm, embed_tokens and shared_head. The causal LM never builds it and
    # from_pretrained ignores it; so must load_pretrained, at any depth.
    path = ckpt_copy(family, "per_expert")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    config = tiny_config(family).get_text_config()
    n, h, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    # GLM-4.5V ships it in its language model: model.language_model.layers.46 of 46
    nested = any(k.startswith("model.language_model.layers.") for k in index["weight_map"])
    layers = "model.language_model.layers" if nested else "model.layers"
    last = f"{layers}.{n - 1}."
    extra = {}
    for key, shard in index["weight_map"].items():
        if key.startswith(last):
            with safe_open(str(path / shard), framework="pt") as f:
                extra[key.replace(last, f"{layers}.{n}.")] = f.get_tensor(key).clone()
    assert any(".mlp.experts.0." in k for k in extra)
    for name, shape in [
        ("eh_proj.weight", (h, 2 * h)),
        ("enorm.weight", (h,)),
        ("hnorm.weight", (h,)),
        ("shared_head.norm.weight", (h,)),
        ("shared_head.head.weight", (vocab, h)),
        ("embed_tokens.weight", (vocab, h)),
    ]:
        extra[f"{layers}.{n}.{name}"] = torch.randn(shape)
    save_file(extra, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    index_file.write_text(json.dumps(index))
    ref = _reference(path, torch.float32, "fp32")
    got = load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
    # A layer beyond the MTP one is still a checkpoint of another model: refused by name.
    save_file({f"{layers}.{n + 1}.enorm.weight": torch.ones(h)}, str(path / "x.safetensors"))
    index["weight_map"][f"{layers}.{n + 1}.enorm.weight"] = "x.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(LoadError, match=rf"does not have: \['{re.escape(layers)}\.{n + 1}\.enorm"):
        load_pretrained(path, weight_dtype="fp32", dtype=torch.float32)
