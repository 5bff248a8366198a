"""Hostile checkpoints and configs: each is one LoadError/WrapError naming the file, tensor or key.

A tiny Qwen3-MoE checkpoint (hub-style per-expert keys, sharded small) is edited the way an
attacker or a broken converter would: garbled safetensors headers, offsets into the header or
into another tensor, absurd header lengths, deeply nested JSON, integer or non-finite weights,
bad FP8 scales, and configs that disagree with the checkpoint or with themselves. The
per-family checks (which config keys give the expert count and experts per token) run over
every row of ``ARCHITECTURES`` against what the built model itself uses.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_experts import LoadError, WrapError, iter_moe_blocks, load_pretrained, wrap
from moe_experts.architectures import find_architecture
from moe_experts.testing import (
    save_fp8_checkpoint,
    save_mxfp4_checkpoint,
    tiny_config,
    tiny_model,
)
from moe_experts.validation import (
    HOST_MEMORY_LIMIT,
    ExpertConfig,
    check_expert_config,
    check_host_memory,
    expert_config,
    host_memory_available,
)

from .conftest import FAMILIES, token_batch

EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"
DENSE = "model.layers.0.self_attn.q_proj.weight"
FP8_SHAPE = {"hidden_size": 320, "moe_intermediate_size": 128}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One per-expert checkpoint, one fused, one FP8-block one (all sharded)."""
    torch.manual_seed(1234)
    model = tiny_model("qwen3_moe")
    out = {}
    for layout in ("per_expert", "fused"):
        out[layout] = tmp_path_factory.mktemp(f"hostile-{layout}")
        model.save_pretrained(
            out[layout], max_shard_size="16KB", save_original_format=layout == "per_expert"
        )
    torch.manual_seed(1234)
    fp8 = tiny_model("qwen3_moe", **FP8_SHAPE)
    out["fp8"] = save_fp8_checkpoint(
        fp8, tmp_path_factory.mktemp("hostile-fp8"), max_shard_size="64KB"
    )
    return out


@pytest.fixture
def copy(saved: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    """A fresh copy of one of the saved checkpoints, free to damage."""

    made: list[Path] = []

    def make(layout: str = "per_expert") -> Path:
        made.append(tmp_path / f"{layout}-{len(made)}")
        return Path(shutil.copytree(saved[layout], made[-1]))

    return make


def _shard(path: Path, key: str) -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][key]


def _split(file: Path) -> tuple[dict[str, Any], bytes]:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(file: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _edit(path: Path, key: str, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> Path:
    """Apply ``edit(entry, header)`` to ``key``'s header entry; return the shard."""
    file = _shard(path, key)
    header, data = _split(file)
    edit(header[key], header)
    _join(file, header, data)
    return file


def _poke(
    path: Path, key: str, value: float, dtype: torch.dtype = torch.float32, index: int = 0
) -> Path:
    """Overwrite element ``index`` (flat) of ``key`` with ``value`` (stored as ``dtype``)."""
    file = _shard(path, key)
    header, data = _split(file)
    start = header[key]["data_offsets"][0] + index * dtype.itemsize
    raw = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    data = data[:start] + raw + data[start + len(raw) :]
    _join(file, header, data)
    return file


def _edit_config(path: Path, **changes: Any) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def _load(path: Path, **kwargs: Any):
    kwargs.setdefault("weight_dtype", "fp32")
    kwargs.setdefault("dtype", torch.float32)
    return load_pretrained(path, **kwargs)


def _set(field: str, value: object) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    return lambda entry, header: entry.__setitem__(field, value)


GARBLED = {
    "offsets-string": _set("data_offsets", "x"),
    "offsets-one": _set("data_offsets", [0]),
    "offsets-float": _set("data_offsets", [0.5, 4]),
    "offsets-reversed": lambda e, h: e.__setitem__("data_offsets", e["data_offsets"][::-1]),
    "offsets-past-end": lambda e, h: e.__setitem__(
        "data_offsets", [e["data_offsets"][0] + 2**40, e["data_offsets"][1] + 2**40]
    ),
    "no-offsets": lambda e, h: e.pop("data_offsets"),
    "no-dtype": lambda e, h: e.pop("dtype"),
    "dtype-number": _set("dtype", 7),
    "dtype-unknown": _set("dtype", "F128"),
    "shape-string": _set("shape", "4x4"),
    "shape-negative": _set("shape", [-1, 16]),
    "shape-bool": _set("shape", [True, 16]),
    "entry-list": lambda e, h: e.clear(),
}


@pytest.mark.parametrize("key", [EXPERT, DENSE], ids=["expert", "dense"])
@pytest.mark.parametrize("garble", GARBLED, ids=list(GARBLED))
def test_garbled_header_entry_names_file_and_tensor(copy, key: str, garble: str) -> None:
    path = copy()
    file = _edit(path, key, GARBLED[garble])
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))}: tensor '{re.escape(key)}'"):
        _load(path)


def test_non_object_header_entry_and_metadata(copy) -> None:
    path = copy()
    file = _shard(path, DENSE)
    header, data = _split(file)
    header[DENSE] = [1, 2]
    _join(file, header, data)
    with pytest.raises(LoadError, match=rf"tensor '{re.escape(DENSE)}'.*not a JSON object"):
        _load(path)
    path = copy("fused")
    file = _shard(path, DENSE)
    header, data = _split(file)
    header["__metadata__"] = {"format": ["pt"]}  # metadata must map strings to strings
    _join(file, header, data)
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))}: __metadata__"):
        _load(path)


@pytest.mark.parametrize("key", [EXPERT, DENSE], ids=["expert", "dense"])
def test_offsets_into_the_header_or_another_tensor(copy, key: str) -> None:
    def backwards(entry: dict[str, Any], header: dict[str, Any]) -> None:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = [start - 16 - start, end - 16 - start]  # 16 bytes before data

    path = copy()
    file = _edit(path, key, backwards)
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))}: tensor '{re.escape(key)}'"):
        _load(path)

    def overlap(entry: dict[str, Any], header: dict[str, Any]) -> None:
        other = min(
            (v for k, v in header.items() if k not in (key, "__metadata__")),
            key=lambda v: v["data_offsets"][0],
        )
        start, end = entry["data_offsets"]
        first = other["data_offsets"][0]
        entry["data_offsets"] = [first, first + end - start]

    path = copy()
    file = _edit(path, key, overlap)
    with pytest.raises(
        LoadError, match=rf"{re.escape(str(file))}: tensor '.*' overlaps tensor '.*'"
    ) as info:
        _load(path)
    assert key in str(info.value)


def test_huge_header_length_and_truncated_header(copy) -> None:
    path = copy()
    file = _shard(path, DENSE)
    raw = file.read_bytes()
    file.write_bytes((2**40).to_bytes(8, "little") + raw[8:])
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))} .*header of 1099511627776 byt"):
        _load(path)
    file.write_bytes(raw[:5])
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))} .*shorter than the 8-byte"):
        _load(path)


def test_deeply_nested_json(copy) -> None:
    nested = "[" * 100_000 + "]" * 100_000
    path = copy()
    file = _shard(path, DENSE)
    file.write_bytes(len(nested).to_bytes(8, "little") + nested.encode())
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))}: .*nested"):
        _load(path)
    path = copy("fused")
    index = path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + nested + "}")
    with pytest.raises(LoadError, match=rf"{re.escape(str(index))}.*nested"):
        _load(path)
    path = copy("fused")
    (path / "config.json").write_text(nested)
    with pytest.raises(LoadError, match=r"config\.json is not valid JSON \(maximum recursion"):
        _load(path)


def test_single_file_checkpoint_is_read_by_the_same_validating_reader(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    assert file.is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    header, data = _split(file)
    header[DENSE]["data_offsets"] = [-8, header[DENSE]["data_offsets"][1]]
    _join(file, header, data)
    with pytest.raises(LoadError, match=rf"{re.escape(str(file))}: tensor '{re.escape(DENSE)}'"):
        _load(tmp_path)


@pytest.mark.parametrize("key", [EXPERT, DENSE], ids=["expert", "dense"])
def test_integer_dtype_where_a_float_weight_belongs(copy, key: str) -> None:
    path = copy()
    file = _edit(path, key, _set("dtype", "I32"))
    with pytest.raises(
        LoadError, match=rf"{re.escape(file.name)}: tensor '{re.escape(key)}' is torch\.int32"
    ):
        _load(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("key", [EXPERT, DENSE], ids=["expert", "dense"])
def test_non_finite_weights_name_file_and_tensor(copy, key: str, value: float) -> None:
    path = copy()
    file = _poke(path, key, value)
    with pytest.raises(
        LoadError, match=rf"{re.escape(str(file))}: tensor '{re.escape(key)}' holds NaN or inf"
    ):
        _load(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
@pytest.mark.parametrize("weight_dtype", [None, "bf16"], ids=["shipped", "dequantised"])
def test_bad_fp8_scales(copy, value: float, weight_dtype: str | None) -> None:
    path = copy("fp8")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    expert = next(
        k for k in index["weight_map"] if k.endswith("experts.1.up_proj.weight_scale_inv")
    )
    dense = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    for key in (expert, dense):
        work = copy("fp8") if key == dense else path
        file = _poke(work, key, value)
        with pytest.raises(LoadError, match=rf"{re.escape(file.name)}: .*'{re.escape(key)}'"):
            load_pretrained(work, weight_dtype=weight_dtype)
        shutil.rmtree(work)


def test_the_finite_check_passes_real_weights(saved: dict[str, Path]) -> None:
    # Large but finite values, subnormals and signed zeros are weights, not corruption.
    model = _load(saved["per_expert"])
    with torch.no_grad():
        assert torch.isfinite(model(token_batch()).logits).all()


# ---- config and shape mismatches ----


def test_checkpoint_experts_beyond_the_config(copy) -> None:
    path = copy()
    _edit_config(path, num_local_experts=6)  # the checkpoint holds 8
    with pytest.raises(
        LoadError,
        match=r"experts\.6\..*expert 6.*num_local_experts = 6 experts in config\.json",
    ):
        _load(path)
    path = copy("fused")
    _edit_config(path, num_local_experts=6)
    with pytest.raises(LoadError, match=r"holds 8 experts.*num_local_experts = 6"):
        _load(path)


def test_shipped_mxfp4_experts_beyond_the_config(tmp_path: Path) -> None:
    # GPT-OSS as released: MXFP4 experts shipped as ``*_blocks``/``*_scales`` parts.
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("gpt_oss", hidden_size=64, intermediate_size=96)
    model = AutoModelForCausalLM.from_config(config)
    path = save_mxfp4_checkpoint(model, tmp_path / "gpt_oss")
    held = config.num_local_experts
    _edit_config(path, num_local_experts=held - 1)
    with pytest.raises(
        LoadError,
        match=rf"experts\.\w+' holds {held} experts.*num_local_experts = {held - 1}",
    ):
        load_pretrained(path, weight_dtype="auto")


def test_huge_expert_count_is_refused_before_allocating(copy) -> None:
    path = copy()
    _edit_config(path, num_local_experts=10**9)
    with pytest.raises(LoadError, match=r"num_local_experts = 1000000000.*needs [\d.]+ [KMGTP]B"):
        _load(path)


def test_memory_check_names_both_figures_and_takes_an_injected_figure(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = saved["per_expert"]
    check_host_memory(900, "x", available=1000)  # exactly 90%: allowed
    with pytest.raises(
        LoadError, match=r"x needs 901 B of host memory.*90% of the 1\.0 KB available"
    ):
        check_host_memory(901, "x", available=1000)
    real = host_memory_available()
    assert real is None or real > 0
    assert HOST_MEMORY_LIMIT == 0.9
    import moe_experts.validation as validation

    monkeypatch.setattr(validation, "host_memory_available", lambda: 10_000)
    with pytest.raises(LoadError, match=r"needs [\d.]+ KB of host memory.*10\.0 KB"):
        _load(path)
    monkeypatch.setattr(validation, "host_memory_available", lambda: 2**40)
    _load(path)


def test_memory_figure_is_the_model_and_counts_the_machine_under_torchrun(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import moe_experts.validation as validation
    from moe_experts import KernelExperts, is_placeholder

    path = saved["per_expert"]
    seen: list[int] = []
    monkeypatch.setattr(validation, "check_host_memory", lambda needed, what: seen.append(needed))
    model = _load(path)
    # The oracle: what the loaded model holds (kernel storage + dense parameters and buffers).
    kernels = [m for m in model.modules() if isinstance(m, KernelExperts)]
    experts = sum(k.expert_weights.nbytes for k in kernels)
    dense = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if not is_placeholder(t))
    assert experts == 2 * 8 * 3 * 16 * 32 * 4  # layers x E x (gate, up, down) x I x H x fp32
    assert seen == [experts + dense]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    _load(path)  # local rank 0 checks for the machine: 4 ranks' dense weights, experts once
    assert seen[-1] == experts + 4 * dense
    _load(path, share_experts=False)  # a copy of the experts per rank
    assert seen[-1] == 4 * (experts + dense)
    monkeypatch.setenv("LOCAL_RANK", "2")
    _load(path)  # the other local ranks leave it to local rank 0
    assert len(seen) == 3


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"model_type": "nope_moe"}, r"model_type 'nope_moe'"),
        ({"model_type": 7}, r"has no model_type"),
        ({"hidden_size": "32"}, r"hidden_size"),
        ({"hidden_size": 0}, r"hidden_size"),
        ({"num_hidden_layers": -1}, r"num_hidden_layers"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9.*num_local_experts = 8"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok"),
        ({"num_local_experts": "8"}, r"num_local_experts"),
    ],
)
def test_bad_config_values_name_the_key(copy, change: dict[str, Any], expected: str) -> None:
    path = copy()
    _edit_config(path, **change)
    with pytest.raises(LoadError, match=rf"config\.json.*{expected}"):
        _load(path)


# ---- per family: the config keys really are the model's expert count and top-k ----


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_config_keys_are_the_ones_the_model_reads(family: str) -> None:
    # Built with other values under the keys expert_config names, the model must follow them:
    # its experts' E, and the k of the top_k_index its blocks hand the experts.
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(family)
    named = expert_config(config)
    e, k = named.num_experts + 2, 1
    # Set on the built config (tiny_config's overrides would race the config's own aliases).
    setattr(config.get_text_config(), named.num_experts_key, e)
    setattr(config.get_text_config(), named.top_k_key, k)
    assert expert_config(config) == ExpertConfig(named.num_experts_key, e, named.top_k_key, k)
    # As tiny_model picks the class (Mistral 4's causal LM is mapped as image-text-to-text only).
    causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    model = auto.from_config(config).eval()
    arch = find_architecture(model)
    seen: list[int] = []

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[1].shape[-1])  # experts(hidden, top_k_index [T, k], top_k_weights)

    handles = []
    for site in iter_moe_blocks(model, arch):
        experts = getattr(site.block, arch.experts_attr)
        assert getattr(experts, arch.gate_up_param).shape[0] == e, site.experts_name
        handles.append(experts.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(token_batch())
    for h in handles:
        h.remove()
    assert seen, family
    # PhiMoE's sparsemixer routes top-2 whatever the config says (transformers' own quirk).
    assert set(seen) == {2 if family == "phimoe" else k}, (family, seen)


@pytest.mark.parametrize("family", FAMILIES)
def test_top_k_above_expert_count_is_refused_by_wrap(fresh, family: str) -> None:
    model = fresh(family)
    counts = expert_config(model.config)
    setattr(model.config.get_text_config(), counts.top_k_key, counts.num_experts + 1)
    with pytest.raises(WrapError, match=rf"{counts.top_k_key} = {counts.num_experts + 1}"):
        wrap(model, weight_dtype="fp32")


def test_config_check_rejects_missing_keys() -> None:
    from transformers import LlamaConfig

    with pytest.raises(WrapError, match=r"cfg: num_experts = None; it must be a positive int"):
        check_expert_config(LlamaConfig(), "cfg", WrapError)
