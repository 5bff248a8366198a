"""Every weight format x every activation x {bias, no bias}: native op against the oracle.

The format list is every name registered in ``kk.FORMATS`` (dense fp32 and bf16 included), at
each compute dtype its factory offers, so a format registered by another module joins this
suite by being registered. The oracle is the
reference implementation on the format's dequantised weights: in fp32 within 1e-5
(max-norm relative); in bf16 against the float64 reference on exactly the bf16 values the
kernel holds, within the bf16 bound of test_native_vs_reference (3e-2, and at most twice the
bf16 reference's own error + 2e-3, on the median of three draws where the
first trips it).
"""

from __future__ import annotations

import pytest
import torch

import kt_kernel as kk

FP32_TOL = 1e-5
BF16_TOL = 3e-2
FORMATS = list(kk.FORMATS)
FP32_FORMATS = [n for n, f in kk.FORMATS.items() if torch.float32 in f.compute_dtypes]
BF16_FORMATS = [n for n, f in kk.FORMATS.items() if torch.bfloat16 in f.compute_dtypes]
ACTIVATIONS = list(kk.ACTIVATIONS)
# H and I are multiples of 128 so block- and group-quantised formats (FP8 128x128 blocks,
# INT4 groups) tile them exactly.
E, H, I, T, K, R = 6, 128, 128, 24, 2, 4  # noqa: E741 (I: the intermediate size)


def _pre_activations(weights: kk.ExpertWeights, lora: kk.LoraBuffers, x, ids) -> torch.Tensor:
    """gate_up pre-activations of every routed (token, slot) pair, in float64."""
    rows = []
    f = {n: t.detach().double() for n, t in lora.named_lora_parameters()}
    for e in range(E):
        tok, _ = torch.where(ids == e)
        xe = x[tok].double()
        gu = xe @ weights.expert_gate_up(e).double().t()
        if weights.gate_up_bias is not None:
            gu = gu + weights.gate_up_bias[e].double()
        a = torch.cat([f["gate_lora_a"][e], f["up_lora_a"][e]], 0)
        b = torch.block_diag(f["gate_lora_b"][e], f["up_lora_b"][e])
        rows.append(gu + lora.scaling * (xe @ a.t()) @ b.t())
    return torch.cat(rows)


def _gap_limit(pre: torch.Tensor) -> float:
    """A clamp limit in the widest gap among the largest 10% of |pre-activation| values.

    The derivative of a clamp jumps at the limit, so a value within rounding of it could
    land on either side in two correct implementations; in a wide gap of the upper tail no
    value is near it, and the values above it are really clamped.
    """
    inter = pre.shape[1] // 2
    vals = torch.cat([pre[:, :inter].flatten(), pre[:, inter:].abs().flatten()]).sort().values
    tail = vals[int(0.9 * len(vals)) :]
    gaps = tail[1:] - tail[:-1]
    j = int(gaps.argmax())
    return float((tail[j] + tail[j + 1]) / 2)


def _activation(name: str, limit: float) -> kk.Activation:
    # Every parameter is a clamp limit but alpha (GPT-OSS's sigmoid slope).
    cls = kk.ACTIVATIONS[name]
    return cls(**{p: 1.702 if p == "alpha" else limit for p in cls.param_names})


def build(kt, fmt: str, act: str, bias: bool, dtype: torch.dtype, seed: int = 0):
    """A problem on format ``fmt`` with activation ``act`` (clamps exercised, see _gap_limit)."""
    gen = torch.Generator().manual_seed(seed)
    spec0 = kk.ExpertSpec(E, H, I)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    down = torch.randn(E, H, I, generator=gen) / I**0.5
    gu_b = 0.5 * torch.randn(E, 2 * I, generator=gen) if bias else None
    dn_b = 0.1 * torch.randn(E, H, generator=gen) if bias else None
    w0 = kk.ExpertWeights.from_fused(
        spec0,
        gate_up,
        down,
        dtype=dtype,
        weight_dtype=fmt,
        gate_up_bias=gu_b,
        down_bias=dn_b,
    )
    lora0 = kk.LoraBuffers(spec0, R, 2.0 * R, "split")
    with torch.no_grad():
        for _, p in lora0.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = kt.random_ids(T, K, E, gen)
    w = torch.rand(ids.shape, generator=gen)
    dy = torch.randn(T, H, generator=gen).to(dtype)
    pre = _pre_activations(w0, lora0, x, ids)
    limit = _gap_limit(pre)
    spec = kk.ExpertSpec(E, H, I, activation=_activation(act, limit))
    weights = kk.ExpertWeights.from_parts(
        spec, w0.format, *w0.storage, gate_up_bias=w0.gate_up_bias, down_bias=w0.down_bias
    )
    lora = kk.LoraBuffers.from_tensors(spec, R, 2.0 * R, "split", dict(lora0.named_parameters()))
    if "limit" in kk.ACTIVATIONS[act].param_names:
        inter = pre.shape[1] // 2
        clamped = int((pre[:, :inter] > limit).sum() + (pre[:, inter:].abs() > limit).sum())
        assert clamped > 0  # the clamp is really exercised
    return kt.Problem(spec, weights, lora, x, ids, w, dy)


def _oracle64(kt, p):
    """The same problem in float64 on exactly the values the bf16 kernel holds."""
    deq = p.weights.dequantized()
    w64 = kk.ExpertWeights.from_fused(
        p.spec,
        deq.gate_up,
        deq.down,
        dtype=torch.float64,
        gate_up_bias=deq.gate_up_bias,
        down_bias=deq.down_bias,
    )
    lora64 = kk.LoraBuffers(p.spec, R, 2.0 * R, "split", dtype=torch.float64)
    with torch.no_grad():
        for (_, a), (_, b) in zip(
            lora64.named_parameters(), p.lora.named_parameters(), strict=True
        ):
            a.copy_(b.to(p.weights.dtype))
    return kt.Problem(p.spec, w64, lora64, p.x.double(), p.ids, p.w, p.dy.double())


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FP32_FORMATS)
def test_fp32_matches_reference_on_dequantized(kt, fmt: str, act: str, bias: bool) -> None:
    p = build(kt, fmt, act, bias, torch.float32)
    oracle = kt.Problem(p.spec, p.weights.dequantized(), p.lora, p.x, p.ids, p.w, p.dy)
    ref = kt.run(oracle, "reference")
    for policy in ("save", "recompute"):
        nat = kt.run(p, "native", policy)
        assert ref.keys() == nat.keys()
        for name in ref:
            assert kt.rel_err(nat[name], ref[name]) < FP32_TOL, (policy, name)
    # The reference reads the format itself (one expert dequantised at a time) identically.
    direct = kt.run(p, "reference")
    for name in ref:
        assert torch.equal(direct[name], ref[name]), name


def _bf16_errors(kt, fmt: str, act: str, bias: bool, seed: int) -> dict[str, tuple[float, float]]:
    """Per output: (native's, bf16 reference's) error against the float64 oracle, one draw."""
    p = build(kt, fmt, act, bias, torch.bfloat16, seed=seed)
    oracle = kt.run(_oracle64(kt, p), "reference")
    ref = kt.run(p, "reference")
    nat = kt.run(p, "native")
    assert nat["y"].dtype == torch.bfloat16
    return {n: (kt.rel_err(nat[n], oracle[n]), kt.rel_err(ref[n], oracle[n])) for n in oracle}


# The ratio of two bf16 errors is heavy-tailed across draws: over 12 seeds the native/reference
# ratio of down_lora_a ranged 0.57-2.52 (dense bf16, swiglu) and 0.59-2.45 (mxfp4,
# clamped_swiglu), medians 0.85-1.0, with the native result bitwise the dense bf16 kernel's on
# the same weights. So a draw that trips the relative bound is judged on the median of three.
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_bf16_within_bound_of_fp64_oracle(kt, fmt: str, act: str, bias: bool) -> None:
    draws = [_bf16_errors(kt, fmt, act, bias, seed=0)]
    for name, (e_nat, _) in draws[0].items():
        assert e_nat < BF16_TOL, (name, e_nat)
    if all(e_nat < 2 * e_ref + 2e-3 for e_nat, e_ref in draws[0].values()):
        return
    draws += [_bf16_errors(kt, fmt, act, bias, seed=s) for s in (1, 2)]
    for name in draws[0]:
        assert max(d[name][0] for d in draws) < BF16_TOL, name
        e_nat = sorted(d[name][0] for d in draws)[1]
        e_ref = sorted(d[name][1] for d in draws)[1]
        assert e_nat < 2 * e_ref + 2e-3, (name, e_nat, e_ref)


@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_bitwise_across_thread_counts(kt, fmt: str) -> None:
    p = build(kt, fmt, "clamped_swiglu", True, torch.bfloat16, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kt.run(p, "native")
        torch.set_num_threads(2)
        two = kt.run(p, "native")
    finally:
        torch.set_num_threads(before)
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_biases_are_frozen_copies_and_counted() -> None:
    spec = kk.ExpertSpec(2, 4, 3)
    gu_b, dn_b = torch.randn(2, 6), torch.randn(2, 4)
    w = kk.ExpertWeights.from_fused(
        spec, torch.randn(2, 6, 4), torch.randn(2, 4, 3), gate_up_bias=gu_b, down_bias=dn_b
    )
    gu_b.zero_()
    assert w.gate_up_bias.abs().sum() > 0
    assert w.nbytes == (2 * 6 * 4 + 2 * 4 * 3 + 12 + 8) * 4
    with pytest.raises(kk.KernelInputError, match=r"down_bias must have shape \[2, 4\]"):
        kk.ExpertWeights.from_fused(
            spec, torch.randn(2, 6, 4), torch.randn(2, 4, 3), down_bias=torch.zeros(2, 3)
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_satisfies_the_protocol(fmt: str) -> None:
    factory = kk.FORMATS[fmt]
    assert isinstance(factory, kk.FormatFactory)
    for dtype in factory.compute_dtypes:
        built = factory(dtype)
        assert built.compute_dtype == dtype
        assert built.weight_dtype == fmt  # one spelling: the format reports its registry name
        assert built.lossy == factory.lossy
        assert built == factory(dtype)
    f = factory(factory.compute_dtypes[0])  # fp32 where the format computes in it
    assert isinstance(f, kk.WeightFormat)
    # Weights as the storage's dtype holds them exactly (dense bf16 is exact on bf16 values).
    w = torch.randn(3, 256, 128).to(f.compute_dtype).float()
    parts = f.quantize(w)
    specs = f.part_specs(256, 128)
    assert [(tuple(p.shape), p.dtype) for p in parts] == [((3, *s), d) for _, s, d in specs]
    deq = f.dequantize(parts, torch.float32)
    assert deq.shape == w.shape
    assert f.dequantize(parts).dtype == f.compute_dtype
    # Per-expert slices dequantise to the bank's rows; nbytes counts every part.
    assert torch.equal(f.dequantize(f.expert(parts, 1), torch.float32), deq[1])
    assert f.nbytes(parts) == sum(p.nbytes for p in parts)
    steps = f.row_steps(parts)
    assert steps.shape == (3, 256)
    # Each element is within half a step of the original (0 for dense: exact).
    assert bool(((deq - w).abs() <= steps.unsqueeze(-1) / 2 + 1e-6).all())
    torch.ops.kt_kernel.formats()  # the native registry loads
    assert f.name in torch.ops.kt_kernel.formats()


def test_registry_rejects_a_second_factory_and_unknown_shorthands() -> None:
    with pytest.raises(kk.KernelInputError, match="already registered"):
        kk.register_format("int8", kk.Dense)
    spec = kk.ExpertSpec(2, 4, 3)
    with pytest.raises(kk.KernelDTypeError, match=r"weight_dtype must be one of"):
        kk.ExpertWeights.from_fused(
            spec, torch.zeros(2, 6, 4), torch.zeros(2, 4, 3), weight_dtype="int9"
        )
    w = kk.ExpertWeights.from_fused(
        spec, torch.randn(2, 6, 4), torch.randn(2, 4, 3), weight_dtype=kk.Int8PerChannel()
    )
    assert w.format == kk.Int8PerChannel(torch.bfloat16)
    assert w.weight_dtype == "int8"
    assert w.dtype == torch.bfloat16


def test_auto_resolves_from_the_checkpoint_and_old_spellings_warn() -> None:
    # Dense storage of the checkpoint's own dtype; bf16 for any other float (fp16: no fp16
    # kernel), repacked (the same values) where the CPU runs bf16-packed's own products; a
    # quantization_config picks the format that ships it.
    info = kk.backend_info()
    packed_here = info.isa == "avx512" and "avx512bf16" in info.cpu_features
    assert kk.Bf16Packed.own_products_here() == packed_here
    assert not kk.FORMATS["bf16"].own_products_here()
    bf16 = "bf16-packed" if packed_here else "bf16"
    assert kk.auto_format(torch.float32) == "fp32"
    assert kk.auto_format(torch.bfloat16) == bf16
    assert kk.auto_format(torch.float16) == bf16
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert kk.auto_format(torch.bfloat16, fp8) == "fp8"
    with pytest.raises(kk.KernelDTypeError, match=r"quant_method='awq'"):
        kk.auto_format(torch.bfloat16, {"quant_method": "awq"})
    for old, new in kk.FORMAT_ALIASES.items():
        with pytest.warns(FutureWarning, match=rf"'{old}' is deprecated; use '{new}'"):
            assert kk.format_name(old) == new
    with pytest.warns(FutureWarning):
        w = kk.ExpertWeights.from_fused(
            kk.ExpertSpec(2, 4, 3),
            torch.randn(2, 6, 4),
            torch.randn(2, 4, 3),
            weight_dtype="bfloat16",
        )
    assert w.weight_dtype == "bf16"
    assert w.format == kk.Dense(torch.bfloat16)
    with pytest.raises(kk.KernelInputError, match="reserved"):
        kk.register_format("auto", kk.Int8PerChannel)


def test_a_new_format_needs_only_its_class_and_registration() -> None:
    # What moe-experts reads of a format is the factory's attributes and the instance's
    # protocol: a subclass registered under a new name is usable by name at once.
    class Int8Again(kk.Int8PerChannel):
        weight_dtype = "int8_again"
        self_check_tolerance = 6e-2

    kk.register_format("int8_again", Int8Again)
    try:
        assert kk.format_name("int8_again") == "int8_again"
        w = kk.ExpertWeights.from_fused(
            kk.ExpertSpec(2, 4, 3),
            torch.randn(2, 6, 4),
            torch.randn(2, 4, 3),
            weight_dtype="int8_again",
        )
        assert isinstance(w.format, Int8Again)
        assert w.weight_dtype == "int8_again"
        assert w.is_quantized
        assert w.format.self_check_tolerance == 6e-2
    finally:
        del kk.FORMATS["int8_again"]


def test_activation_registry_matches_the_native_loops() -> None:
    # The op dispatches on native_id: each row's id must name its own loop in the extension.
    native = list(torch.ops.kt_kernel.activations())
    assert sorted(c.native_id for c in kk.ACTIVATIONS.values()) == list(range(len(native)))
    for name, cls in kk.ACTIVATIONS.items():
        assert cls.name == name
        assert native[cls.native_id] == name
        assert isinstance(cls(), kk.ActivationClass)
        assert len(cls().params()) == len(cls.param_names)

    class Twin(kk.SwiGLU):
        name = "swiglu_twin"

    with pytest.raises(kk.KernelInputError, match=r"native_id 0\) collides with SwiGLU"):
        kk.register_activation(Twin)
    assert "swiglu_twin" not in kk.ACTIVATIONS
