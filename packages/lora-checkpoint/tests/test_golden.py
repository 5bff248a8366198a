"""Format version 1 is frozen: schema, manifest bytes and a committed checkpoint.

If one of these fails you changed the on-disk format: bump ``FORMAT_VERSION``, register a
migration from the old version, and regenerate with ``tests/golden/make_golden.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

import lora_checkpoint as lc

GOLDEN = Path(__file__).parent / "golden"


def _maker():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_manifest_schema_is_frozen():
    expected = (GOLDEN / "manifest_schema_v1.json").read_text()
    assert json.dumps(_maker().schema_summary(), indent=2, sort_keys=True) + "\n" == expected
    assert lc.FORMAT_VERSION == 1


def test_manifest_of_a_deterministic_save_is_byte_identical(tmp_path):
    mk = _maker()
    m = lc.save(tmp_path, mk.golden_result(), step=1)
    got = json.dumps(mk.normalised_manifest(m), indent=2, sort_keys=True) + "\n"
    assert got == (GOLDEN / "manifest_v1_normalised.json").read_text()


def test_committed_v1_checkpoint_still_loads():
    loaded = lc.load(GOLDEN / "root_v1")
    assert loaded.manifest.name == "step-00000001"
    assert lc.verify(GOLDEN / "root_v1").format_version == 1
    expected = {n: p.detach() for n, p in _maker().golden_result().named_optimizer_parameters}
    assert set(loaded.tensors) == set(expected)
    for n, t in expected.items():
        assert loaded.tensors[n].dtype == t.dtype, n
        assert torch.equal(loaded.tensors[n], t), n
