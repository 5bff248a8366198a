"""``load_pretrained``: stream a sharded safetensors checkpoint straight into kt-kernel storage.

``from_pretrained`` + :func:`moe_experts.wrap` materialises every expert in the model dtype
before ``wrap`` copies it, so the load peak is at least the whole model plus the kernel copy.
Here the model is built with its *parameters* on the meta device (buffers, such as rotary
tables, are computed as usual), non-expert weights are read from the checkpoint one tensor at a
time, and the experts are assembled one MoE block at a time: the block's expert tensors are read
(per-expert 2-D keys or fused 3-D ones), cast to the model dtype exactly as ``from_pretrained``
would, and handed to :class:`kt_kernel.ExpertWeights` the way ``wrap`` does it. The only
transient beyond the final footprint is one block's experts in the model dtype, and the result is
bitwise the same as ``from_pretrained(path, dtype=dtype)`` + ``wrap(model, weight_dtype=...)``.
FP8-block checkpoints keep their experts as shipped (see :mod:`moe_experts.fp8_checkpoint`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import kt_kernel
from kt_kernel.formats_fp8 import Fp8Block
from moe_experts._safetensors import Shards
from moe_experts.architectures import MoEBlockSite, find_architecture, iter_moe_blocks
from moe_experts.errors import LoadError
from moe_experts.fp8_checkpoint import (
    Fp8Reader,
    check_quantization_config,
    read_fp8_bank,
    resolve_weight_dtype,
)
from moe_experts.kernel_experts import KernelExperts, Policy
from moe_experts.memory import trim_host_heap
from moe_experts.wrapping import _DTYPES, _QUANTISED, WeightDType, _expert_spec

__all__ = ["load_pretrained"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_PER_EXPERT = re.compile(r"^(\d+)\.(.+)$")


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device; buffers stay real (rotary tables)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            # Freshly created by torch.empty and never touched: no page was ever resident.
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _weight_map(path: Path) -> dict[str, Path]:
    """``{checkpoint key: shard file}`` from the index, or from the single-file checkpoint."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {exc}"
            ) from exc
        out = {str(k): path / str(v) for k, v in weight_map.items()}
        missing = sorted({str(f) for f in out.values() if not f.is_file()})
        if missing:
            raise LoadError(f"{index} names shard files that do not exist: {missing}")
        return out
    single = path / _SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise LoadError(
        f"{path} holds neither {_INDEX} nor {_SINGLE}; load_pretrained reads local safetensors "
        "checkpoints (save them with save_pretrained or download them first)"
    )


@dataclass
class _ExpertKeys:
    """Where one experts module's weights are in the checkpoint."""

    fused: dict[str, str] = field(default_factory=dict)  # "gate_up" | "down" -> key
    # (expert, "gate" | "up" | "down") -> key
    per_expert: dict[tuple[int, str], str] = field(default_factory=dict)


class _KeyMapper:
    """Checkpoint key -> model key, with transformers' own renamings and expert converters."""

    def __init__(self, model: nn.Module, sites: list[MoEBlockSite]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._sites = {s.experts_name + ".": s for s in sites}
        self._names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._names.update(n for n, _ in model.named_buffers(remove_duplicate=False))

    def rename(self, key: str) -> str:
        """Apply every renaming (e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``).

        A key that already is a model name and that a renaming would turn into a non-name is
        kept, as transformers' loader does: the renaming regexes are unanchored, so Laguna's
        ``mlp.shared_expert.`` -> ``mlp.shared_experts.`` also matches the model's own
        ``mlp.shared_experts.down_proj`` (``.`` matches the ``s``) and would mangle it.
        """
        from transformers.core_model_loading import rename_source_key

        renamed = rename_source_key(key, self._renamings, [])[0]
        if renamed not in self._names and key in self._names:
            return key
        return renamed

    def _role(self, site: MoEBlockSite, renamed: str, proj: str) -> str | None:
        """``"gate"``/``"up"``/``"down"`` of a per-expert key, from transformers' converters."""
        arch = site.arch
        for conv in self._converters:
            _, pattern = conv.rename_source_key(renamed)
            if pattern is None:
                continue
            target = conv.target_patterns[0]
            if target.endswith(arch.down_param):
                return "down"
            if target.endswith(arch.gate_up_param):
                return ("gate", "up")[conv.source_patterns.index(pattern)]
        return None

    def expert_key(self, key: str) -> tuple[MoEBlockSite, tuple[int, str] | str] | None:
        """``(site, (expert, role))`` / ``(site, "gate_up"|"down")`` for an expert key, else None.

        Raises:
            LoadError: a key under an experts module that is neither layout.
        """
        renamed = self.rename(key)
        for prefix, site in self._sites.items():
            if not renamed.startswith(prefix):
                continue
            rest = renamed[len(prefix) :]
            if rest == site.arch.gate_up_param:
                return site, "gate_up"
            if rest == site.arch.down_param:
                return site, "down"
            match = _PER_EXPERT.match(rest)
            role = self._role(site, renamed, match.group(2)) if match else None
            if match is None or role is None:
                raise LoadError(
                    f"checkpoint key {key!r} is under {site.experts_name} but is neither a fused "
                    f"{site.arch.gate_up_param}/{site.arch.down_param} tensor nor a per-expert "
                    "gate/up/down weight this family's transformers converter knows"
                )
            return site, (int(match.group(1)), role)
        return None


def _slots(site: MoEBlockSite, keys: _ExpertKeys, e: int) -> list[tuple[str, str, int | None]]:
    """``(key, "gate"|"up"|"down"|"gate_up", expert or None)`` of one block, in storage order.

    Raises:
        LoadError: both layouts, or a missing tensor.
    """
    name = site.experts_name
    if keys.fused and keys.per_expert:
        raise LoadError(
            f"{name}: the checkpoint holds both fused ({sorted(keys.fused.values())[0]!r}) "
            "and per-expert keys; it must use one layout per experts module"
        )
    out: list[tuple[str, str, int | None]] = []
    if keys.fused:
        for part in ("gate_up", "down"):
            key = keys.fused.get(part)
            if key is None:
                raise LoadError(f"{name}: the checkpoint has no fused {part} tensor for it")
            out.append((key, part, None))
        return out
    for x in range(e):
        for role in ("gate", "up", "down"):
            key = keys.per_expert.get((x, role))
            if key is None:
                raise LoadError(
                    f"{name}: the checkpoint has no {role} weight for expert {x} (expected "
                    f"a key like '{name}.{x}.<{role} proj>.weight'); it holds "
                    f"{len(keys.per_expert)} of the {3 * e} per-expert tensors"
                )
            out.append((key, role, x))
    # Down last, so the first and last slots name one tensor of each bank.
    return sorted(out, key=lambda slot: slot[1] == "down")


def _assemble(
    slots: list[tuple[str, str, int | None]],
    reader: Fp8Reader,
    meta: tuple[torch.Tensor, torch.Tensor],
    storage: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` in the ``storage`` dtype.

    Each tensor is first cast to the model dtype (what ``from_pretrained`` holds; FP8 ones
    dequantised to it, one tensor at a time), then to ``storage`` (what ``wrap`` copies it to),
    so the values are exactly those of that path.
    """
    gu_meta, dn_meta = meta
    inter = gu_meta.shape[1] // 2
    gate_up = torch.empty(gu_meta.shape, dtype=storage)
    down = torch.empty(dn_meta.shape, dtype=storage)
    for key, role, x in slots:
        dst = down if role == "down" else gate_up
        if x is not None:
            dst = dst[x]
        if role in ("gate", "up"):
            dst = dst[:inter] if role == "gate" else dst[inter:]
        t = reader.read(key, tuple(dst.shape), gu_meta.dtype)
        dst.copy_(t)
        del t
    return gate_up, down


def _adopt_dense(
    spec: kt_kernel.ExpertSpec, gate_up: torch.Tensor, down: torch.Tensor
) -> kt_kernel.ExpertWeights:
    """Dense :class:`kt_kernel.ExpertWeights` over already-filled storage, without a copy."""
    from_parts = getattr(kt_kernel.ExpertWeights, "from_parts", None)
    if from_parts is not None:  # kt-kernel with pluggable weight formats
        from kt_kernel.formats import Dense

        return from_parts(spec, Dense(gate_up.dtype), (gate_up,), (down,))
    return kt_kernel.ExpertWeights(spec, gate_up, down)


def _like(meta: torch.Tensor) -> torch.Tensor:
    """A CPU tensor description of ``meta`` for the placeholder (no storage is touched)."""
    return torch.empty(1, dtype=meta.dtype).expand(meta.shape)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = value


def _target_dtype(
    model: nn.Module, name: str, current: torch.dtype, dtype: torch.dtype
) -> torch.dtype:
    """The dtype ``from_pretrained`` gives ``name``: fp32 for keep-in-fp32 modules, else current."""
    strict = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    loose = getattr(model, "_keep_in_fp32_modules", None) or ()
    keep = list(strict) if dtype in (torch.float16, torch.bfloat16) else []
    if dtype == torch.float16:
        keep += list(loose)
    if any(re.search(rf"(^|\.){re.escape(p)}($|\.)", name) for p in keep):
        return torch.float32
    return current


def load_pretrained(
    path: str | Path,
    *,
    weight_dtype: WeightDType | None = None,
    dtype: torch.dtype = torch.bfloat16,
    dense_device: str | torch.device = "cpu",
    policy: Policy = "save",
) -> nn.Module:
    """Build a causal LM from a local checkpoint with its experts streamed onto kt-kernel.

    Equivalent to ``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` followed by
    :func:`moe_experts.wrap` ``(model, weight_dtype=weight_dtype, policy=policy)``, bitwise, but
    without ever holding the model's experts in ``dtype``: at most one MoE block's experts are
    resident beyond the final footprint. Checkpoint experts may be per-expert 2-D keys (as hub
    checkpoints ship them, e.g. ``mlp.experts.{e}.gate_proj.weight``) or fused 3-D tensors.

    FP8-block checkpoints (DeepSeek-V3 style: ``weight`` in float8_e4m3fn plus
    ``weight_scale_inv`` per 128x128 block, ``quantization_config`` ``quant_method: fp8`` in
    ``config.json``) keep their experts' bytes and scales as kt-kernel's FP8 format (nothing
    is re-quantised and no bf16 copy is made); their dense FP8 weights are dequantised to
    ``dtype`` as transformers does (``weight * scale_inv`` in fp32, rounded once).

    Args:
        path: a local directory with ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``.
        weight_dtype: kernel storage. ``None`` (default): ``"fp8"`` for a FP8 checkpoint (the
            shipped bytes), else ``"bf16"``. ``"bf16"``/``"fp32"``: dense storage (a FP8
            checkpoint is dequantised expert by expert while streaming). ``"int8"``/``"int4"``
            /``"fp8"`` quantise an unquantised checkpoint as ``wrap`` does; a FP8 checkpoint
            is never quantised a second time.
        dtype: the model dtype (dense weights, and what ``from_pretrained`` would give experts).
        dense_device: device of the dense (non-expert) weights, e.g. ``"cuda:0"``; the experts
            stay on the CPU kernel and hidden states cross over and back (autograd too).
        policy: kt-kernel activation policy, ``"save"`` or ``"recompute"``.

    Returns:
        The model in eval mode, every supported MoE block's experts on the kernel.

    Raises:
        LoadError: missing files, a missing or mis-shaped tensor, a FP8 weight without a valid
            128x128 scale grid (naming the key and file), an unsupported
            ``quantization_config``, or ``"int8"``/``"int4"`` for a FP8 checkpoint.
        UnsupportedModelError: the checkpoint is not a supported MoE family.
        WrapError: an unknown ``weight_dtype``/``policy`` or an unsupported activation.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_experts.errors import WrapError

    if weight_dtype is not None and weight_dtype not in _DTYPES:
        raise WrapError(f"weight_dtype must be one of {sorted(_DTYPES)}, got {weight_dtype!r}")
    if policy not in ("save", "recompute"):
        raise WrapError(f"policy must be 'save' or 'recompute', got {policy!r}")
    try:
        dense_device = torch.device(dense_device)
        torch.empty(0, device=dense_device)
    except (RuntimeError, AssertionError) as exc:  # torch's "not compiled with CUDA" is one
        raise LoadError(
            f"dense_device={str(dense_device)!r} is not usable here ({exc}); pass 'cpu' or an "
            "available accelerator such as 'cuda:0'"
        ) from exc
    path = Path(path)
    if not (path / "config.json").is_file():
        raise LoadError(f"{path} has no config.json; pass a save_pretrained directory")
    where = _weight_map(path)
    config = AutoConfig.from_pretrained(path)
    quant = getattr(config, "quantization_config", None)
    fp8 = check_quantization_config(path / "config.json", quant)
    storage_name = resolve_weight_dtype(weight_dtype, fp8, path / "config.json")
    if quant is not None:
        # The dense FP8 weights are dequantised here, so the model is built (and later saved)
        # as a plain one; transformers' FP8 modules would expect the scales as parameters.
        del config.quantization_config
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    arch = find_architecture(model)
    sites = list(iter_moe_blocks(model, arch))
    mapper = _KeyMapper(model, sites)
    reader = Fp8Reader(Shards(), where, fp8)
    scale_keys = set(reader.scales.values())

    # Sort every checkpoint key: expert tensors per block, the rest by model name.
    expert_keys: dict[str, _ExpertKeys] = {s.experts_name: _ExpertKeys() for s in sites}
    dense: dict[str, str] = {}
    for key in where:
        if key in scale_keys:  # read beside its weight
            continue
        hit = mapper.expert_key(key)
        if hit is None:
            dense[mapper.rename(key)] = key
            continue
        site, slot = hit
        keys = expert_keys[site.experts_name]
        if isinstance(slot, str):
            keys.fused[slot] = key
        else:
            keys.per_expert[slot] = key

    # Experts first, one block at a time, so the meta experts never need storage. Dense
    # formats are filled in place (the transient is one expert); FP8 blocks of a FP8
    # checkpoint are read into their banks as shipped; other quantised formats quantise a
    # block the way wrap does.
    for site in sites:
        experts = getattr(site.block, arch.experts_attr)
        meta = (getattr(experts, arch.gate_up_param), getattr(experts, arch.down_param))
        spec = _expert_spec(site, experts, meta[0], meta[1])
        slots = _slots(site, expert_keys[site.experts_name], meta[0].shape[0])
        shipped_fp8 = any(reader.is_fp8(key) for key, _, _ in slots)
        if shipped_fp8 and storage_name == "fp8":
            gu_parts, dn_parts = read_fp8_bank(
                reader, slots, (tuple(meta[0].shape), tuple(meta[1].shape)), site.experts_name
            )
            fmt = Fp8Block(_DTYPES["fp8"])
            weights = kt_kernel.ExpertWeights.from_parts(spec, fmt, gu_parts, dn_parts)
            del gu_parts, dn_parts
        elif storage_name in _QUANTISED:
            gate_up, down = _assemble(slots, reader, meta, meta[0].dtype)
            weights = kt_kernel.ExpertWeights.from_fused(
                spec, gate_up, down, dtype=_DTYPES[storage_name], weight_dtype=storage_name
            )
            del gate_up, down
        else:
            gate_up, down = _assemble(slots, reader, meta, _DTYPES[storage_name])
            weights = _adopt_dense(spec, gate_up, down)
            del gate_up, down
        kernel = KernelExperts(
            weights,
            gate_up_like=_like(meta[0]),
            down_like=_like(meta[1]),
            gate_up_name=arch.gate_up_param,
            down_name=arch.down_param,
            label=site.experts_name,
            policy=policy,
        )
        setattr(site.block, arch.experts_attr, kernel)
        del weights, experts, meta

    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    unexpected = sorted(k for k in dense if k not in state)
    if unexpected:
        raise LoadError(
            f"{path}: checkpoint keys the {type(model).__name__} does not have: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    # Shard by shard, in file order.
    for name, key in sorted(dense.items(), key=lambda kv: str(where[kv[1]])):
        current = state[name]
        target = _target_dtype(model, name, current.dtype, dtype)
        t = reader.read(key, tuple(current.shape), target)
        _set_tensor(model, name, t)
        del t
    model.tie_weights()
    missing = sorted(n for n, p in model.named_parameters() if p.device.type == "meta")
    if missing:
        raise LoadError(
            f"{path}: the checkpoint has no tensor for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; it was saved from a different model"
        )
    trim_host_heap()
    if dense_device.type != "cpu":
        # Placeholders move as metadata; the kernel's storage is no module state and stays on
        # the CPU, where KernelExperts copies hidden states to and back.
        model.to(dense_device)
    return model.eval()
