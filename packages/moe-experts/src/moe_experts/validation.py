"""Checks that run before :func:`moe_experts.load_pretrained` or :func:`moe_experts.wrap` allocate.

A config is read by transformers, which accepts values that only fail much later: experts per
token above the expert count fails in the first forward, and an absurd expert count in the
first allocation. Here the few values the experts depend on are checked by key, and the host
memory the load will take is compared with what the host has, so both are refused up front with
the key or the figures named. The safetensors files themselves are validated by their reader
(:mod:`moe_experts._safetensors`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_experts._safetensors import Shards
from moe_experts.architectures import (
    ARCHITECTURES,
    MoEArchitecture,
    MoEBlockSite,
    find_architecture,
    iter_moe_blocks,
    lm_class,
)
from moe_experts.errors import LoadError
from moe_experts.sharing import SHARE_ENV
from moe_experts.storage import StoragePlan

__all__ = [
    "EXPERT_COUNT_KEYS",
    "HOST_MEMORY_LIMIT",
    "SIZE_KEYS",
    "TOP_K_KEYS",
    "ExpertConfig",
    "check_expert_config",
    "check_expert_count",
    "check_host_memory",
    "check_load_fits",
    "check_model_type",
    "check_sizes",
    "expert_config",
    "format_bytes",
    "host_memory_available",
    "host_memory_needed",
    "is_moe_family",
]

# The config keys the families of ARCHITECTURES keep their routed-expert count and experts per
# token under (each config class declares one of each). The shared per-family suite checks
# that the key found here is the one each built model reads.
EXPERT_COUNT_KEYS = ("n_routed_experts", "moe_num_experts", "num_local_experts", "num_experts")
TOP_K_KEYS = ("top_k_experts", "moe_topk", "moe_k", "num_experts_per_tok")
# Sizes every causal LM config has, each a positive integer.
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# Refuse a load that would take more than this share of the host's available memory: the
# rest is the margin for activations, LoRA, the optimizer and the other processes.
HOST_MEMORY_LIMIT = 0.9


@dataclass(frozen=True)
class ExpertConfig:
    """A MoE config's routed-expert count and experts per token, with the keys holding them.

    Attributes:
        num_experts_key: the config key of the expert count (e.g. ``"num_local_experts"``).
        num_experts: its value.
        top_k_key: the config key of the experts per token (e.g. ``"num_experts_per_tok"``).
        top_k: its value.
    """

    num_experts_key: str
    num_experts: Any
    top_k_key: str
    top_k: Any


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _lookup(config: Any, keys: tuple[str, ...]) -> tuple[str, Any]:
    """``(key, value)`` of the first of ``keys`` the config class declares, else it holds.

    A declared field is what the model reads; a config may also carry stray keys of another
    family's spelling (``n_routed_experts`` beside a declared ``num_experts``). The key is
    named as ``config.json`` spells it (the target of the class's ``attribute_map``).
    """
    declared = (
        {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    )
    data = config.to_dict()
    aliases = getattr(config, "attribute_map", None) or {}
    for pool in (declared, data):
        for key in keys:
            if key in pool:
                return aliases.get(key, key), getattr(config, key, None)
    return keys[-1], None


def expert_config(config: Any) -> ExpertConfig:
    """The expert count and experts per token of ``config`` (its text config), unvalidated.

    Args:
        config: a transformers ``PretrainedConfig`` of a MoE family (multimodal: the text
            config's values).

    Returns:
        The keys among :data:`EXPERT_COUNT_KEYS` and :data:`TOP_K_KEYS` the config declares
        (else holds), with their values (``None`` when it has neither).
    """
    text = _text_config(config)
    return ExpertConfig(*_lookup(text, EXPERT_COUNT_KEYS), *_lookup(text, TOP_K_KEYS))


def is_moe_family(config: Any) -> bool:
    """Whether ``config.model_type`` (or its text config's) is a family of ``ARCHITECTURES``."""
    types = {getattr(config, "model_type", None), getattr(_text_config(config), "model_type", None)}
    return any(t in a.model_types for a in ARCHITECTURES.values() for t in types)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_sizes(config: Any, where: object, error: type[ValueError] = LoadError) -> None:
    """Refuse a config whose basic sizes (:data:`SIZE_KEYS`) are not positive integers.

    Raises:
        error: naming the key and its value.
    """
    data = _text_config(config).to_dict()
    for key in SIZE_KEYS:
        if key in data and not _positive_int(data[key]):
            raise error(f"{where}: {key} = {data[key]!r}; it must be a positive integer")


def check_expert_config(
    config: Any, where: object, error: type[ValueError] = LoadError
) -> ExpertConfig:
    """Refuse a MoE config whose expert count or experts per token cannot work.

    Args:
        config: a transformers ``PretrainedConfig`` of a family in ``ARCHITECTURES``.
        where: what to name in messages (``config.json``'s path, or the model).
        error: the exception class to raise (:class:`LoadError` or :class:`WrapError`).

    Returns:
        The validated :class:`ExpertConfig`.

    Raises:
        error: the expert count or the experts per token is not a positive integer, or the
            experts per token exceed the expert count; the message names the key.
    """
    counts = expert_config(config)
    for key, value in (
        (counts.num_experts_key, counts.num_experts),
        (counts.top_k_key, counts.top_k),
    ):
        if not _positive_int(value):
            raise error(f"{where}: {key} = {value!r}; it must be a positive integer")
    if counts.top_k > counts.num_experts:
        raise error(
            f"{where}: {counts.top_k_key} = {counts.top_k} experts per token, but the model "
            f"has only {counts.num_experts_key} = {counts.num_experts} experts; lower "
            f"{counts.top_k_key} or fix {counts.num_experts_key}"
        )
    return counts


def check_model_type(config_file: Path, model_type: object) -> None:
    """Refuse a ``model_type`` the installed transformers does not know, naming the key.

    Raises:
        LoadError: ``model_type`` is missing from transformers' config registry (or not a
            string); the message lists the families moe-experts supports.
    """
    from transformers import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    families = ", ".join(sorted(t for a in ARCHITECTURES.values() for t in a.model_types[:1]))
    what = (
        f"model_type {model_type!r} is not a model type this transformers knows"
        if isinstance(model_type, str)
        else "has no model_type (a string naming the family)"
    )
    raise LoadError(
        f"{config_file}: {what}; moe-experts supports {families} (a newer transformers may "
        "know more)"
    )


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units, e.g. ``"40.3 GB"`` (``"901 B"`` below a kilobyte)."""
    if n < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB", "TB", "PB", "EB"):
        n /= 1000
        if n < 1000 or unit == "EB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def host_memory_available() -> int | None:
    """Bytes of host memory available to a new allocation (``psutil``: MemAvailable on Linux).

    ``None`` where the figure cannot be read (the check is then skipped).
    """
    try:
        # psutil ships no types and no stubs are pinned: imported as Any, its one figure is int.
        psutil = importlib.import_module("psutil")
        return int(psutil.virtual_memory().available)
    except (ImportError, OSError, RuntimeError):
        return None


def check_host_memory(needed: int, what: str, *, available: int | None = None) -> None:
    """Refuse ``needed`` bytes when they exceed :data:`HOST_MEMORY_LIMIT` of the available.

    Args:
        needed: bytes the operation will hold at its peak.
        what: what needs them (named first in the message).
        available: the available figure; ``None`` reads :func:`host_memory_available`.

    Raises:
        LoadError: naming both figures.
    """
    if available is None:
        available = host_memory_available()
    if available is None or needed <= HOST_MEMORY_LIMIT * available:
        return
    raise LoadError(
        f"{what} needs {format_bytes(needed)} of host memory, more than "
        f"{HOST_MEMORY_LIMIT:.0%} of the {format_bytes(available)} available here; check the "
        "config's sizes, store the experts smaller (weight_dtype 'int8' or 'int4') or free "
        "memory"
    )


def _nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def host_memory_needed(
    model: nn.Module,
    arch: MoEArchitecture,
    plan: StoragePlan,
    *,
    quantising: bool,
    dense_on_host: bool = True,
) -> tuple[int, int, int]:
    """``(experts, dense, transient)`` host bytes of loading ``model`` as ``plan`` stores it.

    Args:
        model: the model built on the meta device (shapes and dtypes only).
        arch: its family.
        plan: the storage of its experts.
        quantising: whether the experts are quantised while loading (a lossy ``plan`` over a
            checkpoint that does not ship that format).
        dense_on_host: whether the dense weights stay in host memory (not on an accelerator).

    Returns:
        The kernel storage of every block's experts (with biases); the dense parameters and
        buffers; and the transient beyond both: one block's experts in the model dtype plus
        fp32 while they are quantised (dense storage and shipped bytes are filled in place).
    """
    experts = transient = 0
    expert_params: set[int] = set()
    fmt = plan.format
    for site in iter_moe_blocks(model, arch):
        module = getattr(site.block, arch.experts_attr)
        params = dict(module.named_parameters(recurse=False))
        expert_params.update(id(p) for p in params.values())
        gate_up = params[arch.gate_up_param]
        e, i, h = arch.expert_dims(gate_up)
        experts += e * sum(
            _nbytes(shape, dtype)
            for _, shape, dtype in (*fmt.part_specs(2 * i, h), *fmt.part_specs(h, i))
        )
        experts += sum(_nbytes(params[p].shape, params[p].dtype) for p in arch.bias_params)
        if quantising:
            transient = max(transient, e * 3 * i * h * (gate_up.dtype.itemsize + 4))
    dense = 0
    for p in model.parameters():
        if id(p) not in expert_params and dense_on_host:
            dense += _nbytes(p.shape, p.dtype)
    dense += sum(_nbytes(b.shape, b.dtype) for b in model.buffers())
    return experts, dense, transient


def check_load_fits(
    config: Any,
    config_file: Path,
    dtype: torch.dtype,
    plan: StoragePlan,
    *,
    quantising: bool,
    dense_device: torch.device,
    share_experts: bool | None,
) -> ExpertConfig:
    """Validate the config's experts and the host memory a load needs, before allocating.

    The model is built once on the meta device (shapes and dtypes only) for the family, the
    expert count and the bytes; the real build allocates each parameter before moving it.
    Under torchrun with several local ranks, local rank 0 checks for the whole machine (every
    rank's dense weights, the experts once when shared), before any rank allocates: a rank
    checking later would see the memory the others already took.

    Args:
        config: the checkpoint's config (without a ``quantization_config``).
        config_file: its ``config.json`` (for messages).
        dtype: the model dtype.
        plan: how the experts are stored.
        quantising: whether loading quantises the experts (see :func:`host_memory_needed`).
        dense_device: where the dense weights go (host memory counts only for ``cpu``).
        share_experts: as in ``load_pretrained`` (the experts count once per machine).

    Returns:
        The config's validated :class:`ExpertConfig`.

    Raises:
        LoadError: transformers cannot build the config, a bad expert count or experts per
            token (naming the key), or more memory than the host has (naming both figures).
        UnsupportedModelError: the config is not a supported MoE family.
    """
    # The class load_pretrained builds: a multimodal checkpoint's is image-text-to-text.
    build: Callable[..., nn.Module] = lm_class(config.model_type).from_config
    try:
        with torch.device("meta"):
            meta = build(config, dtype=dtype)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        if is_moe_family(config):  # a bad expert value: name its key
            check_expert_config(config, config_file)
        raise LoadError(f"{config_file}: transformers cannot build the model: {exc}") from exc
    arch = find_architecture(meta)
    counts = check_expert_config(config, config_file)
    blocks = len(list(iter_moe_blocks(meta, arch)))
    experts, dense, transient = host_memory_needed(
        meta, arch, plan, quantising=quantising, dense_on_host=dense_device.type == "cpu"
    )
    ranks, local_rank = _local_ranks()
    if local_rank > 0:
        return counts
    shared = share_experts is not False and os.environ.get(SHARE_ENV, "1") != "0"
    copies = 1 if shared else ranks
    machine = f" on each of {ranks} local ranks" if ranks > 1 else ""
    check_host_memory(
        experts * copies + (dense + transient) * ranks,
        f"{config_file}: {counts.num_experts_key} = {counts.num_experts} experts in {blocks} "
        f"MoE layers, stored as {plan.weight_dtype} ({format_bytes(experts)}"
        f"{' x ' + str(copies) if copies > 1 else ''}), plus "
        f"{format_bytes(dense)} of dense weights and "
        f"{format_bytes(transient)} while quantising{machine},",
    )
    return counts


def _local_ranks() -> tuple[int, int]:
    """``(LOCAL_WORLD_SIZE, LOCAL_RANK)`` under torchrun, ``(1, 0)`` otherwise or if garbled."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 1, 0


def check_expert_count(
    site: MoEBlockSite,
    per_expert: Mapping[tuple[int, str], str],
    fused: Mapping[str, str],
    shards: Shards,
    where: Mapping[str, Path],
    counts: ExpertConfig,
) -> None:
    """Refuse checkpoint experts beyond the config's count (they would be dropped silently).

    Args:
        site: the block, its experts module built (on the meta device) from the config.
        per_expert: ``(expert, role) -> key`` of its per-expert checkpoint keys.
        fused: ``stored parameter name -> key`` of its fused ones.
        shards: the checkpoint reader (only headers are read).
        where: checkpoint key -> shard file.
        counts: the config's expert count key (for messages).

    Raises:
        LoadError: a per-expert key of an expert index >= E, or a fused tensor holding more or
            fewer than E experts; names the key, its file and the config key.
    """
    e = site.arch.expert_dims(
        getattr(getattr(site.block, site.arch.experts_attr), site.arch.gate_up_param)
    )[0]
    declared = f"{counts.num_experts_key} = {e} experts in config.json"
    for (x, _), key in sorted(per_expert.items()):
        if x >= e:
            raise LoadError(
                f"{where[key]}: checkpoint key {key!r} is expert {x} of {site.experts_name}, but "
                f"the model has {declared}; the checkpoint holds more experts than its config "
                "declares (fix the config or re-save the checkpoint)"
            )
    for key in fused.values():
        shape = shards.info(where[key], key)[0]
        if shape and shape[0] != e:
            raise LoadError(
                f"{where[key]}: tensor {key!r} holds {shape[0]} experts (shape {list(shape)}), "
                f"but the model has {declared}; fix the config or re-save the checkpoint"
            )
