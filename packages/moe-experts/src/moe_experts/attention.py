"""kt-kernel's causal attention as a transformers attention implementation, safe for any model.

``"kt_causal"`` (:data:`KERNEL_ATTENTION`) runs :func:`kt_kernel.causal_attention` when the call
is plain causal self-attention on the CPU (no mask beyond causal, no dropout, no sliding
window, soft-capping, sinks or position bias, queries as long as keys) and hands every other
call to transformers' SDPA implementation. Its mask function is SDPA's, so a model whose only
mask is the causal one gets none and takes the fast path.

DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5, Mistral Large 4, ...) folds its indexer's
top-k keys into the mask only for ``"eager"``/``"sdpa"``; for any other implementation it passes
them as ``indices`` (for FlashMLA). Here they are folded into the mask the same way before SDPA
runs, so the sparse selection is never dropped.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "KERNEL_ATTENTION",
    "kernel_attention_forward",
    "register_kernel_attention",
    "use_kernel_attention",
]

KERNEL_ATTENTION = "kt_causal"
# Keyword arguments whose presence (not None) changes the attention away from plain causal.
_OFF_PATH_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


def _plain_causal(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> bool:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return (
        bool(causal)
        and attention_mask is None
        and not dropout
        and not kwargs.get("output_attentions", False)
        and all(kwargs.get(name) is None for name in _OFF_PATH_KWARGS)
        and query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.dtype == key.dtype == value.dtype
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[2] == key.shape[2]
        and key.shape == value.shape
        and query.shape[1] % key.shape[1] == 0
    )


def _keep_indexed_keys(
    attention_mask: torch.Tensor | None, indices: torch.Tensor, key_len: int
) -> torch.Tensor:
    """The mask with only each query's ``indices`` ``[B, T, k]`` of the keys left visible.

    As the DSA models do for SDPA: a boolean mask is and-ed, an additive one gets the dtype's
    minimum; with no mask (plain causal) the causal mask is built first.
    """
    batch, q_len, _ = indices.shape
    keep = torch.zeros((batch, q_len, key_len), dtype=torch.bool, device=indices.device)
    keep = keep.scatter(-1, indices.long(), True).unsqueeze(1)  # [B, 1, T, S]
    if attention_mask is None:
        # Queries are the last q_len positions of the keys.
        causal = torch.ones((q_len, key_len), dtype=torch.bool, device=indices.device)
        attention_mask = causal.tril(key_len - q_len)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask & keep
    return attention_mask.masked_fill(~keep, torch.finfo(attention_mask.dtype).min)


def kernel_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: kt-kernel's causal op, else SDPA's implementation.

    Args:
        module: the attention module (its ``is_causal`` is read when ``is_causal`` is None).
        query: ``[B, Hq, T, D]``.
        key: ``[B, Hkv, S, D]``.
        value: ``[B, Hkv, S, D]``.
        attention_mask: the mask transformers built (``None`` for plain causal).
        dropout: attention dropout probability.
        scaling: softmax scale (``None``: ``1 / sqrt(D)``).
        is_causal: whether the call is causal (``None``: the module's attribute).
        **kwargs: the model's other attention arguments (sliding window, soft-cap, sinks,
            DSA's top-k ``indices`` ``[B, T, k]``, folded into the mask).

    Returns:
        ``([B, T, Hq, D]`` output, ``None``), as transformers' implementations return.
    """
    indices = kwargs.pop("indices", None)
    if indices is not None:
        attention_mask = _keep_indexed_keys(attention_mask, indices, key.shape[2])
    if not _plain_causal(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    from kt_kernel import causal_attention

    out = causal_attention(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_kernel_attention() -> str:
    """Register ``"kt_causal"`` with transformers' attention and mask interfaces; idempotent.

    Returns:
        The registered name, for ``model.set_attn_implementation`` or ``attn_implementation=``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(KERNEL_ATTENTION, kernel_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(KERNEL_ATTENTION, sdpa_mask)
    return KERNEL_ATTENTION


def use_kernel_attention(model: torch.nn.Module) -> bool:
    """Switch a CPU model from transformers' SDPA to ``"kt_causal"``; report whether it did.

    Only a model that uses ``"sdpa"`` and whose parameters are on the CPU is switched: an
    explicit eager/flash/flex choice, a GPU model or one without transformers' attention
    interface is left as it is.

    Args:
        model: a transformers ``PreTrainedModel`` (anything else is left alone).

    Returns:
        ``True`` when the model now runs ``"kt_causal"``.
    """
    config = getattr(model, "config", None)
    setter = getattr(model, "set_attn_implementation", None)
    if config is None or setter is None:
        return False
    current = getattr(config, "_attn_implementation", None)
    if current == KERNEL_ATTENTION:
        return True
    if current != "sdpa" or any(p.device.type != "cpu" for p in model.parameters()):
        return False
    setter(register_kernel_attention())
    return getattr(config, "_attn_implementation", None) == KERNEL_ATTENTION
