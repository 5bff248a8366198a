"""The load-time NaN/inf check: every float tensor, every element, whatever the chunking.

``Shards`` reads a tensor in ``CHUNK_BYTES`` pieces and checks each right after reading it
(kt-kernel's ``all_finite``). NaN, +inf and -inf are planted at the first element, a middle one,
the first of a later chunk and the last (in a final partial chunk) of tensors in every float
dtype a checkpoint holds, and must be one ``LoadError`` naming the file and tensor; clean tensors
must read back bitwise as safetensors' own loader reads them. ``load_pretrained`` is checked the
same way on bf16 and fp16 checkpoints and on FP8 scales.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_experts import LoadError, load_pretrained
from moe_experts import _safetensors as st
from moe_experts.testing import save_fp8_checkpoint, tiny_model

from .test_hostile_checkpoints import FP8_SHAPE, _poke

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SHAPE = (7, 37)  # 259 elements: a multiple of no chunk below
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _positions(numel: int, per_chunk: int) -> dict[str, int]:
    return {"first": 0, "middle": numel // 2, "chunk-start": per_chunk, "last": numel - 1}


def _file(tmp_path: Path, t: torch.Tensor) -> Path:
    # A neighbour on each side: a read that strays past its tensor would show.
    file = tmp_path / "model.safetensors"
    side = torch.full((3,), 7, dtype=t.dtype)
    save_file({"a.before": side, "w": t.contiguous(), "z.after": side.clone()}, file)
    return file


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "chunk", [64, 100, 200, st.CHUNK_BYTES], ids=["64B", "100B", "200B", "default"]
)
def test_every_value_at_every_position_in_every_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, chunk: int
) -> None:
    monkeypatch.setattr(st, "CHUNK_BYTES", chunk)
    torch.manual_seed(0)
    per_chunk = chunk // dtype.itemsize
    # With the default chunk, a tensor of 2.x chunks (again not a multiple); else SHAPE.
    shape = SHAPE if chunk < 1000 else (2 * per_chunk // 1000 + 1, 1000 + 3)
    base = torch.randn(shape, dtype=torch.float64).to(dtype)
    base.view(-1)[1] = torch.finfo(dtype).max  # large finite values are weights
    numel = base.numel()
    assert numel % per_chunk
    assert numel > per_chunk
    clean = _file(tmp_path, base)
    assert torch.equal(st.Shards().read(clean, "w"), load_file(clean)["w"])
    for index in _positions(numel, per_chunk).values():
        for value in VALUES.values():
            bad = base.clone()
            bad.view(-1)[index] = value
            file = _file(tmp_path, bad)
            with pytest.raises(
                LoadError, match=rf"{re.escape(str(file))}: tensor 'w' holds NaN or inf"
            ):
                st.Shards().read(file, "w")
            out = torch.zeros_like(bad)
            with pytest.raises(LoadError, match="holds NaN or inf"):
                st.Shards().read_into(file, "w", out)


def test_fp8_bytes_and_integers_are_not_scanned_but_read_exactly(tmp_path: Path) -> None:
    # E4M3 bytes are checked where their scales are adopted; integers have no NaN.
    for t in (
        torch.arange(300, dtype=torch.int32),
        torch.randn(300).to(torch.float8_e4m3fn),
    ):
        file = _file(tmp_path, t)
        assert torch.equal(st.Shards().read(file, "w").view(torch.uint8), t.view(torch.uint8))


@pytest.fixture(scope="module")
def half_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[torch.dtype, Path]:
    """The tiny per-expert Qwen3-MoE checkpoint saved in bf16 and in fp16."""
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(1234)
        model = tiny_model("qwen3_moe").to(dtype)
        out[dtype] = tmp_path_factory.mktemp(f"finite-{dtype}")
        model.save_pretrained(out[dtype], max_shard_size="16KB", save_original_format=True)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(VALUES))
def test_load_pretrained_names_the_tensor_in_half_precision_checkpoints(
    half_checkpoints: dict[torch.dtype, Path], tmp_path: Path, dtype: torch.dtype, name: str
) -> None:
    numel = 1
    for where in ("first", "middle", "last"):
        path = _copy(half_checkpoints[dtype], tmp_path / f"{where}")
        index = json.loads((path / "model.safetensors.index.json").read_text())
        if where == "first":
            numel = load_file(path / index["weight_map"][EXPERT])[EXPERT].numel()
        at = {"first": 0, "middle": numel // 2, "last": numel - 1}[where]
        file = _poke(path, EXPERT, VALUES[name], dtype, index=at)
        with pytest.raises(
            LoadError, match=rf"{re.escape(str(file))}: tensor '{re.escape(EXPERT)}' holds NaN"
        ):
            load_pretrained(path, dtype=dtype)


def test_clean_half_precision_checkpoints_load(half_checkpoints: dict[torch.dtype, Path]) -> None:
    for dtype, path in half_checkpoints.items():
        model = load_pretrained(path, dtype=dtype)
        assert model.dtype == dtype


@pytest.mark.parametrize("name", list(VALUES))
def test_fp8_scales_checked_at_every_position(tmp_path: Path, name: str) -> None:
    torch.manual_seed(1234)
    src = save_fp8_checkpoint(
        tiny_model("qwen3_moe", **FP8_SHAPE), tmp_path / "src", max_shard_size="64KB"
    )
    index = json.loads((src / "model.safetensors.index.json").read_text())
    key = next(k for k in index["weight_map"] if k.endswith("experts.1.down_proj.weight_scale_inv"))
    numel = load_file(src / index["weight_map"][key])[key].numel()
    assert numel > 1
    for at in sorted({0, numel // 2, numel - 1}):
        path = _copy(src, tmp_path / f"at{at}")
        file = _poke(path, key, VALUES[name], index=at)
        with pytest.raises(LoadError, match=rf"{re.escape(file.name)}: .*'{re.escape(key)}'"):
            load_pretrained(path)
