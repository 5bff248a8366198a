"""A block's experts in a checkpoint: which keys hold them, and reading them in kernel layout.

:class:`KeyMapper` maps checkpoint keys to model names with transformers' own renamings and
expert converters (per-expert 2-D keys or fused 3-D ones); :func:`assemble` reads a block's
experts into ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` buffers, and :func:`shipped_parts`
adopts a quantised checkpoint's parts as shipped. :mod:`moe_experts.loading` drives them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

import kt_kernel
from moe_experts.architectures import MoEBlockSite
from moe_experts.errors import LoadError
from moe_experts.shipped_checkpoint import ShippedReader

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ExpertKeys",
    "KeyMapper",
    "assemble",
    "expert_slots",
    "per_expert_key",
    "read_biases",
    "shipped_parts",
]

_PER_EXPERT = re.compile(r"^(\d+)\.(.+)$")
# Per-expert nn.Linear weights ([I, H] gate and up, [H, I] down) under their usual names.
_LINEAR_ROLES = {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down"}


def _where(reader: ShippedReader) -> str:
    """The checkpoint directory, for a message about a tensor it lacks."""
    dirs = sorted({str(p.parent) for p in reader.where.values()})
    return dirs[0] if len(dirs) == 1 else "the checkpoint"


def _missing(reader: ShippedReader, name: str, what: str) -> LoadError:
    """The error for a tensor of experts module ``name`` that the checkpoint lacks."""
    return LoadError(
        f"{name}: {_where(reader)} has no {what}; the checkpoint is incomplete or was saved "
        "from a different model (compare its model.safetensors.index.json with the config)"
    )


@dataclass
class ExpertKeys:
    """Where one experts module's weights are in the checkpoint."""

    # stored parameter name (gate_up_proj, down_proj, a bias) -> key
    fused: dict[str, str] = field(default_factory=dict)
    # (expert, "gate" | "up" | "down") -> key
    per_expert: dict[tuple[int, str], str] = field(default_factory=dict)
    # fused parameter -> the two dims swapped between the stored and the model's layout
    # (Qwen3-VL-MoE ships gate_up [E, H, 2I] and down [E, I, H]; its model holds [E, 2I, H])
    transposed: dict[str, tuple[int, int]] = field(default_factory=dict)


class KeyMapper:
    """Checkpoint key -> model key, with transformers' own renamings and expert converters."""

    def __init__(self, model: nn.Module, sites: list[MoEBlockSite]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        # Only transformers models reach here; ``model`` is typed as a plain module.
        transforms = get_model_conversion_mapping(cast("PreTrainedModel", model))
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._sites = {s.experts_name + ".": s for s in sites}
        self._names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._names.update(n for n, _ in model.named_buffers(remove_duplicate=False))

    def rename(self, key: str) -> str:
        """Apply every renaming (e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``).

        As transformers does, a key the model already has is kept when the renamings would
        turn it into one it lacks (DeepSeek-V4's ``.norm.`` -> ``.kv_norm.`` also matches the
        final ``model.norm.weight``).
        """
        from transformers.core_model_loading import rename_source_key

        renamed = rename_source_key(key, self._renamings, [])[0]
        if renamed not in self._names and key in self._names:
            return key
        return renamed

    def stored_transpose(
        self, key: str, stored: tuple[int, ...], model: tuple[int, ...]
    ) -> tuple[int, int] | None:
        """The dims transformers swaps to load fused expert ``key``, or ``None``.

        A family whose converter is one ``Transpose`` (Qwen3-VL-MoE's hub experts) is read
        as ``from_pretrained`` reads it: with ``check_dims``, a tensor already of the model's
        shape ``model`` is kept as stored (``stored`` is the checkpoint's shape).
        """
        from transformers.core_model_loading import Transpose

        renamed = self.rename(key)
        for conv in self._converters:
            if conv.rename_source_key(renamed)[1] is None:
                continue
            ops = conv.operations
            if len(ops) != 1 or not isinstance(ops[0], Transpose):
                return None
            if ops[0].check_dims and tuple(stored) == tuple(model):
                return None
            return ops[0].dim0, ops[0].dim1
        return None

    def _role(self, site: MoEBlockSite, renamed: str, proj: str) -> str | None:
        """``"gate"``/``"up"``/``"down"`` of a per-expert key ``<e>.<proj>``.

        From transformers' converters where they name the key; else from the usual
        ``gate_proj``/``up_proj``/``down_proj`` ``.weight`` names. Those are what the FP8
        releases of families with fused bf16 checkpoints ship (Qwen3-VL-MoE's), where
        transformers has no converter for them.
        """
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
        if arch.bias_params:  # per-expert biases have no usual names to follow
            return None
        return _LINEAR_ROLES.get(proj)

    def expert_key(self, key: str) -> tuple[MoEBlockSite, tuple[int, str] | str] | None:
        """``(site, (expert, role))`` / ``(site, stored parameter name)`` for an expert key.

        Returns ``None`` for a key outside every experts module.

        Raises:
            LoadError: a key under an experts module that is neither layout.
        """
        renamed = self.rename(key)
        for prefix, site in self._sites.items():
            if not renamed.startswith(prefix):
                continue
            rest = renamed[len(prefix) :]
            if rest in site.arch.stored_shapes(0, 0, 0):  # gate_up, down and any bias
                return site, rest
            match = _PER_EXPERT.match(rest)
            role = self._role(site, renamed, match.group(2)) if match else None
            if match is None or role is None:
                raise LoadError(
                    f"checkpoint key {key!r} is under {site.experts_name} but is neither a fused "
                    f"{site.arch.gate_up_param}/{site.arch.down_param} tensor nor a per-expert "
                    "gate/up/down weight (<expert>.gate_proj.weight, .up_proj.weight, "
                    ".down_proj.weight, or a name this family's transformers converter knows)"
                )
            return site, (int(match.group(1)), role)
        return None


def per_expert_key(
    keys: ExpertKeys, reader: ShippedReader, name: str, e: int, x: int, role: str
) -> str:
    """The checkpoint key of expert ``x``'s ``role`` weight; a missing one names what is there."""
    key = keys.per_expert.get((x, role))
    if key is None:
        raise LoadError(
            f"{name}: {_where(reader)} has no {role} weight for expert {x} (expected "
            f"a key like '{name}.{x}.<{role} proj>.weight'); it holds "
            f"{len(keys.per_expert)} of the {3 * e} per-expert tensors"
        )
    return key


def expert_slots(
    site: MoEBlockSite, keys: ExpertKeys, reader: ShippedReader, e: int
) -> list[tuple[str, str, int | None]]:
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
        for part, param in (("gate_up", site.arch.gate_up_param), ("down", site.arch.down_param)):
            key = keys.fused.get(param)
            if key is None:
                raise _missing(reader, name, f"fused tensor for '{name}.{param}'")
            out.append((key, part, None))
        return out
    for x in range(e):
        for role in ("gate", "up", "down"):
            key = per_expert_key(keys, reader, name, e, x, role)
            out.append((key, role, x))
    # Down last, so the first and last slots name one tensor of each bank.
    return sorted(out, key=lambda slot: slot[1] == "down")


def assemble(
    site: MoEBlockSite,
    keys: ExpertKeys,
    reader: ShippedReader,
    meta: dict[str, torch.Tensor],
    storage: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One block's ``gate_up [E, 2I, H]``, ``down [E, H, I]`` (kernel layout) and biases.

    Each tensor is first cast to the model dtype (what ``from_pretrained`` holds), then to
    ``storage`` (what ``wrap`` copies it to), so the values are exactly those of that path. A
    family with another stored layout (``MoEArchitecture.transposed``/``interleaved``) is
    converted while copying into the kernel-layout buffers; biases stay in the stored order,
    in the model dtype (``wrap`` reads them from the module).
    """
    arch = site.arch
    gu_meta = meta[arch.gate_up_param]
    e, inter, h = arch.expert_dims(gu_meta)
    model_dtype = gu_meta.dtype
    name = site.experts_name
    if keys.fused and keys.per_expert:
        raise LoadError(
            f"{name}: the checkpoint holds both fused ({sorted(keys.fused.values())[0]!r}) "
            "and per-expert keys; it must use one layout per experts module"
        )
    gate_up = torch.empty((e, 2 * inter, h), dtype=storage)
    down = torch.empty((e, h, inter), dtype=storage)
    biases: dict[str, torch.Tensor] = {}
    for param in arch.bias_params:
        key = keys.fused.get(param)
        if key is None:
            raise _missing(reader, name, f"tensor for '{name}.{param}'")
        biases[param] = reader.read(key, tuple(meta[param].shape), model_dtype)
    if keys.fused.keys() - set(arch.bias_params):
        for param, dst in (
            # torch: Tensor.unflatten is unannotated
            (arch.gate_up_param, gate_up.unflatten(1, (2, inter))),  # type: ignore[no-untyped-call]
            (arch.down_param, down),
        ):
            key = keys.fused.get(param)
            if key is None:
                raise _missing(reader, name, f"fused tensor for '{name}.{param}'")
            gu = param == arch.gate_up_param
            if reader.ships(key):  # dequantised parts: [E, out, in], rows in the family's order
                shape = (e, 2 * inter, h) if gu else (e, h, inter)
                t = reader.read(key, shape, model_dtype)
                view = arch.kernel_rows(t, dim=1).reshape(e, 2, inter, h) if gu else t
            else:
                dims = keys.transposed.get(param)
                if dims is None:
                    t = reader.read(key, tuple(meta[param].shape), model_dtype)
                else:  # stored transposed: read so, viewed in the model's layout
                    stored = list(meta[param].shape)
                    stored[dims[0]], stored[dims[1]] = stored[dims[1]], stored[dims[0]]
                    try:
                        t = reader.read(key, tuple(stored), model_dtype).transpose(*dims)
                    except LoadError as exc:
                        raise LoadError(
                            f"{exc} (stored transposed, as {arch.family} hub checkpoints ship "
                            f"it: the model's {list(meta[param].shape)} with dims {dims} swapped)"
                        ) from exc
                view = arch.kernel_gate_up(t) if gu else arch.kernel_down(t)
            dst.copy_(view)
            del t, view
        return gate_up, down, biases
    for x in range(e):
        for role, dst in (
            ("gate", gate_up[x, :inter]),
            ("up", gate_up[x, inter:]),
            ("down", down[x]),
        ):
            key = per_expert_key(keys, reader, name, e, x, role)
            t = reader.read(key, tuple(dst.shape), model_dtype)
            dst.copy_(t)
            del t
    return gate_up, down, biases


def read_biases(
    site: MoEBlockSite,
    keys: ExpertKeys,
    reader: ShippedReader,
    meta: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """The block's biases as stored (model dtype), and as ``from_parts`` takes them.

    Raises:
        LoadError: a bias the family has is missing.
    """
    arch = site.arch
    model_dtype = meta[arch.gate_up_param].dtype
    stored: dict[str, torch.Tensor] = {}
    for param in arch.bias_params:
        key = keys.fused.get(param)
        if key is None:
            raise _missing(reader, site.experts_name, f"tensor for '{site.experts_name}.{param}'")
        stored[param] = reader.read(key, tuple(meta[param].shape), model_dtype)
    gate_up_bias = stored.get(arch.gate_up_bias_param or "")
    if gate_up_bias is not None:
        gate_up_bias = arch.kernel_rows(gate_up_bias, dim=1)
    return stored, {
        "gate_up_bias": gate_up_bias,
        "down_bias": stored.get(arch.down_bias_param or ""),
    }


def shipped_parts(
    site: MoEBlockSite,
    keys: ExpertKeys,
    reader: ShippedReader,
    spec: kt_kernel.ExpertSpec,
    fmt: kt_kernel.WeightFormat,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A block's experts as shipped: the checkpoint's parts adopted as ``fmt``'s, in kernel order.

    Shipped parts are ``[E, out, in]`` whatever the model parameter's orientation, so only the
    row order of gate_up changes (``fmt.select_rows``, for interleaved gate/up). Per-expert
    keys are read expert by expert into banks (``fmt.fuse_gate_up`` stacks gate and up).

    Raises:
        LoadError: naming the key: an expert tensor that is not shipped in the format, parts
            that do not fit, or gate/up the format cannot fuse or reorder.
    """
    arch, name = site.arch, site.experts_name
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    slots = expert_slots(site, keys, reader, e)
    for key, _, _ in slots:
        if not reader.ships(key):
            dtype = reader.shards.info(reader.where[key], key)[1]
            if dtype.is_floating_point and dtype.itemsize == 1:  # 8-bit floats, no scales
                raise reader.missing_parts(key, dtype)
            raise LoadError(
                f"{reader.file(key).name}: expert tensor {key!r} is {dtype}; the experts of a "
                f"{fmt.weight_dtype} checkpoint must all be shipped as its parts"
            )
    try:
        if all(x is None for _, _, x in slots):
            gu_key, dn_key = slots[0][0], slots[1][0]
            gate_up = reader.read_parts(gu_key)
            if arch.interleaved:
                order = arch.kernel_rows(torch.arange(2 * i).unsqueeze(0), dim=1)[0]
                gate_up = fmt.select_rows(gate_up, order)
            return gate_up, reader.read_parts(dn_key)
        specs = (fmt.part_specs(2 * i, h), fmt.part_specs(h, i))
        banks = tuple(
            tuple(torch.empty((e, *shape), dtype=dtype) for _, shape, dtype in sp) for sp in specs
        )
        parts: dict[tuple[str, int | None], tuple[torch.Tensor, ...]] = {}
        for key, role, x in slots:
            parts[(role, x)] = reader.read_parts(key)
            if role == "down":
                expert = parts.pop((role, x))
                dst = banks[1]
            elif ("gate", x) in parts and ("up", x) in parts:
                expert = fmt.fuse_gate_up(parts.pop(("gate", x)), parts.pop(("up", x)))
                dst = banks[0]
            else:
                continue
            for bank, src in zip(dst, expert, strict=True):
                bank[x].copy_(src.reshape(bank[x].shape))
        return banks[0], banks[1]
    except kt_kernel.KernelInputError as exc:
        raise LoadError(
            f"{name}: the {fmt.weight_dtype} experts of {arch.family} cannot be kept as shipped "
            f"({exc}); load with weight_dtype='bf16' to dequantise them"
        ) from exc


def streams_with_installed_transformers(model_type: str | None) -> bool:
    """Whether ``load_pretrained`` follows this transformers' expert conversions for the type.

    Before transformers' ``Transpose`` gained ``check_dims`` (5.1 has none), Qwen3-VL-MoE's
    experts had another model layout and conversion chain, which the streaming reader does not
    follow; callers then load whole and wrap (the CLI does).
    """
    import inspect

    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose

    if "check_dims" in inspect.signature(Transpose.__init__).parameters:
        return True
    converters = get_checkpoint_conversion_mapping(model_type) or []  # type: ignore[no-untyped-call]
    return not any(
        isinstance(op, Transpose) for c in converters for op in getattr(c, "operations", [])
    )
