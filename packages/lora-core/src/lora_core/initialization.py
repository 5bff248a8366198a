"""Deterministic LoRA initialisation: every value derives from (seed, tensor name, shape).

Nothing here reads global RNG state, so every rank, every module-creation order, every thread
count and the meta-device/FSDP loader path produce bit-identical adapters.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

__all__ = ["init_lora_tensor", "lora_generator_seed"]

_A_SUFFIX = "lora_A"
_B_SUFFIX = "lora_B"


def _kind(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in (_A_SUFFIX, _B_SUFFIX) and (name == leaf or name.endswith("." + leaf)):
        return leaf
    hint = ""
    if name.endswith((".lora_A.weight", ".lora_B.weight")):
        hint = f"; drop the trailing '.weight' (use {name.removesuffix('.weight')!r})"
    raise ValueError(
        f"init_lora_tensor name {name!r} must end with '.lora_A' or '.lora_B' "
        f"(the fully-qualified module name of the adapter matrix){hint}"
    )


def lora_generator_seed(name: str, seed: int) -> int:
    """Return the ``torch.Generator`` seed used for the adapter matrix ``name``.

    ``(seed + blake2b-64(utf-8 name)) mod 2**32``: a stable hash, never Python's salted
    ``hash()``. Folded to 32 bits explicitly because the CPU Mersenne-Twister generator only
    uses the low 32 bits of its seed; folding here keeps values stable if that ever changes.

    Args:
        name: fully-qualified adapter name, e.g. ``"model.layers.0.self_attn.q_proj.lora_A"``.
        seed: the user's ``LoraConfig.init_seed``.

    Returns:
        An integer in ``[0, 2**32)``.
    """
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return (seed + int.from_bytes(digest, "little")) % (1 << 32)


def init_lora_tensor(
    name: str, shape: Sequence[int], dtype: torch.dtype, *, seed: int
) -> torch.Tensor:
    """Return the initial value of one LoRA matrix, a pure function of (seed, name, shape).

    ``*.lora_A`` is drawn uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in))`` with
    ``fan_in = shape[-1]`` — the bounds of ``kaiming_uniform_(a=sqrt(5))`` that ``nn.Linear``
    and PEFT use — in float32 from a private ``torch.Generator`` seeded by
    :func:`lora_generator_seed`, then cast to ``dtype``. ``*.lora_B`` is zeros, so a fresh
    adapter leaves the model's output unchanged. The same function serves dense A ``[r, in]``
    and per-expert A ``[E, r, in]``.

    Args:
        name: fully-qualified module name ending in ``.lora_A`` or ``.lora_B`` (a root-level
            adapter may be named exactly ``lora_A``/``lora_B``), e.g.
            ``"model.layers.3.mlp.experts.gate.lora_A"``.
        shape: tensor shape, e.g. ``[r, in]`` or ``[E, r, in]``; every dimension positive.
        dtype: floating-point dtype of the result.
        seed: ``LoraConfig.init_seed``.

    Returns:
        A new CPU tensor of ``shape`` and ``dtype``.

    Raises:
        ValueError: if the name does not end with ``.lora_A``/``.lora_B``, the shape has a
            non-positive dimension, or the dtype is not floating point.
        TypeError: if ``seed`` is not an int.
    """
    if not isinstance(name, str):
        raise TypeError(f"init_lora_tensor name must be a str, got {type(name).__name__}")
    kind = _kind(name)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"init_lora_tensor seed must be an int, got {seed!r}")
    dims = tuple(shape)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
        raise ValueError(
            f"init_lora_tensor shape for {name!r} must be a non-empty sequence of positive "
            f"ints, got {list(dims)}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"init_lora_tensor dtype for {name!r} must be a floating-point torch.dtype, "
            f"got {dtype!r}"
        )
    if kind == _B_SUFFIX:
        return torch.zeros(dims, dtype=dtype)
    bound = 1.0 / math.sqrt(dims[-1])
    gen = torch.Generator(device="cpu")
    gen.manual_seed(lora_generator_seed(name, seed))
    # The CPU uniform_ kernel is serial, so the values do not depend on the thread count.
    out = torch.empty(dims, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    return out.to(dtype)
