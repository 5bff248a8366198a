"""LoRAParameter through enable_lora_training: a router-like bare weight, against PEFT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_core import (
    LoraConfig,
    LoRAParameter,
    LoraTargetError,
    enable_lora_training,
    init_lora_tensor,
    remap_checkpoint_keys,
)
from lora_core.contracts import PeftTensorLayout

H, E, K = 12, 6, 2


class Router(nn.Module):
    """The shape of the transformers 5.x MoE routers: a bare ``weight [E, H]``, top-k softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.weight = nn.Parameter(torch.randn(E, H) * 0.3)
        self.register_buffer("bias_correction", torch.linspace(0, 0.1, E))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float() + self.bias_correction, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Router()
        self.proj = nn.Linear(H, H)
        self.experts = nn.Parameter(torch.randn(E, H, H) * 0.1)  # a 3-D bank, like fused experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, w, idx = self.gate(x)
        out = torch.einsum("th,tkoh->tko", x, self.experts[idx])
        return self.proj((out * w.unsqueeze(-1)).sum(1))


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


CFG = LoraConfig(
    enable=True, rank=2, alpha=6, target_modules=[], target_parameters=["gate.weight"], init_seed=4
)


def _perturb_b(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_result_names_aliases_exports_and_init() -> None:
    model = Model()
    result = enable_lora_training(model, CFG)
    assert result.adapted_layers == ("layers.0.gate", "layers.1.gate")
    assert result.parameter_names == (
        "layers.0.gate.lora_A.weight",
        "layers.0.gate.lora_B.weight",
        "layers.1.gate.lora_A.weight",
        "layers.1.gate.lora_B.weight",
    )
    wrapper = model.layers[0].gate
    assert isinstance(wrapper, LoRAParameter)
    assert wrapper.lora_A.weight.shape == (2, H)
    assert wrapper.lora_B.weight.shape == (E, 2)
    assert torch.equal(
        wrapper.lora_A.weight,
        init_lora_tensor("layers.0.gate.lora_A", (2, H), torch.float32, seed=4),
    )
    assert torch.equal(wrapper.lora_B.weight, torch.zeros(E, 2))
    aliases = result.checkpoint_key_aliases
    assert aliases["layers.0.gate.weight"] == "layers.0.gate.base_layer.weight"
    # Buffers of the wrapped module move under base_layer too.
    assert aliases["layers.1.gate.bias_correction"] == "layers.1.gate.base_layer.bias_correction"
    export = result.peft_exports["layers.1.gate.lora_B.weight"]
    assert export.key == "base_model.model.layers.1.gate.lora_B.weight"
    assert export.layout is PeftTensorLayout.IDENTITY
    assert result.peft_target_parameters == ("gate.weight",)
    assert result.peft_target_modules == ()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(result.parameter_names)


def test_forward_and_gradients_match_the_explicit_formula() -> None:
    torch.manual_seed(0)
    model = Model(layers=1)
    ref = Model(layers=1)
    ref.load_state_dict(model.state_dict())
    enable_lora_training(model, CFG)
    _perturb_b(model)
    gate = model.layers[0].gate
    a = gate.lora_A.weight.detach().clone().requires_grad_(True)
    b = gate.lora_B.weight.detach().clone().requires_grad_(True)
    x = torch.randn(7, H)
    y = model(x)
    # The reference swaps the adapted weight in by hand.
    router = ref.layers[0].gate
    del router.weight
    router.weight = model.layers[0].gate.base_layer.weight.detach() + (b @ a) * CFG.scaling
    y_ref = ref(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert gate.lora_A.weight.grad.abs().sum() > 0
    torch.testing.assert_close(gate.lora_A.weight.grad, a.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gate.lora_B.weight.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert gate.base_layer.weight.grad is None


def test_matches_peft_target_parameters() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    ours = Model()
    ref = Model()
    ref.load_state_dict(ours.state_dict())
    result = enable_lora_training(ours, CFG)
    _perturb_b(ours)
    theirs = peft.get_peft_model(
        ref,
        peft.LoraConfig(
            r=CFG.rank,
            lora_alpha=CFG.alpha,
            target_modules=[],
            target_parameters=list(result.peft_target_parameters),
        ),
    )
    peft_sd = peft.get_peft_model_state_dict(theirs)
    assert set(peft_sd) == {e.key for e in result.peft_exports.values()}
    named = dict(theirs.named_parameters())
    with torch.no_grad():
        for fqn, p in result.named_optimizer_parameters:
            key = result.peft_exports[fqn].key.removesuffix(".weight") + ".default.weight"
            named[key].copy_(p)
    x = torch.randn(5, H)
    y_a, y_b = ours(x), theirs(x)
    torch.testing.assert_close(y_a, y_b, rtol=1e-6, atol=1e-6)
    y_a.square().sum().backward()
    y_b.square().sum().backward()
    for fqn, p in result.named_optimizer_parameters:
        key = result.peft_exports[fqn].key.removesuffix(".weight") + ".default.weight"
        assert p.grad is not None, fqn
        assert p.grad.abs().sum() > 0, fqn
        torch.testing.assert_close(p.grad, named[key].grad, rtol=1e-5, atol=1e-6, msg=fqn)


def test_attributes_reach_the_wrapped_module_and_weight_is_the_adapted_one() -> None:
    model = Model(layers=1)
    enable_lora_training(model, CFG)
    _perturb_b(model)
    gate = model.layers[0].gate
    assert gate.top_k == K
    assert torch.equal(gate.bias_correction, gate.base_layer.bias_correction)
    want = gate.base_layer.weight + (gate.lora_B.weight @ gate.lora_A.weight) * CFG.scaling
    torch.testing.assert_close(gate.weight, want, rtol=0, atol=0)
    with pytest.raises(AttributeError):
        _ = gate.no_such_attribute


def test_merge_unmerge_and_idempotent_second_call() -> None:
    model = Model()
    first = enable_lora_training(model, CFG)
    _perturb_b(model)
    x = torch.randn(4, H)
    before = model(x)
    base = model.layers[0].gate.base_layer.weight.detach().clone()
    for layer in model.layers:
        layer.gate.merge()
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    for layer in model.layers:
        layer.gate.unmerge()
    torch.testing.assert_close(model.layers[0].gate.base_layer.weight, base, rtol=0, atol=1e-6)
    second = enable_lora_training(model, CFG)
    assert second.adapted_layers == ()
    assert second.already_adapted_layers == first.adapted_layers
    assert all(a is b for a, b in zip(first.parameters(), second.parameters(), strict=True))
    assert not isinstance(model.layers[0].gate.base_layer, LoRAParameter)


def test_with_linear_targets_and_excludes() -> None:
    model = Model()
    cfg = LoraConfig(
        enable=True,
        rank=2,
        target_modules=["proj"],
        target_parameters=["gate.weight"],
        exclude_modules=["layers.1.gate"],
    )
    result = enable_lora_training(model, cfg)
    assert result.adapted_layers == ("layers.0.proj", "layers.1.proj", "layers.0.gate")
    assert result.peft_target_modules == ("proj",)
    assert result.peft_target_parameters == ("gate.weight",)
    assert not isinstance(model.layers[1].gate, LoRAParameter)


def test_meta_path_bitwise_equal_to_eager() -> None:
    base_sd = Model().state_dict()
    eager = Model()
    eager.load_state_dict(base_sd)
    want = enable_lora_training(eager, CFG)
    with torch.device("meta"):
        lazy = Model()
    result = enable_lora_training(lazy, CFG, prepare_for_fsdp=True)
    assert all(p.is_meta for p in result.parameters())
    lazy.to_empty(device="cpu")
    missing, unexpected = lazy.load_state_dict(remap_checkpoint_keys(base_sd, result), strict=False)
    assert unexpected == []
    assert sorted(missing) == sorted(result.parameter_names)
    assert result.missing_parameter_initializer(lazy) == 4
    got = dict(lazy.named_parameters())
    for name, p in want.named_optimizer_parameters:
        assert torch.equal(got[name], p), name
    x = torch.randn(3, H)
    torch.testing.assert_close(lazy(x), eager(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"target_parameters": ["experts"]}, r"'layers\.0\.experts' of shape \[6, 12, 12\]"),
        (
            {"target_parameters": ["gate.wieght"]},
            r"matched no parameter of Model\. Parameters that exist: "
            r"\['layers\.0\.experts', 'layers\.0\.gate\.weight'",
        ),
        (
            {"target_parameters": ["gate.weight"], "exclude_modules": ["gate"]},
            r"lora\.exclude_modules removed them",
        ),
        (
            {"target_modules": ["proj"], "target_parameters": ["proj.weight"]},
            r"'layers\.0\.proj' is matched by lora\.target_modules and its parameter",
        ),
        (
            {"target_modules": ["nothing"], "target_parameters": ["gate.weight"]},
            r"lora\.target_modules \['nothing'\] matched no nn\.Linear",
        ),
    ],
)
def test_errors_name_the_target(cfg: dict, match: str) -> None:
    full = {"enable": True, "rank": 2, "target_modules": [], **cfg}
    with pytest.raises(LoraTargetError, match=match):
        enable_lora_training(Model(), LoraConfig.model_validate(full))


def test_default_attention_targets_may_match_nothing_when_parameters_are_targeted() -> None:
    cfg = LoraConfig(enable=True, rank=2, target_parameters=["gate.weight"])
    assert enable_lora_training(Model(), cfg).adapted_layers == ("layers.0.gate", "layers.1.gate")


def test_layer_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match=r"has no parameter 'bias'"):
        LoRAParameter(Router(), "bias", 2, 2)
    with pytest.raises(ValueError, match=r"blk\.experts has shape \[6, 12, 12\]; only 2-D"):
        LoRAParameter(Block(), "experts", 2, 2, fqn="blk")
    with pytest.raises(ValueError, match=r"LoRAParameter rank must be a positive int"):
        LoRAParameter(Router(), "weight", 0, 2)


def test_base_weight_set_to_none_after_wrapping_is_named() -> None:
    # Before, base_weight returned None and the failure came later from whatever used it.
    router = Router()
    layer = LoRAParameter(router, "weight", 2, 2, fqn="gate")
    router.register_parameter("weight", None)
    with pytest.raises(TypeError, match=r"'gate': the wrapped Router no longer has parameter"):
        layer.base_weight


def test_a_router_shared_by_two_blocks_is_refused() -> None:
    model = Model()
    model.layers[1].gate = model.layers[0].gate
    cfg = LoraConfig(enable=True, rank=2, target_parameters=["gate.weight"])
    with pytest.raises(
        LoraTargetError,
        match=r"'layers\.1\.gate' is the same object as "
        r"'layers\.0\.gate' \(a shared or tied module\)",
    ):
        enable_lora_training(model, cfg)
