"""What the experts module computes, read from the module, and proof that the kernel agrees.

:func:`expert_activation` maps a transformers experts module to a kt-kernel activation from
the module's own ``act_fn`` and clamp attributes (never from a config key name, which families
spell differently). :func:`self_check` then runs the original module and the kernel on the same
small random batch before :func:`moe_experts.wrap` frees the original weights, so a wrong
activation, clamp, layout or bias fails loudly instead of training a different model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

import kt_kernel
from moe_experts.architectures import MoEArchitecture
from moe_experts.errors import SelfCheckError, WrapError
from moe_experts.kernel_experts import KernelExperts

__all__ = [
    "BlockCheck",
    "expert_activation",
    "self_check",
]

# The tolerances live on the formats (kt_kernel.WeightFormat.self_check_tolerance). A
# quantised base is checked in two steps, because its rounding (int4: ~0.2 relative on the
# check batch) would hide a wrong activation: a dense twin of the batch's experts against the
# original (the spec, at the dense compute dtype's tolerance), then the quantised kernel
# against that twin (the format's rounding only; a broken quantisation path errs by order one).
_POOL = 4  # experts the check batch routes to (a dense twin of only these is built)
# How transformers' experts modules spell the parameters of a clamped activation (the names in
# kt_kernel.ACTIVATIONS' param_names), as attributes.
_PARAM_ATTRS: dict[str, tuple[str, ...]] = {
    "limit": ("limit", "swiglu_limit"),
    "alpha": ("alpha", "swiglu_alpha"),
}
_CLAMP_ATTRS = _PARAM_ATTRS["limit"]
_TOKENS = 8


@dataclass(frozen=True)
class BlockCheck:
    """One MoE block's wrap-time comparison of the kernel with the original experts module.

    Attributes:
        experts: fully-qualified experts module name.
        max_abs_error: ``max |kernel - original|`` over the check batch.
        relative_error: ``max_abs_error / max |original|``.
        tolerance: the accepted ``relative_error``: the storage format's
            ``self_check_tolerance`` (the dense compute dtype's for a quantised base).
        quantization_error: for a quantised base, ``max |kernel - dense twin| / max |twin|``
            (the format's rounding, checked against its ``self_check_tolerance``); the fields
            above then compare the dense twin with the original. ``None`` for dense storage.
    """

    experts: str
    max_abs_error: float
    relative_error: float
    tolerance: float
    quantization_error: float | None = None


def _attr(module: nn.Module, names: tuple[str, ...]) -> tuple[str, float] | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return name, float(value)
    return None


def _act_names(act: object) -> set[str]:
    """The names of ``act`` in transformers' ``ACT2FN`` vocabulary (``"silu"``, ...).

    Every ``ACT2CLS`` entry whose class ``act`` is an instance of, plus torch's own spellings
    of two of them, which transformers' experts modules also hold.
    """
    from transformers.activations import ACT2CLS

    names = set()
    for name, entry in ACT2CLS.items():
        cls = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cls, type) and isinstance(act, cls):
            names.add(name)
    if act is F.silu:
        names.add("silu")
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        names.add("gelu_pytorch_tanh")
    return names


def _custom_gate(experts: nn.Module) -> bool:
    """True when the class overrides transformers' default ``act_fn(gate) * up`` gate."""
    from transformers.integrations.moe import _default_apply_gate

    gate = getattr(type(experts), "_apply_gate", None)
    return gate is not None and gate is not _default_apply_gate


# Layout flags that transformers' ``use_experts_implementation`` sets on an experts module:
# what each means, and the value it must have for a family's spec (its layout fields).
_LAYOUT_FLAGS: dict[str, tuple[str, Callable[[MoEArchitecture | None], bool]]] = {
    "is_transposed": (
        "experts stored transposed ([E, H, 2I])",
        lambda a: a is not None and a.transposed,
    ),
    "is_concatenated": (
        "gate and up concatenated, not interleaved",
        lambda a: a is None or not a.interleaved,
    ),
    "has_bias": ("expert biases", lambda a: a is not None and bool(a.bias_params)),
    "has_gate": ("a gate projection (gated experts)", lambda a: True),
    "has_post_expert_norm": ("a norm after each expert", lambda a: False),
}


def _check_layout(experts: nn.Module, label: str, arch: MoEArchitecture | None) -> None:
    for flag, (what, needed_for) in _LAYOUT_FLAGS.items():
        needed = needed_for(arch)
        value = getattr(experts, flag, needed)
        if value != needed:
            family = arch.family if arch is not None else "the default layout"
            raise WrapError(
                f"{label} ({type(experts).__name__}) has {flag}={value} ({what}: {value}), but "
                f"the spec of {family} says {needed}; kt-kernel computes the layout the "
                "MoEArchitecture declares (transposed, interleaved, bias params), so fix the "
                "family's row in moe_experts.ARCHITECTURES"
            )


def expert_activation(
    experts: nn.Module, label: str, arch: MoEArchitecture | None = None
) -> kt_kernel.Activation:
    """The kt-kernel activation that ``experts`` computes, read from the module itself.

    Read from :data:`kt_kernel.ACTIVATIONS` only. A module with its own ``_apply_gate``
    (transformers' hook for clamped gates) or a clamp attribute maps to the activation with
    parameters whose every parameter the module has, the most of them winning
    (``limit``/``swiglu_limit`` -> :class:`kt_kernel.SwiGLULimit`; with ``alpha``/
    ``swiglu_alpha`` too -> :class:`kt_kernel.ClampedSwiGLU`); otherwise ``act_fn`` decides,
    through the activations' ``gate_act_names`` (SiLU -> :class:`kt_kernel.SwiGLU`, tanh-GELU ->
    :class:`kt_kernel.GeluTanhGated`). :func:`self_check` then proves the choice on real
    numbers.

    Args:
        experts: the transformers experts module (unwrapped from PEFT).
        label: its qualified name, for messages.
        arch: the family's spec; the module's layout flags (``is_transposed``,
            ``is_concatenated``, ``has_bias``) must match its layout fields. ``None``: the
            default layout ``[E, 2I, H]`` / ``[E, H, I]`` without biases.

    Returns:
        The activation object for :class:`kt_kernel.ExpertSpec`.

    Raises:
        WrapError: an activation kt-kernel does not implement (names the module and its
            ``act_fn``), or layout flags the spec does not declare.
    """
    kind = type(experts).__name__
    _check_layout(experts, label, arch)
    clamp = _attr(experts, _CLAMP_ATTRS)
    if _custom_gate(experts) or clamp is not None:
        found = {p: _attr(experts, attrs) for p, attrs in _PARAM_ATTRS.items()}
        have = {p: v[1] for p, v in found.items() if v is not None}
        if clamp is None or not math.isfinite(clamp[1]) or clamp[1] <= 0:
            raise WrapError(
                f"{label} ({kind}) computes its own gate (_apply_gate) without a finite "
                f"{'/'.join(_CLAMP_ATTRS)} attribute; kt-kernel cannot tell which activation "
                "that is. Add the family to moe_experts.UNSUPPORTED_FAMILIES or teach "
                "moe_experts.self_check.expert_activation its formula"
            )
        fits = [
            c
            for c in kt_kernel.ACTIVATIONS.values()
            if c.param_names and set(c.param_names) <= set(have)
        ]
        cls = max(fits, key=lambda c: len(c.param_names))
        return cls(**{p: have[p] for p in cls.param_names})  # type: ignore[return-value]
    act = getattr(experts, "act_fn", None)
    names = _act_names(act)
    for cls in kt_kernel.ACTIVATIONS.values():
        if not cls.param_names and names & set(cls.gate_act_names):
            return cls()  # type: ignore[return-value]
    known = ", ".join(
        f"{c.name} ({'/'.join(c.gate_act_names) or '+'.join(c.param_names)})"
        for c in kt_kernel.ACTIVATIONS.values()
    )
    raise WrapError(
        f"{label} ({kind}) has act_fn={act!r}; kt-kernel computes gated experts with the "
        f"activations of kt_kernel.ACTIVATIONS only: {known}"
    )


def _rows(bias: torch.Tensor | None, pool: torch.Tensor) -> torch.Tensor | None:
    return None if bias is None else bias[pool.to(bias.device)]


def _relative(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    err = (got.float() - want.float()).abs().max().item()
    return err, err / max(want.float().abs().max().item(), 1e-12)


def self_check(
    label: str,
    original: nn.Module,
    kernel: KernelExperts,
    weight_dtype: str | None = None,
    *,
    gate_up: torch.Tensor | None = None,
    down: torch.Tensor | None = None,
    seed: int = 0,
) -> BlockCheck:
    """Run ``original`` and ``kernel`` on the same random batch; refuse a disagreement.

    Args:
        label: the experts module's qualified name.
        original: the transformers experts module, weights still in place.
        kernel: the :class:`~moe_experts.KernelExperts` built from those weights (no LoRA).
        weight_dtype: the storage's name in messages; default: the kernel format's
            ``weight_dtype``. The tolerances are the format's ``self_check_tolerance``.
        gate_up: ``[E, 2I, H]`` tensor the kernel was built from, in kt-kernel's layout (gate
            rows first; see :meth:`MoEArchitecture.kernel_gate_up`); with ``down``, a quantised
            kernel is checked through a dense twin of the batch's experts (the twin against
            the original at the dense compute dtype's tolerance, the kernel against the twin
            at the format's). Without them, against the original directly.
        down: ``[E, H, I]`` tensor the kernel was built from (kt-kernel's layout).
        seed: seed of the check batch (8 tokens, top-2 of ``min(E, 4)`` experts).

    Returns:
        The :class:`BlockCheck` measured.

    Raises:
        SelfCheckError: an error exceeds its tolerance; names the block, the error, the
            tolerance and which comparison failed.
    """
    spec = kernel.spec
    weights = kernel.expert_weights
    ref = next(p for p in original.parameters() if p.dim() == 3)
    gen = torch.Generator().manual_seed(seed)
    e, h = spec.num_experts, spec.hidden_size
    pool = torch.randperm(e, generator=gen)[: min(e, _POOL)]
    k = min(len(pool), 2)
    local = torch.stack([torch.randperm(len(pool), generator=gen)[:k] for _ in range(_TOKENS)])
    ids = pool[local]
    x = torch.randn(_TOKENS, h, generator=gen)
    w = torch.softmax(torch.randn(_TOKENS, k, generator=gen), dim=-1)
    compute = weights.dtype
    fmt = weights.format
    weight_dtype = weight_dtype or fmt.weight_dtype
    dense_tol = kt_kernel.Dense(compute).self_check_tolerance
    xd, wd = x.to(ref.dtype), w.to(ref.dtype)
    with torch.no_grad():
        dev = ref.device
        want = original(xd.to(dev), ids.to(dev), wd.to(dev)).detach().float().cpu()
        got = kernel(xd, ids, wd).float()
        twin = None
        if weights.is_quantized and gate_up is not None and down is not None:
            dense = kt_kernel.ExpertWeights.from_fused(
                replace(spec, num_experts=len(pool)),
                gate_up[pool.to(gate_up.device)],
                down[pool.to(down.device)],
                dtype=compute,
                # The kernel's own (frozen, compute-dtype) biases: the twin isolates the format.
                gate_up_bias=_rows(weights.gate_up_bias, pool),
                down_bias=_rows(weights.down_bias, pool),
            )
            twin = kt_kernel.moe_experts_forward(xd.to(compute), local, wd.to(compute), dense)
            twin = twin.float()
    if twin is None:
        err, rel = _relative(got, want)
        tol = fmt.self_check_tolerance
        quant = None
    else:
        err, rel = _relative(twin, want)
        tol = dense_tol
        quant = _relative(got, twin)[1]
    check = BlockCheck(
        experts=label,
        max_abs_error=err,
        relative_error=rel,
        tolerance=tol,
        quantization_error=quant,
    )
    if not rel <= tol:  # also refuses NaN
        raise SelfCheckError(
            f"wrap self-check failed for {label} ({type(original).__name__}): kt-kernel "
            f"({spec.activation}, {'dense twin of ' if twin is not None else ''}{weight_dtype}) "
            f"differs from the original experts module by max abs {err:.3e}, relative "
            f"{rel:.3e} > tolerance {tol:.1e}. The family's spec (gate/up order, activation, "
            "clamp, biases, layout) does not match what the module computes; fix its "
            "MoEArchitecture, or pass self_check=False to wrap only if you have verified the "
            "model another way"
        )
    qtol = fmt.self_check_tolerance
    if quant is not None and not quant <= qtol:
        raise SelfCheckError(
            f"wrap self-check failed for {label}: the {weight_dtype} kernel differs from a dense "
            f"kernel on the same weights by relative {quant:.3e} > {qtol:.1e}, more than the "
            f"format's rounding; the quantised storage of this block is wrong (report it with "
            f"the model's config), or use weight_dtype='bf16'"
        )
    return check
