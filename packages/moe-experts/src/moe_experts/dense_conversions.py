"""Dense checkpoint tensors that transformers converts on load, for ``load_pretrained``.

transformers' conversion mapping (``transformers.conversion_mapping``) is the one table of hub
checkpoint layouts. ``load_pretrained`` renames keys with its ``WeightRenaming`` rows and
streams the experts its expert ``WeightConverter`` rows describe; every other converter (one
matching a key outside the experts) is run here, through transformers' own operations, so a
family whose hub layout transformers knows loads with no table of our own. Examples:
Kimi-Linear's ``q/k/v_conv1d`` concatenated into ``conv1d``, Lara-Mini's fused ``in_proj``
split into ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from moe_experts.errors import LoadError
from moe_experts.shipped_checkpoint import ShippedReader

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.core_model_loading import WeightConverter

__all__ = ["DenseConversions", "read_stored"]


class DenseConversions:
    """The dense weights one model gets from transformers' converters, grouped per target."""

    def __init__(self, model: nn.Module) -> None:
        """The converters transformers applies to ``model``'s checkpoints."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        transforms = get_model_conversion_mapping(cast("PreTrainedModel", model))
        self._model = model
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._names.update(n for n, _ in model.named_buffers(remove_duplicate=False))
        # first target's model name -> (its own converter copy, source pattern -> checkpoint keys)
        self._groups: dict[str, tuple[WeightConverter, dict[str, list[str]]]] = {}

    def claim(self, renamed: str, key: str) -> bool:
        """Collect checkpoint ``key`` (``renamed`` after the renamings) if a converter takes it.

        As transformers does, only the first converter matching ``renamed`` applies, and a key
        whose target the model lacks is left alone (to be reported or ignored by the caller).
        """
        for conv in self._converters:
            target, pattern = conv.rename_source_key(renamed)
            if pattern is None:
                continue
            if target not in self._names:
                return False
            # transformers: each target key gets its own converter instance
            group = self._groups.setdefault(target, (deepcopy(conv), {}))
            group[1].setdefault(pattern, []).append(key)
            return True
        return False

    def tensors(
        self, read: Callable[[str, str], torch.Tensor], file: Callable[[str], Path]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(model name, tensor)`` of every converted weight, one converter group at a time.

        Args:
            read: ``read(checkpoint key, first target's model name)`` -> the tensor as stored,
                cast to the dtype ``from_pretrained`` gives that target.
            file: the shard holding a checkpoint key, for the messages.

        Raises:
            LoadError: the converter fails on the checkpoint's tensors or yields a tensor the
                model does not have, or of another shape (naming the checkpoint keys).
        """
        from transformers.core_model_loading import dot_natural_key

        state: dict[str, torch.Tensor] = dict(self._model.named_parameters(remove_duplicate=False))
        state.update(self._model.named_buffers(remove_duplicate=False))
        for target, (conv, sources) in self._groups.items():
            keys = ", ".join(f"{file(k).name}: {k!r}" for ks in sources.values() for k in ks)
            for pattern, pattern_keys in sources.items():
                for key in sorted(pattern_keys, key=dot_natural_key):  # transformers' order
                    # Handed over as transformers' asynchronous loading does: a done Future.
                    future: Future[torch.Tensor] = Future()
                    future.set_result(read(key, target))
                    conv.add_tensor(target, key, pattern, future)
            try:
                out: dict[str, Any] = conv.convert(
                    target, model=self._model, config=getattr(self._model, "config", None)
                )
            except Exception as exc:  # any op's error (shapes, missing pieces), named below
                raise LoadError(
                    f"checkpoint tensors [{keys}] do not convert to {target!r} as transformers "
                    f"converts them ({type(exc).__name__}: {exc}); the checkpoint does not "
                    "match its config.json"
                ) from exc
            for name, value in out.items():
                t = value[0] if isinstance(value, list) else value
                want = state.get(name)
                if want is None or tuple(t.shape) != tuple(want.shape):
                    raise LoadError(
                        f"checkpoint tensors [{keys}] convert to {name!r} of shape "
                        f"{list(t.shape)}, which the {type(self._model).__name__} "
                        f"{'lacks' if want is None else f'has as {list(want.shape)}'}; the "
                        "checkpoint does not match its config.json"
                    )
                yield name, t


def read_stored(reader: ShippedReader, key: str, dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint tensor ``key`` in its stored shape, cast (or dequantised) to ``dtype``.

    A converter's source has no model parameter of its own to check the shape against; its
    outputs are checked instead (:meth:`DenseConversions.tensors`).
    """
    if reader.ships(key) and reader.shipped is not None:
        return reader.shipped.format.dequantize(reader.read_parts(key), dtype)
    shape = reader.shards.info(reader.where[key], key)[0]
    return reader.read(key, shape, dtype)
