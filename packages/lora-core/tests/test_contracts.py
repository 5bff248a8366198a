"""AdaptationResult and friends: validation, merge rules, describe() golden bytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lora_core import (
    ADAPTATION_RESULT_SCHEMA_VERSION,
    AdaptationResult,
    ComponentVersion,
    ContractError,
    LoraConfig,
    ParameterOwnership,
    PeftExport,
    PeftTensorLayout,
    enable_lora_training,
    peft_lora_key,
)

GOLDEN = Path(__file__).parent / "fixtures" / "adaptation_result_describe.json"
TEST_PRODUCER = ComponentVersion("lora-core", "0.0.0-test")


def _model() -> nn.Module:
    attn = nn.ModuleDict({"q_proj": nn.Linear(8, 6), "o_proj": nn.Linear(6, 8, bias=False)})
    return nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"self_attn": attn})])})


def _golden_result() -> AdaptationResult:
    cfg = LoraConfig(enable=True, rank=2, alpha=4, target_modules=["q_proj", "o_proj"], init_seed=1)
    result = enable_lora_training(_model(), cfg)
    return dataclasses.replace(result, producer=TEST_PRODUCER, components=(TEST_PRODUCER,))


def _render(result: AdaptationResult) -> str:
    return json.dumps(result.describe(), indent=2) + "\n"


def _single(name: str, producer: str = "a", **kwargs: object) -> AdaptationResult:
    p = nn.Parameter(torch.zeros(2, 3))
    return AdaptationResult.create(
        adapted_layers=[name.rsplit(".", 2)[0]],
        named_optimizer_parameters=[(name, p)],
        ownership={name: "replicated"},
        producer=ComponentVersion(producer, "1.0"),
        **kwargs,
    )


def test_describe_matches_golden_fixture_byte_for_byte() -> None:
    assert _render(_golden_result()).encode("utf-8") == GOLDEN.read_bytes()


def test_describe_is_json_and_carries_no_tensor_values() -> None:
    desc = _golden_result().describe()
    assert json.loads(json.dumps(desc)) == desc
    assert desc["parameters"][0] == {
        "name": "layers.0.self_attn.q_proj.lora_A.weight",
        "shape": [2, 8],
        "dtype": "float32",
        "ownership": "replicated",
    }


def test_unknown_schema_version_refused() -> None:
    result = _golden_result()
    with pytest.raises(ContractError, match=r"schema_version 2 is not supported.*version 1"):
        dataclasses.replace(result, schema_version=ADAPTATION_RESULT_SCHEMA_VERSION + 1)


def test_merge_refuses_duplicate_names_and_names_them() -> None:
    a = _single("x.lora_A.weight")
    b = _single("x.lora_A.weight", producer="b")
    with pytest.raises(ContractError, match=r"duplicate names \['x\.lora_A\.weight'\]"):
        a.merge(b)


def test_merge_refuses_duplicate_placeholders() -> None:
    a = _single("x.lora_A.weight", placeholders=["experts.w"])
    b = _single("y.lora_A.weight", placeholders=["experts.w"])
    with pytest.raises(ContractError, match=r"duplicate names \['experts\.w'\]"):
        a.merge(b)


def test_merge_refuses_the_same_tensor_under_two_names() -> None:
    a = _single("x.lora_A.weight")
    p = a.named_optimizer_parameters[0][1]
    b = AdaptationResult.create(
        adapted_layers=["y"],
        named_optimizer_parameters=[("y.w", p)],
        ownership={"y.w": "replicated"},
        producer=ComponentVersion("b", "1"),
    )
    with pytest.raises(ContractError, match=r"same tensor is published twice"):
        a.merge(b)


def test_merge_refuses_different_lora_configs_and_conflicting_aliases() -> None:
    a = _single("x.w", lora_config=LoraConfig(enable=True, rank=2))
    b = _single("y.w", lora_config=LoraConfig(enable=True, rank=4))
    with pytest.raises(ContractError, match=r"different lora_config"):
        a.merge(b)
    c = _single("x.w", checkpoint_key_aliases={"k.weight": "k.base_layer.weight"})
    d = _single("y.w", checkpoint_key_aliases={"k.weight": "k.other.weight"})
    with pytest.raises(ContractError, match=r"conflicting checkpoint_key_aliases \['k\.weight'\]"):
        c.merge(d)


def test_merge_combines_everything_in_order() -> None:
    calls: list[str] = []

    def init_a(model: nn.Module) -> int:
        calls.append("a")
        return 2

    def init_b(model: nn.Module) -> int:
        calls.append("b")
        return 3

    a = _single(
        "x.w",
        missing_parameter_initializer=init_a,
        peft_target_modules=["q_proj"],
        peft_exports={"x.w": PeftExport("base_model.model.x.w")},
    )
    b = _single(
        "y.w",
        producer="b",
        missing_parameter_initializer=init_b,
        peft_target_modules=["q_proj", "gate"],
        rank_local_names=["y.w"],
    )
    merged = a.merge(b)
    assert merged.parameter_names == ("x.w", "y.w")
    assert merged.components == (ComponentVersion("a", "1.0"), ComponentVersion("b", "1.0"))
    assert merged.producer == ComponentVersion("a", "1.0")
    assert merged.peft_target_modules == ("q_proj", "gate")
    assert merged.rank_local_names == ("y.w",)
    assert dict(merged.peft_exports) == {"x.w": PeftExport("base_model.model.x.w")}
    assert merged.missing_parameter_initializer is not None
    assert merged.missing_parameter_initializer(nn.Linear(1, 1)) == 5
    assert calls == ["a", "b"]


def test_create_validates() -> None:
    p = nn.Parameter(torch.zeros(1))
    with pytest.raises(ContractError, match=r"ownership values must be one of"):
        AdaptationResult.create(
            adapted_layers=[],
            named_optimizer_parameters=[("a", p)],
            ownership={"a": "everywhere"},
            producer=TEST_PRODUCER,
        )
    with pytest.raises(ContractError, match=r"ownership has no entry for \['a'\]"):
        AdaptationResult.create(
            adapted_layers=[],
            named_optimizer_parameters=[("a", p)],
            ownership={},
            producer=TEST_PRODUCER,
        )
    with pytest.raises(ContractError, match=r"duplicate parameter names: \['a'\]"):
        AdaptationResult.create(
            adapted_layers=[],
            named_optimizer_parameters=[("a", p), ("a", p)],
            ownership={"a": "sharded"},
            producer=TEST_PRODUCER,
        )
    with pytest.raises(ContractError, match=r"peft_exports names unknown parameters \['b'\]"):
        AdaptationResult.create(
            adapted_layers=[],
            named_optimizer_parameters=[("a", p)],
            ownership={"a": "rank0"},
            producer=TEST_PRODUCER,
            peft_exports={"b": PeftExport("k")},
        )
    with pytest.raises(ContractError, match=r"lora_config must be a lora_core\.LoraConfig"):
        AdaptationResult.create(
            adapted_layers=[],
            named_optimizer_parameters=[],
            ownership={},
            producer=TEST_PRODUCER,
            lora_config={"rank": 2},
        )  # type: ignore[arg-type]
    with pytest.raises(ContractError, match=r"must be a tuple"):
        AdaptationResult(
            adapted_layers=["x"],
            named_optimizer_parameters=(),  # type: ignore
            ownership=AdaptationResult.create(
                adapted_layers=[],
                named_optimizer_parameters=[],
                ownership={},
                producer=TEST_PRODUCER,
            ).ownership,
            producer=TEST_PRODUCER,
        )


def test_frozen() -> None:
    result = _golden_result()
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.adapted_layers = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        result.ownership["x"] = ParameterOwnership.SHARDED  # type: ignore[index]


def test_small_value_types() -> None:
    assert ComponentVersion("a", "1").to_json() == {"name": "a", "version": "1"}
    with pytest.raises(ContractError, match=r"ComponentVersion\.version must be a non-empty"):
        ComponentVersion("a", "")
    with pytest.raises(ContractError, match=r"'no-such-dist-xyz' is not installed"):
        ComponentVersion.of("no-such-dist-xyz")
    with pytest.raises(ContractError, match=r"PeftExport\.key must be a non-empty str"):
        PeftExport("")
    with pytest.raises(ContractError, match=r"PeftExport\.layout must be a PeftTensorLayout"):
        PeftExport("k", "identity")  # type: ignore[arg-type]
    assert PeftExport("k").layout is PeftTensorLayout.IDENTITY
    assert ParameterOwnership("rank_local") is ParameterOwnership.RANK_LOCAL


def test_peft_tensor_layout_stacks_as_peft_does() -> None:
    e, r, n_in, n_out = 3, 2, 5, 4
    a = torch.randn(e, r, n_in)
    b = torch.randn(e, n_out, r)
    sa = PeftTensorLayout.EXPERT_STACKED_A.to_peft(a)
    sb = PeftTensorLayout.EXPERT_STACKED_B.to_peft(b)
    assert sa.shape == (e * r, n_in)
    assert sb.shape == (n_out, r * e)
    for x in range(e):
        for j in range(r):
            # A is expert-major (row e*r + j), B rank-major (column j*E + e), as PEFT reads them.
            assert torch.equal(sa[x * r + j], a[x, j])
            assert torch.equal(sb[:, j * e + x], b[x, :, j])
    assert torch.equal(PeftTensorLayout.EXPERT_STACKED_A.from_peft(sa, e), a)
    back = PeftTensorLayout.EXPERT_STACKED_B.from_peft(sb, e)
    assert torch.equal(back, b)
    assert back.data_ptr() == sb.data_ptr()  # a view: gradients reach PEFT's parameter
    t = torch.randn(2, 3)
    assert PeftTensorLayout.IDENTITY.to_peft(t) is t
    assert PeftTensorLayout.IDENTITY.from_peft(t, 7) is t
    with pytest.raises(ContractError, match=r"expert_stacked_a needs a 3-D tensor"):
        PeftTensorLayout.EXPERT_STACKED_A.to_peft(t)
    with pytest.raises(ContractError, match=r"dim 1 is a multiple of num_experts=4"):
        PeftTensorLayout.EXPERT_STACKED_B.from_peft(sb, 4)
    assert peft_lora_key("m.experts", "B") == "m.experts.lora_B.weight"
    with pytest.raises(ContractError, match="'A' or 'B'"):
        peft_lora_key("m", "C")
