"""One-to-one conversion between kt-kernel's :class:`LoraBuffers` and PEFT's adapter tensors.

The stacking itself is lora-core's :class:`~lora_core.contracts.PeftTensorLayout` (the
contract lora-checkpoint writes ``adapter_model.safetensors`` with); this module applies it to
kt-kernel's buffers and names the keys.

Fused layout (PEFT ``target_parameters=["gate_up_proj", "down_proj"]`` on transformers 5.x
fused experts, ``peft.tuners.lora.layer.ParamWrapper``). transformers stores
``gate_up_proj [E, 2I, H]`` (``is_transposed=False``; the first I output rows are gate) and
``down_proj [E, H, I]``. PEFT makes ``lora_A = Linear(in, E*r)`` and ``lora_B = Linear(E*r, out)``
and builds the per-expert delta as::

    A = lora_A.weight.reshape(E, r, in)                    # row  e*r + j  of lora_A = A[e, j]
    B = lora_B.weight.reshape(out, r, E).permute(2, 0, 1)  # col  j*E + e  of lora_B = B[e, :, j]
    delta[e] = scaling * B[e] @ A[e]

so A is stacked expert-major but B is stacked **rank-major** (column ``j*E + e``):
``PeftTensorLayout.EXPERT_STACKED_A``/``_B``. The tests check it against a real PEFT model.

Transposed experts (GPT-OSS, ``is_transposed=True``: ``gate_up_proj [E, H, 2I]``,
``down_proj [E, I, H]``) give PEFT the same ``in``/``out`` without its swap, so the shapes and
stacking are identical; only the ``2I`` output rows of gate_up's B follow the stored column
order (gate/up interleaved for GPT-OSS). moe-experts keeps B in that order too, so these
functions apply unchanged, and :class:`~moe_experts.KernelExperts` reorders the rows for the
kernel (``MoEArchitecture.kernel_rows``).

Split layout (PEFT ``target_modules`` on per-expert ``nn.Linear`` experts): expert ``e``'s
``gate_proj``/``up_proj``/``down_proj`` adapters are ``lora_A [r, in]`` and ``lora_B [out, r]``,
i.e. ``gate_lora_a[e]`` and ``gate_lora_b[e]`` unchanged.

Keys are relative to the experts module, without the adapter name: fused
``gate_up_proj.lora_A.weight``; split ``{e}.gate_proj.lora_A.weight``. Where the keys sit in a
whole model's state dict (PEFT nests the two ParamWrappers, so one of them appears under
``experts.base_layer.``) is the caller's business.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kt_kernel import ExpertSpec, LoraBuffers, LoraLayout, lora_shapes
from lora_core.contracts import PeftTensorLayout, peft_lora_key
from moe_experts.errors import AdaptError

__all__ = [
    "copy_lora_from_peft",
    "lora_from_peft",
    "lora_to_peft",
    "peft_keys",
    "stack_lora_a",
    "stack_lora_b",
    "unstack_lora_a",
    "unstack_lora_b",
]

_SPLIT_PROJ = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
_FUSED_PROJ = (("gate_up_proj", "gate_up"), ("down_proj", "down"))


_A, _B = PeftTensorLayout.EXPERT_STACKED_A, PeftTensorLayout.EXPERT_STACKED_B


def stack_lora_a(a: torch.Tensor) -> torch.Tensor:
    """Per-expert ``A [E, r, in]`` -> PEFT ``lora_A.weight [E*r, in]`` (row ``e*r + j``)."""
    return _A.to_peft(a)


def stack_lora_b(b: torch.Tensor) -> torch.Tensor:
    """Per-expert ``B [E, out, r]`` -> PEFT ``lora_B.weight [out, r*E]`` (col ``j*E + e``)."""
    return _B.to_peft(b)


def unstack_lora_a(a: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT ``lora_A.weight [E*r, in]`` -> ``A [E, r, in]`` (a view)."""
    return _A.from_peft(a, num_experts)


def unstack_lora_b(b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT ``lora_B.weight [out, r*E]`` -> ``B [E, out, r]`` (a non-contiguous view)."""
    return _B.from_peft(b, num_experts)


def peft_keys(spec: ExpertSpec, layout: LoraLayout) -> tuple[str, ...]:
    """The relative PEFT keys :func:`lora_to_peft` produces for ``layout``, in a stable order."""
    if layout == "fused":
        return tuple(peft_lora_key(p, m) for p, _ in _FUSED_PROJ for m in ("A", "B"))
    if layout == "split":
        return tuple(
            peft_lora_key(f"{e}.{p}", m)
            for e in range(spec.num_experts)
            for p, _ in _SPLIT_PROJ
            for m in ("A", "B")
        )
    raise AdaptError(f"layout must be 'split' or 'fused', got {layout!r}")


def lora_to_peft(buffers: LoraBuffers) -> dict[str, torch.Tensor]:
    """Export ``buffers`` as PEFT tensors (contiguous detached copies), keyed by :func:`peft_keys`.

    Returns:
        fused: ``gate_up_proj.lora_A.weight [E*r, H]``, ``gate_up_proj.lora_B.weight [2I, r*E]``,
        ``down_proj.lora_A.weight [E*r, I]``, ``down_proj.lora_B.weight [H, r*E]``;
        split: ``{e}.{gate,up,down}_proj.lora_{A,B}.weight`` per expert.
    """
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if buffers.layout == "fused":
            for proj, ours in _FUSED_PROJ:
                a = getattr(buffers, f"{ours}_lora_a").detach()
                b = getattr(buffers, f"{ours}_lora_b").detach()
                out[peft_lora_key(proj, "A")] = stack_lora_a(a).clone(
                    memory_format=torch.contiguous_format
                )
                out[peft_lora_key(proj, "B")] = stack_lora_b(b).clone(
                    memory_format=torch.contiguous_format
                )
        else:
            for e in range(buffers.spec.num_experts):
                for proj, ours in _SPLIT_PROJ:
                    a = getattr(buffers, f"{ours}_lora_a").detach()
                    b = getattr(buffers, f"{ours}_lora_b").detach()
                    out[peft_lora_key(f"{e}.{proj}", "A")] = a[e].clone()
                    out[peft_lora_key(f"{e}.{proj}", "B")] = b[e].clone()
    return out


def _check_keys(spec: ExpertSpec, layout: LoraLayout, tensors: Mapping[str, torch.Tensor]) -> None:
    expected = set(peft_keys(spec, layout))
    missing = sorted(expected - set(tensors))
    unknown = sorted(set(tensors) - expected)
    if missing or unknown:
        raise AdaptError(
            f"PEFT tensors for layout {layout!r} must have exactly the keys of "
            f"moe_experts.peft_mapping.peft_keys(spec, {layout!r}); missing {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}, unexpected {unknown[:6]}"
            f"{'...' if len(unknown) > 6 else ''}"
        )


def _logical_from_peft(
    spec: ExpertSpec, rank: int, layout: LoraLayout, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    _check_keys(spec, layout, tensors)
    e = spec.num_experts
    logical: dict[str, torch.Tensor] = {}
    if layout == "fused":
        for proj, ours in _FUSED_PROJ:
            logical[f"{ours}_lora_a"] = unstack_lora_a(tensors[peft_lora_key(proj, "A")], e)
            logical[f"{ours}_lora_b"] = unstack_lora_b(tensors[peft_lora_key(proj, "B")], e)
    else:
        for proj, ours in _SPLIT_PROJ:
            logical[f"{ours}_lora_a"] = torch.stack(
                [tensors[peft_lora_key(f"{i}.{proj}", "A")] for i in range(e)]
            )
            logical[f"{ours}_lora_b"] = torch.stack(
                [tensors[peft_lora_key(f"{i}.{proj}", "B")] for i in range(e)]
            )
    for name, shape in lora_shapes(spec, rank, layout).items():
        if tuple(logical[name].shape) != shape:
            raise AdaptError(
                f"PEFT tensors give {name} shape {list(logical[name].shape)}, expected "
                f"{list(shape)} for rank {rank}; check rank and num_experts"
            )
    return logical


def copy_lora_from_peft(buffers: LoraBuffers, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy PEFT tensors (keys as :func:`peft_keys`) into ``buffers`` in place, under no_grad.

    Raises:
        AdaptError: missing/unexpected keys or wrong shapes (named in the message).
    """
    logical = _logical_from_peft(buffers.spec, buffers.rank, buffers.layout, tensors)
    with torch.no_grad():
        for name, value in logical.items():
            getattr(buffers, name).copy_(value)


def lora_from_peft(
    spec: ExpertSpec,
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    layout: LoraLayout,
    dtype: torch.dtype | None = None,
) -> LoraBuffers:
    """Build new :class:`LoraBuffers` from PEFT tensors (the inverse of :func:`lora_to_peft`).

    Args:
        spec: expert shapes.
        tensors: PEFT tensors keyed as :func:`peft_keys` (``lora_alpha`` is PEFT's ``alpha``).
        rank: ``r``; alpha: PEFT ``lora_alpha``; layout: ``"fused"`` or ``"split"``.
        dtype: parameter dtype; defaults to the dtype of the first tensor.

    Raises:
        AdaptError: missing/unexpected keys or wrong shapes.
    """
    first = next(iter(tensors.values()), None)
    if dtype is None:
        dtype = first.dtype if first is not None else torch.float32
    buffers = LoraBuffers(spec, rank, alpha, layout, dtype=dtype)
    copy_lora_from_peft(buffers, tensors)
    return buffers
