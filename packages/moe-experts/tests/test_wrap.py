"""wrap(): experts on kt-kernel, placeholders in the tree, logits equal to transformers."""

import pytest
import torch

from moe_experts import (
    KernelExperts,
    WrapError,
    experts_sites,
    is_placeholder,
    named_placeholders,
    wrap,
)

from .conftest import FAMILIES, token_batch


@pytest.mark.parametrize("family", FAMILIES)
def test_wrapped_logits_equal_transformers_fp32(fresh, family: str) -> None:
    ref_model = fresh(family)
    model = fresh(family)
    expert_bytes = {n: p.nbytes for n, p in model.named_parameters() if ".experts." in n}
    names_before = [n for n, _ in model.named_parameters()]
    ids = token_batch()
    with torch.no_grad():
        ref = ref_model(ids).logits
    report = wrap(model, weight_dtype="fp32")
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Names and logical shapes are unchanged; every expert weight is now a placeholder.
    assert [n for n, _ in model.named_parameters()] == names_before
    assert sorted(report.placeholders) == sorted(expert_bytes)
    assert report.bytes_moved == sum(expert_bytes.values())
    assert report.kernel_bytes == report.bytes_moved
    assert all(is_placeholder(p) for _, p in named_placeholders(model))
    assert all(
        isinstance(m, KernelExperts) for n, m in model.named_modules() if n.endswith(".experts")
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_wrapped_logits_bf16_within_bf16_tolerance(fresh, family: str) -> None:
    ref_model = fresh(family)
    model = fresh(family)
    ids = token_batch()
    report = wrap(model, weight_dtype="bf16")
    assert report.kernel_bytes * 2 == report.bytes_moved
    with torch.no_grad():
        ref = ref_model(ids).logits
        out = model(ids).logits
    rel = (out - ref).abs().max() / ref.abs().max()
    assert rel < 2e-2, f"bf16 experts drifted by {rel:.3e} relative"
    assert rel > 0  # bf16 storage really happened


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_packed_experts_equal_bf16_experts(fresh, family: str) -> None:
    """kt-kernel's repacked bf16 layout holds the same values as bf16, in every family's shapes.

    Only the order of the fp32 sums in the expert products differs (bf16's own distance from
    transformers is test_wrapped_logits_bf16_within_bf16_tolerance's); the storage is the
    bf16 bytes plus the layout's padding.
    """
    dense, packed = fresh(family), fresh(family)
    ids = token_batch()
    rep_dense = wrap(dense, weight_dtype="bf16")
    rep_packed = wrap(packed, weight_dtype="bf16-packed")
    assert rep_packed.weight_dtype == "bf16-packed"
    assert rep_dense.kernel_bytes <= rep_packed.kernel_bytes
    assert all(k.expert_weights.format.name == "bf16_packed" for _, k in experts_sites(packed))
    with torch.no_grad():
        out_dense, out_packed = dense(ids).logits, packed(ids).logits
    assert (out_packed - out_dense).abs().max() / out_dense.abs().max() < 2e-2


def test_wrap_is_idempotent(fresh) -> None:
    model = fresh("mixtral")
    first = wrap(model, weight_dtype="fp32")
    second = wrap(model, weight_dtype="fp32")
    assert second.wrapped_blocks == ()
    assert second.already_wrapped == first.wrapped_blocks
    assert second.bytes_moved == 0
    assert second.placeholders == first.placeholders


def test_wrap_rejects_bad_arguments(fresh) -> None:
    model = fresh("olmoe")
    with pytest.raises(WrapError, match="weight_dtype"):
        wrap(model, weight_dtype="fp16")  # type: ignore[arg-type]
    # The activation is read from the experts module, not from a config key.
    model.config.hidden_act = "gelu"
    assert wrap(model, weight_dtype="fp32").wrapped_blocks


def test_state_dict_keeps_expert_keys(fresh) -> None:
    model = fresh("qwen2_moe")
    keys = list(model.state_dict())
    wrap(model)
    sd = model.state_dict()
    assert list(sd) == keys
    assert is_placeholder(sd["model.layers.0.mlp.experts.gate_up_proj"])


def test_deepcopy_of_wrapped_model_is_independent(fresh) -> None:
    import copy

    model = fresh("qwen3_moe")
    wrap(model, weight_dtype="fp32")
    twin = copy.deepcopy(model)
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, rtol=0, atol=0)
    a = model.model.layers[0].mlp.experts
    b = twin.model.layers[0].mlp.experts
    assert a.expert_weights is not b.expert_weights
    assert is_placeholder(b.gate_up_proj)
