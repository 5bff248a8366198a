"""enable_lora_training: matching rules, freezing, result fields, determinism, meta path."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lora_core import (
    AdaptationResult,
    ComponentVersion,
    ContractError,
    LoraConfig,
    LoRALinear,
    LoraTargetError,
    ParameterOwnership,
    PeftExport,
    enable_lora_training,
    init_lora_tensor,
    matches_module,
    rebind_parameters,
    remap_checkpoint_keys,
)

H = 16


class Attention(nn.Module):
    """Multi-head self-attention with q/k/v/o projections, like a decoder layer's."""

    def __init__(self, reverse: bool = False) -> None:
        super().__init__()
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]
        for name in reversed(names) if reverse else names:
            self.add_module(name, nn.Linear(H, H, bias=name != "o_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            m(x).view(b, t, 2, H // 2).transpose(1, 2)
            for m in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, H))


class Block(nn.Module):
    """A pre-norm block: attention, a cross projection and an MLP with a ``foo_proj``."""

    def __init__(self, reverse: bool = False) -> None:
        super().__init__()
        if reverse:
            self.foo_proj = nn.Linear(H, H)
            self.cross_attn = nn.ModuleDict({"q_proj": nn.Linear(H, H)})
            self.self_attn = Attention(reverse)
            self.norm = nn.LayerNorm(H)
        else:
            self.norm = nn.LayerNorm(H)
            self.self_attn = Attention(reverse)
            self.cross_attn = nn.ModuleDict({"q_proj": nn.Linear(H, H)})
            self.foo_proj = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm(x))
        return x + self.foo_proj(torch.relu(self.cross_attn["q_proj"](x)))


class TinyTransformer(nn.Module):
    """Embedding, ``n`` blocks in ``model.layers``, and an ``lm_head``."""

    def __init__(self, n: int = 2, reverse: bool = False) -> None:
        super().__init__()
        blocks = [None] * n
        for i in reversed(range(n)) if reverse else range(n):
            blocks[i] = Block(reverse)
        self.model = nn.Module()
        self.model.embed = nn.Embedding(11, H)
        self.model.layers = nn.ModuleList(blocks)
        self.lm_head = nn.Linear(H, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed(ids)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(x)


CFG = LoraConfig(enable=True, rank=4, alpha=8, init_seed=5)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(_adapter_state(model).items()):
        h.update(k.encode())
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def test_matches_module_whole_components() -> None:
    assert matches_module("model.layers.0.self_attn.o_proj", ["o_proj"])
    assert not matches_module("model.layers.0.foo_proj", ["o_proj"])
    assert not matches_module("model.layers.0.o_proj_x", ["o_proj"])
    assert matches_module("a.self_attn.q_proj", ["self_attn.q_proj"])
    assert not matches_module("a.cross_attn.q_proj", ["self_attn.q_proj"])
    assert not matches_module("a.my_self_attn.q_proj", ["self_attn.q_proj"])
    assert not matches_module("q_proj", ["self_attn.q_proj"])
    assert matches_module("layers.0.q", ["0.q"])


def test_default_targets_adapt_attention_only() -> None:
    model = TinyTransformer()
    result = enable_lora_training(model, CFG)
    expected = [
        f"model.layers.{i}.{p}"
        for i in range(2)
        for p in [f"self_attn.{n}" for n in ATTN] + ["cross_attn.q_proj"]
    ]
    assert list(result.adapted_layers) == expected
    for name in expected:
        assert isinstance(model.get_submodule(name), LoRALinear)
    assert type(model.get_submodule("model.layers.0.foo_proj")) is nn.Linear
    assert type(model.lm_head) is nn.Linear


def test_dotted_suffix_target() -> None:
    model = TinyTransformer()
    cfg = CFG.model_copy(update={"target_modules": ("self_attn.q_proj",)})
    result = enable_lora_training(model, LoraConfig.model_validate(cfg.model_dump()))
    assert result.adapted_layers == (
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    )
    assert type(model.get_submodule("model.layers.0.cross_attn.q_proj")) is nn.Linear


def test_excludes_apply_after_targets() -> None:
    model = TinyTransformer()
    cfg = LoraConfig(
        enable=True,
        rank=2,
        target_modules=["q_proj", "o_proj"],
        exclude_modules=["cross_attn.q_proj", "layers.1.self_attn.o_proj"],
    )
    result = enable_lora_training(model, cfg)
    assert result.adapted_layers == (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.q_proj",
    )


def test_only_linear_modules_are_replaced() -> None:
    model = TinyTransformer()
    cfg = LoraConfig(enable=True, rank=2, target_modules=["self_attn", "norm", "foo_proj"])
    result = enable_lora_training(model, cfg)
    assert result.adapted_layers == ("model.layers.0.foo_proj", "model.layers.1.foo_proj")
    assert isinstance(model.model.layers[0].self_attn, nn.Module)
    assert type(model.model.layers[0].norm) is nn.LayerNorm


def test_nothing_matched_names_targets_and_existing_linears() -> None:
    model = TinyTransformer()
    with pytest.raises(LoraTargetError) as info:
        enable_lora_training(model, LoraConfig(enable=True, rank=2, target_modules=["wq"]))
    msg = str(info.value)
    assert "['wq']" in msg
    assert "model.layers.0.self_attn.q_proj" in msg
    assert "TinyTransformer" in msg
    # Nothing changed.
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_all_excluded_says_so() -> None:
    cfg = LoraConfig(enable=True, rank=2, target_modules=["o_proj"], exclude_modules=["o_proj"])
    with pytest.raises(
        LoraTargetError,
        match=r"2 matched but all were removed by "
        r"lora\.exclude_modules \['o_proj'\]",
    ):
        enable_lora_training(TinyTransformer(), cfg)


def test_shared_linear_refused() -> None:
    model = TinyTransformer()
    model.model.layers[1].self_attn.q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(LoraTargetError, match=r"same object as 'model\.layers\.0\.self_attn"):
        enable_lora_training(model, CFG)


@pytest.mark.parametrize("cfg", [None, LoraConfig(), LoraConfig(rank=8)])
def test_disabled_returns_empty_result_and_logs(
    cfg: LoraConfig | None, caplog: pytest.LogCaptureFixture
) -> None:
    model = TinyTransformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="lora_core.injection"):
        result = enable_lora_training(model, cfg)
    assert "no LoRA applied" in caplog.text
    assert result.adapted_layers == ()
    assert result.named_optimizer_parameters == ()
    assert result.lora_config == cfg
    assert result.missing_parameter_initializer is None
    assert all(p.requires_grad for p in model.parameters())
    assert model.state_dict().keys() == before.keys()


def test_wrong_config_type() -> None:
    with pytest.raises(TypeError, match=r"must be a lora_core\.LoraConfig, got dict"):
        enable_lora_training(TinyTransformer(), {"enable": True, "rank": 4})  # type: ignore


def test_idempotent_second_call() -> None:
    model = TinyTransformer()
    first = enable_lora_training(model, CFG)
    values = {k: v.clone() for k, v in _adapter_state(model).items()}
    second = enable_lora_training(model, CFG)
    assert second.adapted_layers == ()
    assert second.already_adapted_layers == first.adapted_layers
    assert len(second.already_adapted_layers) == 10
    assert not any(
        isinstance(m.base_layer, LoRALinear) for m in model.modules() if isinstance(m, LoRALinear)
    )
    assert second.parameter_names == first.parameter_names
    assert all(p is q for p, q in zip(second.parameters(), first.parameters(), strict=True))
    assert all(p.requires_grad for p in second.parameters())
    for k, v in _adapter_state(model).items():
        assert torch.equal(v, values[k])
    # A broader second call adapts only the new layers.
    third = enable_lora_training(
        model, CFG.model_copy(update={"target_modules": ("foo_proj", "q_proj")})
    )
    assert third.adapted_layers == ("model.layers.0.foo_proj", "model.layers.1.foo_proj")
    assert len(third.already_adapted_layers) == 4


def test_result_fields() -> None:
    model = TinyTransformer(n=1)
    result = enable_lora_training(model, CFG)
    assert isinstance(result, AdaptationResult)
    layers = ["model.layers.0.self_attn." + n for n in ATTN] + ["model.layers.0.cross_attn.q_proj"]
    names = [f"{fqn}.{leaf}.weight" for fqn in layers for leaf in ("lora_A", "lora_B")]
    assert result.parameter_names == tuple(names)
    for name, p in result.named_optimizer_parameters:
        assert p is model.get_parameter(name)
        assert result.ownership[name] is ParameterOwnership.REPLICATED
        assert result.peft_exports[name] == PeftExport(key=f"base_model.model.{name}")
    aliases = {}
    for fqn in layers:
        aliases[f"{fqn}.weight"] = f"{fqn}.base_layer.weight"
        if not fqn.endswith("o_proj"):
            aliases[f"{fqn}.bias"] = f"{fqn}.base_layer.bias"
    assert dict(result.checkpoint_key_aliases) == aliases
    assert result.peft_target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
    assert result.lora_config is CFG
    assert result.producer == ComponentVersion.of("lora-core")
    assert result.components == (result.producer,)
    assert result.missing_parameter_initializer is None
    layer = model.get_submodule(layers[0])
    assert (layer.rank, layer.alpha, layer.scaling) == (4, 8.0, 2.0)


def test_freezes_everything_else_and_grads_reach_only_lora() -> None:
    model = TinyTransformer()
    result = enable_lora_training(model, CFG)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(result.parameter_names)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(result.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 11, (2, 5))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == (n in trainable), n
        opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_init_from_init_lora_tensor_independent_of_creation_order() -> None:
    a, b = TinyTransformer(), TinyTransformer(reverse=True)
    assert [n for n, _ in a.named_modules()] != [n for n, _ in b.named_modules()]
    enable_lora_training(a, CFG)
    torch.rand(100)  # the global RNG position must not matter either
    enable_lora_training(b, CFG)
    sa, sb = _adapter_state(a), _adapter_state(b)
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        assert torch.equal(v, sb[k]), k
        fqn, leaf = k.removesuffix(".weight").rsplit(".", 1)
        assert torch.equal(v, init_lora_tensor(f"{fqn}.{leaf}", v.shape, v.dtype, seed=5))
    other = TinyTransformer()
    enable_lora_training(other, CFG.model_copy(update={"init_seed": 6}))
    name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not torch.equal(_adapter_state(other)[name], sa[name])


@pytest.mark.timeout(120)
def test_same_adapters_in_a_separate_process() -> None:
    code = (
        "import runpy, sys, torch\n"
        "torch.set_num_threads(1)\n"
        "ns = runpy.run_path(sys.argv[1])\n"
        "m = ns['TinyTransformer'](reverse=True)\n"
        "ns['enable_lora_training'](m, ns['CFG'])\n"
        "print(ns['_digest'](m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, __file__],
        capture_output=True,
        text=True,
        check=True,
        timeout=100,
        env={**os.environ, "PYTHONHASHSEED": "77", "OMP_NUM_THREADS": "1"},
    )
    model = TinyTransformer()
    enable_lora_training(model, CFG)
    assert out.stdout.strip().splitlines()[-1] == _digest(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_path_bitwise_equal_to_eager(dtype: torch.dtype) -> None:
    eager = TinyTransformer().to(dtype)
    base_checkpoint = {k: v.clone() for k, v in eager.state_dict().items()}
    eager_result = enable_lora_training(eager, CFG)

    with torch.device("meta"):
        lazy = TinyTransformer().to(dtype)
    result = enable_lora_training(lazy, CFG, prepare_for_fsdp=True)
    assert all(p.is_meta for p in result.parameters())
    assert result.parameter_names == eager_result.parameter_names
    assert result.checkpoint_key_aliases == eager_result.checkpoint_key_aliases
    assert result.missing_parameter_initializer is not None
    lazy.to_empty(device="cpu")
    missing, unexpected = lazy.load_state_dict(
        remap_checkpoint_keys(base_checkpoint, result), strict=False
    )
    assert unexpected == []
    assert sorted(missing) == sorted(result.parameter_names)
    assert result.missing_parameter_initializer(lazy) == len(result.parameter_names)

    got, want = lazy.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert v.dtype == got[k].dtype
        assert torch.equal(
            v.view(torch.uint8) if v.dtype == torch.bfloat16 else v,
            got[k].view(torch.uint8) if v.dtype == torch.bfloat16 else got[k],
        ), k
    ids = torch.randint(0, 11, (2, 5))
    assert torch.equal(lazy(ids), eager(ids))
    # to_empty replaced the Parameter objects; rebind_parameters points at the live ones.
    assert not any(p is lazy.get_parameter(n) for n, p in result.named_optimizer_parameters)
    rebound = rebind_parameters(result, lazy)
    assert rebound.parameter_names == result.parameter_names
    assert rebound.checkpoint_key_aliases == result.checkpoint_key_aliases
    assert rebound.missing_parameter_initializer is result.missing_parameter_initializer
    for name, p in rebound.named_optimizer_parameters:
        assert p is lazy.get_parameter(name)
        assert p.requires_grad


def test_rebind_parameters_errors() -> None:
    model = TinyTransformer(n=1)
    result = enable_lora_training(model, CFG)
    with pytest.raises(ContractError, match=r"Linear has no parameter 'model\.layers"):
        rebind_parameters(result, nn.Linear(2, 2))
    model.model.layers[0].self_attn.q_proj.lora_A.weight = nn.Parameter(torch.zeros(3, 16))
    with pytest.raises(ContractError, match=r"shape \[3, 16\] in the model but \[4, 16\]"):
        rebind_parameters(result, model)


def test_prepare_for_fsdp_on_a_real_model_builds_meta_adapters() -> None:
    model = TinyTransformer()
    result = enable_lora_training(model, CFG, prepare_for_fsdp=True)
    assert all(p.is_meta for p in result.parameters())
    assert not model.lm_head.weight.is_meta
    with pytest.raises(RuntimeError, match=r"meta device"):
        result.missing_parameter_initializer(model)


def test_eager_on_meta_model_refused() -> None:
    with torch.device("meta"):
        model = TinyTransformer()
    with pytest.raises(ValueError, match=r"prepare_for_fsdp=True"):
        enable_lora_training(model, CFG)


def test_initializer_needs_the_adapted_model() -> None:
    with torch.device("meta"):
        model = TinyTransformer()
    result = enable_lora_training(model, CFG, prepare_for_fsdp=True)
    with pytest.raises(ContractError, match=r"model has no module 'model\.layers\.0"):
        result.missing_parameter_initializer(nn.Linear(2, 2))


def test_remap_checkpoint_keys() -> None:
    model = TinyTransformer(n=1)
    base = model.state_dict()
    result = enable_lora_training(model, CFG)
    remapped = remap_checkpoint_keys(base, result)
    assert list(remapped)[:2] == ["model.embed.weight", "model.layers.0.norm.weight"]
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in remapped
    assert "model.layers.0.self_attn.q_proj.weight" not in remapped
    assert remapped["lm_head.weight"] is base["lm_head.weight"]
    missing, unexpected = model.load_state_dict(remapped, strict=False)
    assert unexpected == []
    assert sorted(missing) == sorted(result.parameter_names)
    # Already-remapped input passes through unchanged.
    assert remap_checkpoint_keys(remapped, result) == remapped
    mixed = dict(base)
    mixed["model.layers.0.self_attn.q_proj.base_layer.weight"] = base[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    with pytest.raises(ContractError, match=r"both 'model\.layers\.0\.self_attn\.q_proj"):
        remap_checkpoint_keys(mixed, result)


_component = st.sampled_from(["q_proj", "o_proj", "foo_proj", "self_attn", "layers", "0", "1"])


@settings(max_examples=150, deadline=None)
@given(
    name=st.lists(_component, min_size=1, max_size=5),
    target=st.lists(_component, min_size=1, max_size=3),
)
def test_matching_equals_peft_string_rule(name: list[str], target: list[str]) -> None:
    # PEFT's rule for a plain (non-regex) target: equal, or a suffix after a dot.
    n, t = ".".join(name), ".".join(target)
    assert matches_module(n, [t]) == (n == t or n.endswith("." + t))


def test_adapter_internals_are_never_targets() -> None:
    model = TinyTransformer(n=1)
    enable_lora_training(model, CFG)
    cfg = LoraConfig(enable=True, rank=2, target_modules=["lora_A", "base_layer", "q_proj"])
    result = enable_lora_training(model, cfg)
    assert result.adapted_layers == ()
    assert result.already_adapted_layers == (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.cross_attn.q_proj",
    )
    with pytest.raises(LoraTargetError) as info:
        enable_lora_training(model, LoraConfig(enable=True, rank=2, target_modules=["lora_B"]))
    assert "lora_B" not in str(info.value).split("exist:")[1]


class _TwoDownProjs(nn.Module):
    """Two blocks with a ``down_proj`` Linear and a bare ``down_proj`` parameter elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.ModuleDict({"down_proj": nn.Linear(4, 4, bias=False)})
        self.moe = nn.ModuleDict(
            {
                "shared": nn.ModuleDict({"down_proj": nn.Linear(4, 4, bias=False)}),
                "q_proj": nn.Linear(4, 4, bias=False),
            }
        )
        self.experts = nn.Module()
        self.experts.down_proj = nn.Parameter(torch.zeros(2, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe["shared"]["down_proj"](self.dense["down_proj"](x)) + self.moe["q_proj"](x)


def test_peft_target_modules_qualify_a_leaf_that_names_something_else() -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = _TwoDownProjs()
    cfg = LoraConfig(enable=True, rank=2, target_modules=["shared.down_proj", "q_proj"])
    result = enable_lora_training(model, cfg)
    # A bare "down_proj" would make PEFT adapt dense.down_proj too; q_proj is unambiguous.
    assert result.peft_target_modules == ("q_proj", "shared.down_proj")
    peft_model = get_peft_model(
        _TwoDownProjs(), PeftLoraConfig(r=2, target_modules=list(result.peft_target_modules))
    )
    adapted = {
        n.removeprefix("base_model.model.").split(".lora_A")[0]
        for n, _ in peft_model.named_parameters()
        if ".lora_A." in n
    }
    assert adapted == {"moe.shared.down_proj", "moe.q_proj"}
