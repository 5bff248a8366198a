"""wrap's self-check: the activation comes from the experts module, mis-specified experts fail."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUTanh

import kt_kernel
from moe_experts import KernelExperts, SelfCheckError, WrapError, wrap
from moe_experts.self_check import expert_activation, self_check

from .conftest import token_batch

# The formats' self_check_tolerance: their rounding on the 37 tiny families (gaussian
# weights), measured at int8 <= 2.4e-2, fp8 <= 8.2e-2, int4 <= 0.26.
FORMAT_TOLERANCE = {"int8": 5e-2, "fp8": 0.15, "int4": 0.4}


class _HandWrittenExperts(nn.Module):
    """Experts with fused [E, 2I, H] weights whose forward is written out by hand.

    ``act_fn`` says SiLU, which is what :func:`expert_activation` reads; ``up_first`` and
    ``compute`` make the module compute something else, as a mis-specified family would.
    """

    def __init__(self, like: nn.Module, *, up_first: bool = False, compute=F.silu) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(like.gate_up_proj.detach().clone())
        self.down_proj = nn.Parameter(like.down_proj.detach().clone())
        self.num_experts = like.gate_up_proj.shape[0]
        self.act_fn = nn.SiLU()
        self.up_first = up_first
        self.compute = compute

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                a, b = F.linear(x[t], self.gate_up_proj[e]).chunk(2)
                gate, up = (b, a) if self.up_first else (a, b)
                out[t] += w[t, j] * F.linear(self.compute(gate) * up, self.down_proj[e])
        return out


def _install(model, **kw) -> nn.Module:
    mlp = model.model.layers[1].mlp
    mlp.experts = _HandWrittenExperts(mlp.experts, **kw)
    return mlp.experts


def test_hand_written_swiglu_passes_and_is_reported(fresh) -> None:
    model = fresh("qwen3_moe")
    ref = fresh("qwen3_moe")
    _install(model)
    report = wrap(model, weight_dtype="fp32")
    assert [c.experts for c in report.self_checks] == list(report.wrapped_blocks)
    assert all(c.relative_error <= c.tolerance == 1e-4 for c in report.self_checks)
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "how",
    [{"up_first": True}, {"compute": lambda g: F.gelu(g, approximate="tanh")}],
    ids=["swapped_gate_up", "wrong_activation"],
)
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16", "bf16-packed", "int8", "fp8", "int4"])
def test_mis_specified_experts_are_refused(fresh, how, weight_dtype: str) -> None:
    model = fresh("qwen3_moe")
    bad = _install(model, **how)
    with pytest.raises(SelfCheckError, match=r"model\.layers\.1\.mlp\.experts .*relative"):
        wrap(model, weight_dtype=weight_dtype)
    # The refused block keeps its original module and weights.
    assert model.model.layers[1].mlp.experts is bad
    assert not isinstance(model.model.layers[1].mlp.experts, KernelExperts)


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8", "int4"])
def test_quantised_base_is_checked_through_a_dense_twin(fresh, weight_dtype: str) -> None:
    model = fresh("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    report = wrap(model, weight_dtype=weight_dtype)
    for c in report.self_checks:
        # The spec is checked at the compute dtype's tolerance, the rounding at the format's.
        fmt = model.get_submodule(c.experts).expert_weights.format
        assert c.relative_error <= c.tolerance == 3e-2  # the bf16 twin's
        assert fmt.self_check_tolerance == FORMAT_TOLERANCE[weight_dtype]
        assert 0 < c.quantization_error <= fmt.self_check_tolerance
    # A quantised kernel built from other weights than the ones it is checked against (a
    # broken quantisation path) is refused by the second comparison.
    spec = model.model.layers[0].mlp.experts.spec
    wrong = kt_kernel.ExpertWeights.from_fused(spec, gate_up, -down, weight_dtype=weight_dtype)
    kernel = KernelExperts(
        wrong,
        gate_up_like=gate_up,
        down_like=down,
        gate_up_name="gate_up_proj",
        down_name="down_proj",
        label="x",
    )
    with pytest.raises(SelfCheckError, match=rf"the {weight_dtype} kernel differs from a dense"):
        self_check("x", experts, kernel, weight_dtype, gate_up=gate_up, down=down)


def test_self_check_off_only_when_asked(fresh) -> None:
    model = fresh("qwen3_moe")
    _install(model, up_first=True)
    report = wrap(model, weight_dtype="fp32", self_check=False)
    assert report.self_checks == ()
    assert isinstance(model.model.layers[1].mlp.experts, KernelExperts)


def test_activation_is_read_from_the_experts_module(fresh) -> None:
    model = fresh("mixtral")
    ref = fresh("mixtral")
    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.experts.act_fn = GELUTanh()  # config.hidden_act still says "silu"
    assert model.config.hidden_act == "silu"
    experts = model.model.layers[0].mlp.experts
    assert expert_activation(experts, "x") == kt_kernel.GeluTanhGated()
    wrap(model, weight_dtype="fp32")
    assert model.model.layers[0].mlp.experts.spec.activation == kt_kernel.GeluTanhGated()
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_unknown_activation_is_refused_by_name(fresh) -> None:
    model = fresh("olmoe")
    model.model.layers[0].mlp.experts.act_fn = nn.ReLU()
    with pytest.raises(
        WrapError,
        match=r"model\.layers\.0\.mlp\.experts \(OlmoeExperts\) has "
        r"act_fn=ReLU\(\)",
    ):
        wrap(model)


def test_clamp_attribute_selects_the_clamped_activation(fresh) -> None:
    experts = fresh("qwen3_moe").model.layers[0].mlp.experts
    experts.swiglu_limit = 7.0
    assert expert_activation(experts, "x") == kt_kernel.SwiGLULimit(limit=7.0)
    experts.swiglu_alpha = 1.702
    assert expert_activation(experts, "x") == kt_kernel.ClampedSwiGLU(alpha=1.702, limit=7.0)
    experts.is_transposed = True
    with pytest.raises(WrapError, match="is_transposed=True"):
        expert_activation(experts, "x")


def test_activations_come_from_kt_kernels_registry(fresh) -> None:
    # moe-experts names no activation: a class registered in kt_kernel.ACTIVATIONS is what a
    # module's act_fn maps to (the registry's gate_act_names are transformers' ACT2FN names).
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class ReluGated(kt_kernel.SwiGLU):
        name: ClassVar[str] = "relu_gated"
        native_id: ClassVar[int] = 99  # no native loop: the mapping only is checked here
        gate_act_names: ClassVar[tuple[str, ...]] = ("relu",)

    experts = fresh("olmoe").model.layers[0].mlp.experts
    experts.act_fn = nn.ReLU()
    with pytest.raises(WrapError, match=r"act_fn=ReLU\(\).*kt_kernel\.ACTIVATIONS only: swiglu"):
        expert_activation(experts, "x")
    kt_kernel.register_activation(ReluGated)
    try:
        assert expert_activation(experts, "x") == ReluGated()
    finally:
        del kt_kernel.ACTIVATIONS["relu_gated"]
