"""Keeping packed examples apart: how each family isolates the examples that share a row.

The fine-tune CLI packs several examples into one row, ``position_ids`` restarting at 0 where
each starts. Whether that keeps them apart depends on the family, and its registry row
(:attr:`moe_experts.MoEArchitecture.packing`) says which of three ways holds
(:class:`Packing`). :func:`packed_model_inputs` turns a packed batch into the forward
arguments that way needs, and refuses a batch packed the wrong way for the family.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from moe_experts.errors import PackingError

__all__ = ["DEMO_PADDING_COST", "Packing", "PaddingCost", "boundary_masks", "packed_model_inputs"]


class Packing(Enum):
    """How one family keeps the examples of a packed row apart."""

    # transformers builds a block-diagonal causal mask from restarting position_ids itself.
    POSITIONS = "positions"
    # transformers ignores position_ids when it builds this family's masks (or builds them
    # from other positions): the masks its own builders make from position_ids are passed in.
    MASKS = "masks"
    # Something other than attention carries from one token to the next (linear-attention,
    # recurrent or convolution state, pooled windows) and transformers cannot reset it at a
    # boundary on its PyTorch path: one example per row, the rest padding.
    ONE_PER_ROW = "one_per_row"

    @property
    def shares_rows(self) -> bool:
        """Whether several examples may share a row."""
        return self is not Packing.ONE_PER_ROW

    @property
    def description(self) -> str:
        """One line for the coverage report."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Packing.POSITIONS: "several examples per row",
    Packing.MASKS: "several examples per row, explicit block-diagonal masks",
    Packing.ONE_PER_ROW: "one example per row",
}


@dataclass(frozen=True)
class PaddingCost:
    """What one example per row costs on some data, against sharing rows (same row width)."""

    shared_rows: int
    shared_padding: float  # share of the shared rows' tokens that are padding
    own_rows: int
    own_padding: float

    def __str__(self) -> str:
        return (
            f"{self.own_rows} rows at {self.own_padding:.1%} padding instead of "
            f"{self.shared_rows} at {self.shared_padding:.1%} "
            f"({self.own_rows / self.shared_rows:.2f}x the tokens to compute)"
        )


# The chat demo (finetune/chat_demo.jsonl at the demo's --seq-len 128 and --eval-split 0.1),
# packed both ways; tests/test_finetune_packing.py measures it again from the data.
DEMO_PADDING_COST = PaddingCost(
    shared_rows=30, shared_padding=0.221, own_rows=39, own_padding=0.401
)


def _segment_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: the token starts a new example (its position does not follow on)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _check_one_per_row(family: str, position_ids: torch.Tensor) -> None:
    """Refuse rows where a second example of more than one token follows the first."""
    starts = _segment_starts(position_ids)
    later = starts.long().cumsum(1) > 1
    # Padding is one token per "example" (position 0 each): only a later token that continues
    # its predecessor belongs to a second real example.
    crowded = (later & ~starts).any(1)
    if bool(crowded.any()):
        rows = crowded.nonzero().flatten().tolist()
        raise PackingError(
            f"rows {rows[:8]} hold more than one example, but family {family!r} keeps state "
            "across example boundaries and must be packed one example per row; build the "
            "batches with PackedBatches.from_examples(..., one_per_row=True)"
        )


def _mask_builders() -> dict[str, Any]:
    """transformers' mask builder per ``config.layer_types`` entry."""
    from transformers import masking_utils as mu

    return {
        "full_attention": mu.create_causal_mask,
        "sliding_attention": mu.create_sliding_window_causal_mask,
        "chunked_attention": mu.create_chunked_causal_mask,
    }


def boundary_masks(model: nn.Module, position_ids: torch.Tensor) -> Any:
    """The attention masks of packed rows, built by transformers' own mask builders.

    Each builder gets the restarting ``position_ids``, from which it makes a block-diagonal
    mask (sliding window or chunks included) in the format the model's attention
    implementation reads.

    Args:
        model: a transformers causal LM (or a PEFT model around one).
        position_ids: ``[B, L]``, restarting at 0 where an example starts.

    Returns:
        A mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``) when the
        text config lists ``layer_types``, else one mask for every layer; a mask is ``None``
        where the rows hold one example each (plain causal).

    Raises:
        PackingError: a layer type has no mask builder here.
    """
    hf: Any = model  # a transformers PreTrainedModel (config, get_input_embeddings)
    config = hf.config.get_text_config()
    embeddings = hf.get_input_embeddings().weight
    # The builders read only the batch size, length, dtype and device of the embeddings.
    shape = torch.empty(
        (*position_ids.shape, 0), dtype=embeddings.dtype, device=position_ids.device
    )
    builders = _mask_builders()
    types = getattr(config, "layer_types", None)
    if types is None:
        return _build_mask(builders["full_attention"], config, shape, position_ids)
    unknown = sorted(set(types) - set(builders))
    if unknown:
        raise PackingError(
            f"layer types {unknown} of {config.model_type!r} have no mask builder for packed "
            f"rows (known: {sorted(builders)}); pack this family one example per row"
        )
    return {t: _build_mask(builders[t], config, shape, position_ids) for t in set(types)}


def _build_mask(builder: Any, config: Any, embeds: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """Call a mask builder with its arguments named as its transformers version names them.

    transformers 5.1 takes ``(config, input_embeds, attention_mask, cache_position,
    past_key_values, position_ids)``, 5.24 ``(config, inputs_embeds, attention_mask, cache,
    position_ids)`` without ``cache_position``: a positional call fits only one of them.
    """
    # Every value a known version asks for: no cache, so queries sit at positions 0..L-1.
    known = {
        "config": config,
        "input_embeds": embeds,
        "inputs_embeds": embeds,
        "attention_mask": None,
        "cache_position": torch.arange(embeds.shape[1], device=embeds.device),
        "past_key_values": None,
        "cache": None,
        "position_ids": position_ids,
    }
    kwargs = {}
    for name, param in inspect.signature(builder).parameters.items():
        if name in known:
            kwargs[name] = known[name]
        elif param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            raise PackingError(
                f"transformers' {builder.__name__} asks for an argument {name!r} that packed "
                "rows cannot give; pack this family one example per row "
                "(PackedBatches.from_examples(..., one_per_row=True))"
            )
    return builder(**kwargs)


def packed_model_inputs(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, Any]:
    """Forward keyword arguments that keep the packed examples of each row apart.

    Args:
        model: a supported MoE causal LM (wrapped or not, PEFT or not).
        input_ids: ``[B, L]`` token ids.
        position_ids: ``[B, L]``, restarting at 0 where an example starts.

    Returns:
        ``input_ids``, ``position_ids``, ``use_cache=False`` (transformers derives masks from
        restarting positions only without a KV cache) and, for a :attr:`Packing.MASKS`
        family, ``attention_mask``.

    Raises:
        PackingError: the family is :attr:`Packing.ONE_PER_ROW` and a row holds two examples.
        UnsupportedModelError: ``model`` is not a supported family.
    """
    from moe_experts.architectures import find_architecture

    arch = find_architecture(model)
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "use_cache": False,
    }
    if arch.packing is Packing.ONE_PER_ROW:
        _check_one_per_row(arch.family, position_ids)
    elif arch.packing is Packing.MASKS:
        inputs["attention_mask"] = boundary_masks(model, position_ids)
    return inputs
