"""The streaming safetensors reader: what it returns, what it hashes, what it refuses."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from blake3 import blake3
from safetensors.torch import load_file

import lora_checkpoint as lc
from lora_checkpoint._digest import DigestAlgorithm
from lora_checkpoint._safetensors_io import read_safetensors, write_safetensors

B3 = DigestAlgorithm.BLAKE3


def _handmade(path, entries, data: bytes) -> bytes:
    """Write a safetensors file with the given header entries and data section."""
    header = json.dumps(entries).encode()
    blob = struct.pack("<Q", len(header)) + header + data
    path.write_bytes(blob)
    return blob


def test_tensors_own_their_memory_and_match_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(300, 7),
        "b": torch.arange(10, dtype=torch.int16),
        "c": torch.randn(5).bfloat16(),
        "empty": torch.zeros(0, 3),
    }
    rec = write_safetensors(tmp_path / "x.safetensors", tensors)
    read = read_safetensors(tmp_path / "x.safetensors", expected_size=rec.size, algorithm=B3)
    assert read.header_error is None
    assert (
        read.finish() == rec.digest == blake3((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    )
    theirs = load_file(tmp_path / "x.safetensors")
    for key, t in tensors.items():
        got = read.tensors[key]
        assert torch.equal(got, t)
        assert torch.equal(got, theirs[key])
        # its own storage: keeping one tensor does not keep the file's bytes alive
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()


def test_gaps_and_trailing_bytes_are_hashed(tmp_path):
    a = torch.arange(4, dtype=torch.float32)
    b = torch.arange(4, 8, dtype=torch.float32)
    data = a.numpy().tobytes() + b"GAPGAPGA" + b.numpy().tobytes() + b"TRAILING"
    entries = {
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    }
    blob = _handmade(tmp_path / "g.safetensors", entries, data)
    read = read_safetensors(tmp_path / "g.safetensors", expected_size=len(blob), algorithm=B3)
    assert read.finish() == blake3(blob).hexdigest()
    assert torch.equal(read.tensors["a"], a)
    assert torch.equal(read.tensors["b"], b)


def test_overlapping_tensors_refused(tmp_path):
    data = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    entries = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    blob = _handmade(tmp_path / "o.safetensors", entries, data)
    with pytest.raises(lc.CheckpointError, match=r"o\.safetensors: key 'b'.*overlaps"):
        read_safetensors(tmp_path / "o.safetensors")
    # hashed: the whole file is still hashed, and the problem handed back, not raised
    read = read_safetensors(tmp_path / "o.safetensors", algorithm=B3)
    assert read.finish() == blake3(blob).hexdigest()
    assert read.tensors == {}
    assert isinstance(read.header_error, lc.CheckpointError)


def test_file_shorter_than_its_header_says(tmp_path):
    entries = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    blob = _handmade(tmp_path / "t.safetensors", entries, b"\0" * 8)
    with pytest.raises(lc.TruncatedFileError, match=r"t\.safetensors: tensors need 16"):
        read_safetensors(tmp_path / "t.safetensors")
    read = read_safetensors(tmp_path / "t.safetensors", algorithm=B3)
    assert read.finish() == blake3(blob).hexdigest()
    assert isinstance(read.header_error, lc.TruncatedFileError)
