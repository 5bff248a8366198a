"""Round trips through save/load/restore and the on-disk layout."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_checkpoint as lc
from lora_core import LoraConfig
from lora_core.contracts import AdaptationResult, PeftTensorLayout

GOLDEN = Path(__file__).parent / "golden"


def _clone_values(result: AdaptationResult) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in result.named_optimizer_parameters}


def test_save_layout_and_latest(tmp_path, result):
    m = lc.save(tmp_path, result, step=7)
    assert m.name == "step-00000007"
    assert (tmp_path / "latest").read_text() == "step-00000007\n"
    files = sorted(os.listdir(tmp_path / m.name))
    assert files == sorted(
        [
            "manifest.json",
            "adapter_config.json",
            "adapter_model.safetensors",
            "fused_expert_lora.safetensors",
            "rank_local-rank00000.safetensors",
        ]
    )
    # no temp or trash leftovers; .lock is the root's writer lock
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == [".lock"]
    assert m.world_size == 1
    assert m.peft_compatible
    assert [c.name for c in m.components] == ["lora-core", "lora-checkpoint"]
    assert m.components[-1].version == lc.__version__
    assert m.lora_config == result.lora_config.model_dump(mode="json")


def test_load_equals_saved_and_restore_in_place(tmp_path, result):
    saved = _clone_values(result)
    lc.save(tmp_path, result, step=1)
    params_before = [id(p) for p in result.parameters()]
    with torch.no_grad():
        for p in result.parameters():
            p.zero_()
    loaded = lc.load(tmp_path)
    assert set(loaded.tensors) == set(saved)
    for n, t in saved.items():
        assert loaded.tensors[n].dtype == t.dtype
        assert torch.equal(loaded.tensors[n], t), n
    restored = lc.restore(result, loaded)
    assert set(restored) == set(saved)
    assert [id(p) for p in result.parameters()] == params_before
    for n, p in result.named_optimizer_parameters:
        assert torch.equal(p, saved[n]), n


def test_files_are_plain_safetensors_with_typed_placement(tmp_path, result):
    m = lc.save(tmp_path, result, step=1)
    d = tmp_path / m.name
    peft = load_file(d / "adapter_model.safetensors")
    own = load_file(d / "fused_expert_lora.safetensors")
    local = load_file(d / "rank_local-rank00000.safetensors")
    p = dict(result.named_optimizer_parameters)
    # dense (IDENTITY) tensors live only in PEFT's file, under their PEFT key
    assert torch.equal(
        peft["base_model.model.layer.q_proj.lora_A.weight"], p["layer.q_proj.lora_A.weight"]
    )
    assert "layer.q_proj.lora_A.weight" not in own
    # expert tensors: native layout in our file, stacked PEFT layout in PEFT's file
    a = p["moe.experts.gate_up_proj.lora_A"].detach()
    b = p["moe.experts.gate_up_proj.lora_B"].detach()
    assert torch.equal(own["moe.experts.gate_up_proj.lora_A"], a)
    assert torch.equal(own["moe.experts.gate_up_proj.lora_B"], b)
    e, r, h = a.shape
    pa = peft["base_model.model.moe.experts.lora_A.weight"]
    pb = peft["base_model.model.moe.experts.lora_B.weight"]
    assert pa.shape == (e * r, h)
    assert pb.shape == (b.shape[1], e * r)
    for ei in range(e):
        for j in range(r):
            assert torch.equal(pa[ei * r + j], a[ei, j])
            assert torch.equal(pb[:, j * e + ei], b[ei, :, j])
    # no PEFT export -> only our file; rank-local -> only the per-rank file
    assert torch.equal(own["moe.lora_experts.0.weight"], p["moe.lora_experts.0.weight"])
    assert set(local) == {"router.rank_bias"}
    kinds = {(t.file, t.kind) for t in m.tensors}
    assert ("adapter_model.safetensors", lc.TensorKind.PEFT_EXPORT) in kinds
    exported = [t for t in m.tensors if t.kind is lc.TensorKind.PEFT_EXPORT]
    assert {t.layout for t in exported} == {
        PeftTensorLayout.EXPERT_STACKED_A,
        PeftTensorLayout.EXPERT_STACKED_B,
    }


def test_stacked_layout_matches_documented_formula():
    a = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    b = torch.arange(2 * 5 * 3.0).reshape(2, 5, 3)
    sa = lc.to_peft_layout(a, PeftTensorLayout.EXPERT_STACKED_A, "a")
    sb = lc.to_peft_layout(b, PeftTensorLayout.EXPERT_STACKED_B, "b")
    assert torch.equal(sa, torch.cat([a[0], a[1]], dim=0))
    assert torch.equal(sb, torch.stack([b[0], b[1]], dim=2).reshape(5, 6))  # rank-major
    with pytest.raises(lc.ShapeMismatchError, match=r"3-D"):
        lc.to_peft_layout(torch.zeros(2, 2), PeftTensorLayout.EXPERT_STACKED_A, "x")


def test_adapter_config_matches_peft_fields(tmp_path, result):
    m = lc.save(tmp_path, result, step=1, base_model_name_or_path="/models/tiny")
    cfg = json.loads((tmp_path / m.name / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert cfg["task_type"] is None
    assert cfg["r"] == 4
    assert cfg["lora_alpha"] == 8
    assert cfg["lora_dropout"] == 0.0
    assert cfg["target_modules"] == ["layer.q_proj"]
    assert cfg["target_parameters"] == ["moe.experts.gate_up_proj"]
    assert cfg["base_model_name_or_path"] == "/models/tiny"
    from peft import LoraConfig as PeftLoraConfig

    pc = PeftLoraConfig.from_pretrained(str(tmp_path / m.name))
    assert pc.r == 4
    assert pc.lora_alpha == 8
    assert pc.peft_type.value == "LORA"


def test_without_lora_config_no_adapter_config(tmp_path, result_factory):
    res = result_factory(with_config=False)
    m = lc.save(tmp_path, res, step=1)
    assert not (tmp_path / m.name / "adapter_config.json").exists()
    assert not m.peft_compatible
    assert m.lora_config is None
    loaded = lc.load(tmp_path / m.name)
    assert set(loaded.tensors) == set(res.parameter_names)


def test_rankless_lora_config_with_peft_exports_is_a_checkpoint_error(tmp_path, result):
    # A disabled config has no rank, so adapter_config.json cannot say r; int(None) raised a
    # bare TypeError before.
    res = dataclasses.replace(result, lora_config=LoraConfig(enable=False))
    with pytest.raises(lc.CheckpointError, match=r"needs result.lora_config \(rank and alpha\)"):
        lc.save(tmp_path, res, step=1)
    assert lc.list_checkpoints(tmp_path) == []


def test_keep_last_prunes_after_publish(tmp_path, result):
    for s in range(1, 6):
        lc.save(tmp_path, result, step=s, keep_last=2)
    assert sorted(p for p in os.listdir(tmp_path) if not p.startswith(".")) == [
        "latest",
        "step-00000004",
        "step-00000005",
    ]
    assert [m.name for m in lc.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    assert lc.load(tmp_path).manifest.name == "step-00000005"


def test_load_specific_checkpoint_and_custom_name(tmp_path, result):
    lc.save(tmp_path, result, step=1)
    with torch.no_grad():
        result.parameters()[0].add_(1)
    lc.save(tmp_path, result, name="best")
    assert lc.load(tmp_path).manifest.name == "best"
    older = lc.load(tmp_path / "step-00000001")
    assert not torch.equal(older.tensors[result.parameter_names[0]], result.parameters()[0])


def test_bad_save_arguments(tmp_path, result):
    with pytest.raises(lc.CheckpointError, match=r"step=, name="):
        lc.save(tmp_path, result)
    with pytest.raises(lc.CheckpointError, match=r"plain directory name"):
        lc.save(tmp_path, result, name="../escape")
    with pytest.raises(lc.CheckpointError, match=r"keep_last"):
        lc.save(tmp_path, result, step=1, keep_last=0)
    lc.save(tmp_path, result, step=1)
    with pytest.raises(lc.CheckpointExistsError, match=r"already exists"):
        lc.save(tmp_path, result, step=1)
    # no temp or trash leftovers; .lock is the root's writer lock
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == [".lock"]


def test_restore_is_strict(tmp_path, result, result_factory):
    lc.save(tmp_path, result, step=1)
    loaded = lc.load(tmp_path)
    with pytest.raises(lc.UnexpectedTensorError, match=r"router.rank_bias"):
        lc.restore(result_factory(rank_local=False), loaded)
    smaller = lc.load(tmp_path)
    fewer = result_factory(extra=False)
    with pytest.raises(lc.UnexpectedTensorError, match=r"moe\.lora_experts"):
        lc.restore(fewer, smaller)
    other = result_factory()
    lc.save(tmp_path / "b", other, step=1)
    wrong_dtype = dict(lc.load(tmp_path / "b").tensors)
    wrong_dtype["layer.q_proj.lora_A.weight"] = wrong_dtype["layer.q_proj.lora_A.weight"].double()
    with pytest.raises(lc.DtypeMismatchError, match=r"layer.q_proj.lora_A.weight"):
        lc.restore(other, lc.LoadedCheckpoint(loaded.manifest, wrong_dtype, None, loaded.path))
    wrong_shape = dict(loaded.tensors)
    wrong_shape["layer.q_proj.lora_A.weight"] = torch.zeros(2, 2)
    before = result.parameters()[-1].detach().clone()
    with pytest.raises(lc.ShapeMismatchError, match=r"\[2, 2\]"):
        lc.restore(result, lc.LoadedCheckpoint(loaded.manifest, wrong_shape, None, loaded.path))
    assert torch.equal(result.parameters()[-1], before)  # nothing copied on failure
    missing = {k: v for k, v in loaded.tensors.items() if k != "router.rank_bias"}
    with pytest.raises(lc.MissingTensorError, match=r"router.rank_bias"):
        lc.restore(result, lc.LoadedCheckpoint(loaded.manifest, missing, None, loaded.path))


def test_restore_into_module(tmp_path):
    from torch import nn

    from lora_core import LoraConfig, enable_lora_training

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    res = enable_lora_training(model, LoraConfig(enable=True, rank=2, target_modules=("0", "2")))
    with torch.no_grad():
        for p in res.parameters():
            p.normal_()
    saved = _clone_values(res)
    lc.save(tmp_path, res, step=1)
    model2 = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    res2 = enable_lora_training(model2, LoraConfig(enable=True, rank=2, target_modules=("0", "2")))
    lc.restore(model2, lc.load(tmp_path))
    for n, p in res2.named_optimizer_parameters:
        assert torch.equal(p, saved[n])


def test_format_migration_registry(tmp_path):
    # Format 1 -> 2 is built in: listed, and neither replaceable nor removable.
    assert lc.registered_migrations() == {1: 2}
    with pytest.raises(ValueError, match=r"migrated by lora-checkpoint itself"):
        lc.register_migration(1, 2, lambda doc: doc)
    with pytest.raises(ValueError, match=r"built into lora-checkpoint"):
        lc.unregister_migration(1)
    with pytest.raises(ValueError, match=r"current format"):
        lc.register_migration(lc.FORMAT_VERSION, 3, lambda doc: doc)
    assert lc.registered_migrations() == {1: 2}

    # A user's format 0 (a format 1 manifest plus a field) chains into the built-in migration.
    shutil.copytree(GOLDEN / "root_v1", tmp_path / "root")
    path = tmp_path / "root" / "step-00000001" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["format_version"] = 0
    raw["legacy_field"] = "x"
    path.write_text(json.dumps(raw))
    with pytest.raises(lc.UnknownFormatVersionError, match=r"format_version 0"):
        lc.load(tmp_path / "root")

    def v0_to_v1(doc):
        doc.pop("legacy_field")
        return {**doc, "format_version": 1}

    lc.register_migration(0, 1, v0_to_v1)
    try:
        assert lc.registered_migrations() == {0: 1, 1: 2}
        with pytest.raises(ValueError, match=r"already registered"):
            lc.register_migration(0, 1, v0_to_v1)
        m = lc.verify(tmp_path / "root")  # every file checked with SHA-256
        assert m.format_version == lc.FORMAT_VERSION
        assert m.digest_algorithm is lc.DigestAlgorithm.SHA256
    finally:
        lc.unregister_migration(0)
    assert lc.registered_migrations() == {1: 2}


def test_training_state_roundtrip_exact(tmp_path, result):
    import random

    import numpy as np

    opt = torch.optim.AdamW(result.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        loss = sum((p.float() ** 2).sum() for p in result.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = lc.TrainingState.capture(opt, result, step=2, data_position={"epoch": 0, "index": 17})
    expected_rng = (torch.rand(3), random.random(), np.random.rand())
    lc.save(tmp_path, result, training_state=state)
    loaded = lc.load(tmp_path)
    assert loaded.manifest.name == "step-00000002"
    ts = loaded.training_state
    assert ts.step == 2
    assert dict(ts.data_position) == {"epoch": 0, "index": 17}
    assert set(ts.optimizer.state) == set(result.parameter_names)
    opt2 = torch.optim.AdamW(result.parameters(), lr=0.5)
    ts.apply(opt2, result)
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    for i in sd1["state"]:
        for k, v in sd1["state"][i].items():
            assert torch.equal(v, sd2["state"][i][k]), (i, k)
    assert torch.equal(torch.rand(3), expected_rng[0])
    assert random.random() == expected_rng[1]
    assert np.random.rand() == expected_rng[2]


def test_training_state_rejects_foreign_parameters(result, result_factory):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(lc.CheckpointError, match=r"not in result.named_optimizer_parameters"):
        lc.TrainingState.capture(opt, result, step=0)
    with pytest.raises(lc.CheckpointError, match=r"step must be"):
        lc.TrainingState(step=-1)
    with pytest.raises(lc.CheckpointError, match=r"JSON"):
        lc.TrainingState(step=1, data_position={"x": object()})
    opt = torch.optim.SGD(result.parameters(), lr=0.1)
    st = lc.TrainingState.capture(opt, result, step=0)
    small = result_factory(extra=False)
    with pytest.raises(lc.UnexpectedTensorError, match=r"moe\.lora_experts"):
        st.apply(torch.optim.SGD(small.parameters(), lr=0.1), small)
