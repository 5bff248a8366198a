"""LoraConfig validation rules, YAML loading and error messages."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from lora_core import DEFAULT_TARGET_MODULES, LoraConfig, LoraConfigError

VALID_KEYS = [
    "enable",
    "rank",
    "alpha",
    "target_modules",
    "exclude_modules",
    "target_parameters",
    "dropout",
    "init_seed",
]


def _yaml(block: str, role: str = "policy") -> str:
    body = "\n".join("      " + line for line in block.strip().splitlines())
    return f"models:\n  {role}:\n    lora:\n{body}\n"


def test_defaults() -> None:
    cfg = LoraConfig()
    assert cfg.enable is False
    assert cfg.rank is None
    assert cfg.alpha is None
    assert cfg.target_modules == DEFAULT_TARGET_MODULES
    assert cfg.target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "to_q",
        "to_k",
        "to_v",
        "to_out",
        "to_qkv",
    )
    assert cfg.exclude_modules == ()
    assert cfg.dropout == 0.0
    assert cfg.init_seed == 0


def test_alpha_defaults_to_rank_and_explicit_alpha_kept() -> None:
    assert LoraConfig(enable=True, rank=8).alpha == 8
    cfg = LoraConfig(enable=True, rank=4, alpha=16)
    assert cfg.alpha == 16
    assert cfg.scaling == 4.0


@pytest.mark.parametrize(
    "data", [{"enable": True}, {"enable": True, "rank": 0}, {"enable": True, "rank": None}]
)
def test_enabled_without_positive_rank_names_lora_rank(data: dict) -> None:
    with pytest.raises(ValidationError, match=r"lora\.rank must be a positive integer"):
        LoraConfig.model_validate(data)


def test_negative_rank_refused() -> None:
    with pytest.raises(ValidationError, match=r"lora\.rank must be a positive integer.*-3"):
        LoraConfig(rank=-3)


def test_rank_while_disabled_is_valid_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lora_core.config"):
        cfg = LoraConfig(enable=False, rank=8)
    assert cfg.rank == 8
    assert "lora.enable is false: no LoRA is applied" in caplog.text


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ValidationError) as info:
        LoraConfig.model_validate({"enable": True, "rank": 8, "rnak": 8})
    msg = str(info.value)
    assert "'rnak'" in msg
    assert str(VALID_KEYS) in msg
    assert "did you mean 'rank'" in msg


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"alpha": 0, "rank": 2}, "alpha"),
        ({"init_seed": True}, "init_seed"),
        ({"init_seed": "3"}, "init_seed"),
        ({"rank": 2.5}, "rank"),
        ({"enable": "yes"}, "enable"),
    ],
)
def test_field_errors_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LoraConfig.model_validate(data)
    assert field in {str(e["loc"][0]) for e in info.value.errors()}


def test_target_modules_must_be_a_list_not_a_string() -> None:
    with pytest.raises(ValidationError, match=r"lora\.target_modules must be a list"):
        LoraConfig(target_modules="q_proj")


@pytest.mark.parametrize("bad", [".*q_proj", "q_proj.", "", "self attn", "layers.*.q"])
def test_patterns_and_empty_components_refused(bad: str) -> None:
    with pytest.raises(ValidationError, match=r"not a name or dotted suffix"):
        LoraConfig(target_modules=[bad])
    with pytest.raises(ValidationError, match=r"lora\.exclude_modules entry"):
        LoraConfig(exclude_modules=[bad])


def test_empty_target_modules_refused() -> None:
    with pytest.raises(ValidationError, match=r"lora\.target_modules is empty and so is"):
        LoraConfig(target_modules=[])


def test_target_parameters_alone_is_a_valid_target() -> None:
    cfg = LoraConfig(enable=True, rank=2, target_modules=[], target_parameters=["mlp.gate.weight"])
    assert cfg.target_parameters == ("mlp.gate.weight",)
    assert LoraConfig().target_parameters == ()
    text = _yaml("enable: true\nrank: 2\ntarget_parameters: [mlp.gate.weight]")
    assert LoraConfig.from_yaml(text, "policy").target_parameters == ("mlp.gate.weight",)


def test_target_parameters_refuse_dropout_and_patterns() -> None:
    with pytest.raises(ValidationError, match=r"lora\.dropout is 0\.1 but lora\.target_parameters"):
        LoraConfig(target_parameters=["gate.weight"], dropout=0.1)
    with pytest.raises(ValidationError, match=r"lora\.target_parameters entry '\.\*gate'"):
        LoraConfig(target_parameters=[".*gate"])


def test_frozen_hashable_equal_and_json() -> None:
    a = LoraConfig(enable=True, rank=8, target_modules=["q_proj", "v_proj"])
    b = LoraConfig.model_validate(
        {"enable": True, "rank": 8, "target_modules": ("q_proj", "v_proj")}
    )
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != LoraConfig(enable=True, rank=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValidationError):
        a.rank = 4  # type: ignore[misc]
    dumped = a.model_dump(mode="json")
    assert json.loads(json.dumps(dumped)) == {
        "enable": True,
        "rank": 8,
        "alpha": 8.0,
        "target_modules": ["q_proj", "v_proj"],
        "exclude_modules": [],
        "target_parameters": [],
        "dropout": 0.0,
        "init_seed": 0,
    }
    assert LoraConfig.model_validate(dumped) == a


def test_from_yaml_text_and_file(tmp_path: Path) -> None:
    text = _yaml(
        "enable: true\nrank: 4\nalpha: 8\ntarget_modules: [q_proj, self_attn.o_proj]\ninit_seed: 7"
    )
    cfg = LoraConfig.from_yaml(text, "policy")
    assert cfg == LoraConfig(
        enable=True, rank=4, alpha=8, target_modules=["q_proj", "self_attn.o_proj"], init_seed=7
    )
    path = tmp_path / "train.yaml"
    path.write_text(text, encoding="utf-8")
    assert LoraConfig.from_yaml(path, "policy") == cfg
    assert LoraConfig.from_yaml(str(path), "policy") == cfg


@pytest.mark.parametrize(
    "text",
    [
        "",
        "trainer: {lr: 1}\n",
        "models:\n  reference: {}\n",
        "models:\n  policy:\n    x: 1\n",
        "models:\n  policy:\n    lora:\n",
    ],
)
def test_from_yaml_missing_block_is_none(text: str) -> None:
    assert LoraConfig.from_yaml(text, "policy") is None


def test_from_yaml_other_role_is_none() -> None:
    assert LoraConfig.from_yaml(_yaml("enable: true\nrank: 4"), "reference") is None


def test_from_yaml_unknown_key_names_key_path(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(_yaml("enable: true\nrnak: 8"), encoding="utf-8")
    with pytest.raises(LoraConfigError) as info:
        LoraConfig.from_yaml(path, "policy")
    msg = str(info.value)
    assert str(path) in msg
    assert "models.policy.lora.rnak" in msg
    assert str(VALID_KEYS) in msg
    assert isinstance(info.value.__cause__, ValidationError)


def test_from_yaml_bad_value_names_key_path() -> None:
    with pytest.raises(LoraConfigError, match=r"models\.policy\.lora\.dropout: .*less than 1"):
        LoraConfig.from_yaml(_yaml("enable: true\nrank: 4\ndropout: 1.5"), "policy")
    with pytest.raises(LoraConfigError, match=r"models\.policy\.lora: .*lora\.rank must be"):
        LoraConfig.from_yaml(_yaml("enable: true"), "policy")


def test_from_yaml_bad_yaml_and_structure() -> None:
    with pytest.raises(LoraConfigError, match=r"<yaml text>: invalid YAML") as info:
        LoraConfig.from_yaml("models: [unclosed\n", "policy")
    assert info.value.__cause__ is not None
    with pytest.raises(LoraConfigError, match=r"duplicate key 'rank'"):
        LoraConfig.from_yaml(_yaml("enable: true\nrank: 4\nrank: 8"), "policy")
    with pytest.raises(LoraConfigError, match=r"models\.policy\.lora must be a mapping"):
        LoraConfig.from_yaml("models:\n  policy:\n    lora: true\n", "policy")
    with pytest.raises(LoraConfigError, match=r"models must be a mapping"):
        LoraConfig.from_yaml("models: [a, b]\n", "policy")


def test_from_yaml_missing_file_hint() -> None:
    with pytest.raises(LoraConfigError, match=r"that file does not exist"):
        LoraConfig.from_yaml("no/such/config.yaml", "policy")
