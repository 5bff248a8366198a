"""Digests: format 2 is a plain BLAKE3 of the bytes (what ``b3sum`` prints); format 1
checkpoints are still verified with SHA-256; the manifest names the algorithm explicitly."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from blake3 import blake3
from torch import nn

import lora_checkpoint as lc
from lora_checkpoint import _digest
from lora_checkpoint._digest import PARALLEL_HASH_BYTES
from lora_checkpoint._safetensors_io import CHUNK_BYTES
from lora_core.contracts import AdaptationResult, ComponentVersion

GOLDEN = Path(__file__).parent / "golden"


def _raw_bytes(t: torch.Tensor) -> bytes:
    # Independent of our byte views: through numpy, as raw C-order bytes.
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _big_result() -> AdaptationResult:
    """Tensors spanning several hash chunks and blake3's multithreaded path, and tiny ones."""
    big = CHUNK_BYTES // 4 + 12_345  # fp32 elements: one full chunk and a partial one
    assert big * 4 > max(CHUNK_BYTES, PARALLEL_HASH_BYTES)
    params = [
        ("big.lora_A", nn.Parameter(torch.randn(big))),
        ("mid.lora_B", nn.Parameter(torch.randn(PARALLEL_HASH_BYTES // 2 + 7).bfloat16())),
        ("small.bias", nn.Parameter(torch.randn(3, 5))),
        ("empty.lora_A", nn.Parameter(torch.zeros(0, 4))),
    ]
    return AdaptationResult.create(
        adapted_layers=[n for n, _ in params],
        named_optimizer_parameters=params,
        ownership={n: "replicated" for n, _ in params},
        producer=ComponentVersion("lora-core", "0.1.0"),
    )


def _data_offset(path: Path, key: str) -> tuple[int, int]:
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + hlen])[key]["data_offsets"]
    return 8 + hlen + begin, 8 + hlen + end


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["mixed", "big", "big-pool"])
def test_v2_digests_are_plain_blake3(tmp_path, result, which, monkeypatch):
    if which == "big-pool":
        # blake3's thread pool on save and load too (used there only with spare cores)
        monkeypatch.setattr(_digest, "IO_BUSY_CORES", 0)
        assert _digest.pool_pays(PARALLEL_HASH_BYTES, beside_io=True)
    res = result if which == "mixed" else _big_result()
    opt = torch.optim.SGD(res.parameters(), lr=0.1, momentum=0.9)
    for p in res.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = lc.TrainingState.capture(opt, res, step=1, data_position={"i": 0})
    m = lc.save(tmp_path, res, training_state=state)
    ckpt = tmp_path / m.name
    assert m.format_version == 2
    assert m.digest_algorithm is lc.DigestAlgorithm.BLAKE3
    assert json.loads((ckpt / "manifest.json").read_text())["digest_algorithm"] == "blake3"
    # every file, JSON ones included: blake3 of the file's bytes, what `b3sum FILE` prints
    # (the reference hasher is plain BLAKE3-256: the specification's hash of empty input)
    assert blake3(b"").hexdigest() == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    for f in m.files:
        data = (ckpt / f.file).read_bytes()
        assert f.size == len(data), f.file
        assert f.digest == blake3(data).hexdigest(), f.file
    # every tensor: blake3 of its raw C-order bytes, for the saved and the loaded values
    saved = dict(res.named_optimizer_parameters)
    loaded = lc.load(tmp_path)
    for t in m.tensors:
        if t.kind is lc.TensorKind.PARAMETER:
            assert t.digest == blake3(_raw_bytes(saved[t.name])).hexdigest(), t.name
            assert t.digest == blake3(_raw_bytes(loaded.tensors[t.name])).hexdigest(), t.name


def test_v2_flipped_byte_names_only_the_corrupted_key(tmp_path):
    m = lc.save(tmp_path, _big_result(), step=1)
    path = tmp_path / m.name / lc.FUSED_EXPERT_LORA
    begin, end = _data_offset(path, "big.lora_A")
    _flip(path, begin + (end - begin) * 3 // 4)  # in the second hash chunk
    with pytest.raises(lc.DigestMismatchError) as info:
        lc.load(tmp_path)
    msg = str(info.value)
    assert lc.FUSED_EXPERT_LORA in msg
    assert "blake3" in msg
    assert "['big.lora_A']" in msg
    with pytest.raises(lc.DigestMismatchError, match=r"big\.lora_A"):
        lc.verify(tmp_path)


def _v1_copy(tmp_path: Path) -> Path:
    shutil.copytree(GOLDEN / "root_v1", tmp_path / "root")
    return tmp_path / "root" / "step-00000001"


def test_v1_checkpoint_loads_verifies_and_catches_a_flipped_byte_with_sha256(tmp_path):
    ckpt = _v1_copy(tmp_path)
    m = lc.verify(ckpt)
    assert m.digest_algorithm is lc.DigestAlgorithm.SHA256
    for f in m.files:
        assert f.digest == hashlib.sha256((ckpt / f.file).read_bytes()).hexdigest(), f.file

    path = ckpt / lc.FUSED_EXPERT_LORA
    begin, _ = _data_offset(path, "experts.lora_A")
    _flip(path, begin + 5)
    with pytest.raises(lc.DigestMismatchError) as info:
        lc.load(ckpt)
    msg = str(info.value)
    assert lc.FUSED_EXPERT_LORA in msg
    assert "sha256" in msg
    assert "['experts.lora_A']" in msg
    lc.load(ckpt, verify=False)  # sizes and headers still fine

    _flip(path, begin + 5)  # restored
    lc.verify(ckpt)
    _flip(ckpt / lc.ADAPTER_CONFIG, 10)
    with pytest.raises(lc.DigestMismatchError, match=r"adapter_config\.json: sha256 digest"):
        lc.verify(ckpt)


def test_the_named_algorithm_is_the_one_checked(tmp_path, result):
    # A reader never guesses: the same (BLAKE3) digests checked as SHA-256 all fail.
    m = lc.save(tmp_path, result, step=1)
    path = tmp_path / m.name / "manifest.json"
    raw = json.loads(path.read_text())
    raw["digest_algorithm"] = "sha256"
    path.write_text(json.dumps(raw))
    with pytest.raises(lc.DigestMismatchError, match=r"sha256 digest [0-9a-f]{64} differs"):
        lc.load(tmp_path)


@pytest.mark.parametrize("value", ["md5", "BLAKE3", 3, None])
def test_unknown_digest_algorithm_refused(tmp_path, result, value):
    m = lc.save(tmp_path, result, step=1)
    path = tmp_path / m.name / "manifest.json"
    raw = json.loads(path.read_text())
    raw["digest_algorithm"] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(lc.ManifestError) as info:
        lc.load(tmp_path)
    msg = str(info.value)
    assert "digest_algorithm" in msg
    assert repr(value) in msg
    assert "['blake3', 'sha256']" in msg


def test_missing_digest_algorithm_refused(tmp_path, result):
    m = lc.save(tmp_path, result, step=1)
    path = tmp_path / m.name / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["digest_algorithm"]
    path.write_text(json.dumps(raw))
    with pytest.raises(lc.ManifestError, match=r"(?s)not a valid manifest.*digest_algorithm"):
        lc.load(tmp_path)


def test_v1_manifest_naming_an_algorithm_refused(tmp_path):
    # Format 1 had no digest_algorithm; one that claims one was not written by lora-checkpoint.
    ckpt = _v1_copy(tmp_path)
    raw = json.loads((ckpt / "manifest.json").read_text())
    raw["digest_algorithm"] = "blake3"
    (ckpt / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(lc.ManifestError, match=r"migration 1 -> 2 failed.*digest_algorithm"):
        lc.load(ckpt)
