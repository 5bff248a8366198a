"""Hypothesis fuzzing: a damaged manifest.json only ever raises this package's errors."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lora_checkpoint as lc

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
FUZZ = settings(
    max_examples=120,
    deadline=2000,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def good(tmp_path_factory, result_factory):
    root = tmp_path_factory.mktemp("fuzz")
    res = result_factory()
    opt = torch.optim.AdamW(res.parameters())
    sum(p.float().sum() for p in res.parameters()).backward()
    opt.step()
    state = lc.TrainingState.capture(opt, res, step=1, data_position={"i": 1})
    m = lc.save(root, res, training_state=state)
    return root / m.name, json.loads((root / m.name / "manifest.json").read_text())


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _edit(doc, path, value, delete=False):
    doc = json.loads(json.dumps(doc))
    if not path:
        return value
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    if delete:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return doc


def _load_with(ckpt, text):
    (ckpt / "manifest.json").write_text(text)
    with contextlib.suppress(lc.CheckpointError):
        lc.load(ckpt)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, good):
    ckpt, _ = good
    dst = tmp_path_factory.mktemp("scratch") / ckpt.name
    shutil.copytree(ckpt, dst)
    return dst


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_fuzz_replace_a_field(good, scratch, data):
    _, raw = good
    paths = list(_paths(raw))
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_values)
    _load_with(scratch, json.dumps(_edit(raw, path, value)))


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_fuzz_delete_a_field(good, scratch, data):
    _, raw = good
    paths = [p for p in _paths(raw) if p and isinstance(p[-1], str)]
    path = data.draw(st.sampled_from(paths))
    _load_with(scratch, json.dumps(_edit(raw, path, None, delete=True)))


@pytest.mark.timeout(120)
@FUZZ
@given(blob=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzz_arbitrary_bytes(blob):
    with pytest.raises(lc.ManifestError):
        lc.parse_manifest(blob)


@pytest.mark.timeout(120)
@FUZZ
@given(cut=st.integers(0, 10_000))
def test_fuzz_truncated_manifest(good, scratch, cut):
    _, raw = good
    text = json.dumps(raw)
    _load_with(scratch, text[: cut % len(text)])


def test_fuzz_scratch_still_loads_when_restored(good, scratch):
    _, raw = good
    (scratch / "manifest.json").write_text(json.dumps(raw))
    assert lc.load(scratch).manifest.name == raw["name"]
