"""Every kind of damage gives its own error, naming the file and the key."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest

import lora_checkpoint as lc


@pytest.fixture
def ckpt(tmp_path, result):
    m = lc.save(tmp_path / "root", result, step=1)
    return tmp_path / "root" / m.name


def _manifest(ckpt):
    return json.loads((ckpt / "manifest.json").read_text())


def _write_manifest(ckpt, raw):
    (ckpt / "manifest.json").write_text(json.dumps(raw))


def _flip(path, offset_from_end=5):
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_names_file_and_key(ckpt):
    _flip(ckpt / "fused_expert_lora.safetensors", offset_from_end=3)
    with pytest.raises(lc.DigestMismatchError) as info:
        lc.load(ckpt)
    msg = str(info.value)
    assert "fused_expert_lora.safetensors" in msg
    # the last bytes belong to the narrowest tensor, sorted last: the bf16 one
    assert "moe.lora_experts.0.weight" in msg
    # without verification a flipped data byte is not detected, but sizes/headers still are
    lc.load(ckpt, verify=False)


def test_flipped_byte_in_json_file(ckpt):
    _flip(ckpt / "adapter_config.json", offset_from_end=4)
    with pytest.raises(lc.DigestMismatchError, match=r"adapter_config.json"):
        lc.load(ckpt)


def test_truncated_file(ckpt):
    path = ckpt / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(lc.TruncatedFileError, match=r"adapter_model.safetensors.*cut off"):
        lc.load(ckpt, verify=False)


def test_truncated_file_with_matching_manifest_size(ckpt):
    # Even if the manifest is edited to the short size, the header shows the data is gone.
    path = ckpt / "adapter_model.safetensors"
    data = path.read_bytes()[:-10]
    path.write_bytes(data)
    raw = _manifest(ckpt)
    for f in raw["files"]:
        if f["file"] == "adapter_model.safetensors":
            f["size"] = len(data)
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.TruncatedFileError, match=r"adapter_model.safetensors"):
        lc.load(ckpt, verify=False)


def test_missing_file(ckpt):
    os.remove(ckpt / "rank_local-rank00000.safetensors")
    with pytest.raises(lc.MissingFileError, match=r"rank_local-rank00000.safetensors"):
        lc.load(ckpt)


def test_missing_manifest_and_latest(tmp_path, ckpt):
    os.remove(ckpt / "manifest.json")
    with pytest.raises(lc.MissingFileError, match=r"neither manifest.json"):
        lc.load(ckpt)
    with pytest.raises(lc.MissingFileError, match=r"points at"):
        lc.load(ckpt.parent)
    with pytest.raises(lc.MissingFileError, match=r"does not exist"):
        lc.load(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("shape", [4, 9], lc.ShapeMismatchError),
        ("dtype", "float16", lc.DtypeMismatchError),
    ],
)
def test_manifest_altered_shape_or_dtype(ckpt, field, value, error):
    raw = _manifest(ckpt)
    entry = next(t for t in raw["tensors"] if t["name"] == "layer.q_proj.lora_A.weight")
    entry[field] = value
    _write_manifest(ckpt, raw)
    with pytest.raises(error) as info:
        lc.load(ckpt)
    msg = str(info.value)
    assert "adapter_model.safetensors" in msg
    assert "base_model.model.layer.q_proj.lora_A.weight" in msg
    assert str(value).replace("'", "") in msg.replace("'", "")


def test_manifest_parameter_dtype_altered(ckpt):
    raw = _manifest(ckpt)
    raw["parameters"][0]["dtype"] = "int8"
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.DtypeMismatchError, match=r"layer.q_proj.lora_A.weight.*int8"):
        lc.load(ckpt)


def test_manifest_parameter_shape_altered(ckpt):
    raw = _manifest(ckpt)
    entry = next(p for p in raw["parameters"] if p["name"] == "moe.experts.gate_up_proj.lora_A")
    entry["shape"] = [3, 4, 9]
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.ShapeMismatchError, match=r"gate_up_proj.lora_A.*\[3, 4, 9\]"):
        lc.load(ckpt)


def test_manifest_drops_a_tensor_entry(ckpt):
    raw = _manifest(ckpt)
    raw["tensors"] = [t for t in raw["tensors"] if t["name"] != "layer.q_proj.lora_B.weight"]
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.UnexpectedTensorError, match=r"q_proj.lora_B.weight"):
        lc.load(ckpt)


def test_manifest_drops_a_parameter_entry(ckpt):
    raw = _manifest(ckpt)
    raw["parameters"] = [p for p in raw["parameters"] if p["name"] != "router.rank_bias"]
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.UnexpectedTensorError, match=r"router.rank_bias"):
        lc.load(ckpt)


def test_manifest_lists_tensor_absent_from_file(ckpt):
    raw = _manifest(ckpt)
    extra = dict(raw["tensors"][0], key="ghost", name="ghost")
    raw["tensors"].append(extra)
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.MissingTensorError, match=r"ghost"):
        lc.load(ckpt)


def test_unknown_format_version(ckpt):
    raw = _manifest(ckpt)
    raw["format_version"] = 99
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.UnknownFormatVersionError, match=r"format_version 99 is not supported"):
        lc.load(ckpt)


@pytest.mark.parametrize("version", [1, lc.FORMAT_VERSION])
def test_malformed_manifest(ckpt, version):
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(lc.ManifestError, match=r"not valid JSON"):
        lc.load(ckpt)
    # an old format goes through its migration first, and is reported just the same
    raw = {"format_version": version, "name": "x"}
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.ManifestError, match=r"not a valid manifest"):
        lc.load(ckpt)


def test_manifest_path_traversal_refused(ckpt):
    raw = _manifest(ckpt)
    raw["files"][0]["file"] = "../outside.safetensors"
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.ManifestError, match=r"plain file name"):
        lc.load(ckpt)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creates the marker file if ever unpickled


@pytest.mark.parametrize("name", ["adapter_model.bin", "optimizer.pt", "state_no_suffix"])
def test_pickle_payload_refused_and_never_executed(tmp_path, ckpt, name):
    marker = tmp_path / "PWNED"
    (ckpt / name).write_bytes(pickle.dumps(_Payload(str(marker)), protocol=4))
    with pytest.raises(lc.UnsafeFileError, match=name):
        lc.load(ckpt)
    with pytest.raises(lc.UnsafeFileError):
        lc.verify(ckpt)
    assert not marker.exists()


def test_manifest_listing_pickle_file_refused(tmp_path, ckpt):
    marker = tmp_path / "PWNED"
    src = ckpt / "rank_local-rank00000.safetensors"
    payload = pickle.dumps(_Payload(str(marker)), protocol=4)
    os.remove(src)
    (ckpt / "rank_local-rank00000.pt").write_bytes(payload)
    raw = _manifest(ckpt)
    for group in (raw["files"], raw["tensors"]):
        for e in group:
            if e["file"] == "rank_local-rank00000.safetensors":
                e["file"] = "rank_local-rank00000.pt"
    raw["shards"][0]["files"] = ["rank_local-rank00000.pt"]
    _write_manifest(ckpt, raw)
    with pytest.raises(lc.UnsafeFileError, match=r"rank_local-rank00000\.pt"):
        lc.load(ckpt)
    assert not marker.exists()


def test_symlinked_file_refused(tmp_path, ckpt):
    target = tmp_path / "elsewhere.safetensors"
    os.replace(ckpt / "fused_expert_lora.safetensors", target)
    os.symlink(target, ckpt / "fused_expert_lora.safetensors")
    with pytest.raises(lc.UnsafeFileError, match=r"fused_expert_lora.safetensors is a symbolic"):
        lc.load(ckpt)


def test_corrupt_safetensors_header(ckpt):
    path = ckpt / "fused_expert_lora.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))
    with pytest.raises(lc.CheckpointError, match=r"fused_expert_lora.safetensors"):
        lc.load(ckpt, verify=False)
    with pytest.raises(lc.DigestMismatchError, match=r"header"):
        lc.load(ckpt)


def test_latest_pointing_outside_refused(tmp_path, ckpt):
    (ckpt.parent / "latest").write_text("../elsewhere\n")
    with pytest.raises(lc.UnsafeFileError, match=r"elsewhere"):
        lc.load(ckpt.parent)
    shutil.rmtree(ckpt)
