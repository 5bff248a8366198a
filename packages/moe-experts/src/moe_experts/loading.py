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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

import kt_kernel
from moe_experts._safetensors import Shards, weight_map
from moe_experts.architectures import (
    MoEBlockSite,
    checkpoint_model_type,
    find_architecture,
    iter_moe_blocks,
    lm_class,
    require_transformers,
)
from moe_experts.checkpoint_experts import (
    ExpertKeys,
    KeyMapper,
    assemble,
    read_biases,
    shipped_parts,
    streams_with_installed_transformers,
)
from moe_experts.dense_conversions import DenseConversions, read_stored
from moe_experts.errors import LoadError, TransformersVersionError
from moe_experts.kernel_experts import KernelExperts, Policy
from moe_experts.memory import trim_host_heap
from moe_experts.self_check import BlockCheck
from moe_experts.sharing import default_kernel_threads, expert_sharing
from moe_experts.shipped_checkpoint import ShippedReader, shipped_format
from moe_experts.storage import StoragePlan, build_block, check_policy, storage_name
from moe_experts.validation import (
    check_expert_count,
    check_load_fits,
    check_model_type,
    check_sizes,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CheckpointSource", "load_pretrained"]

# GLM-4.5V: model.language_model.layers.N (its causal-LM siblings: model.layers.N)
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device; buffers stay real (rotary tables)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            # Freshly created by torch.empty and never touched: no page was ever resident.
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _like(meta: torch.Tensor) -> torch.Tensor:
    """A CPU tensor description of ``meta`` for the placeholder (no storage is touched)."""
    return torch.empty(1, dtype=meta.dtype).expand(meta.shape)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = cast(nn.Parameter, module._parameters[leaf])
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


class CheckpointSource:
    """The :class:`~moe_experts.storage.ExpertSource` of ``load_pretrained``: a checkpoint.

    The block's experts module was built on the meta device; its tensors are read from the
    checkpoint straight into kernel storage: dense formats are filled in place (the
    transient is one expert), quantised ones from one block in the model dtype, and the
    experts of a quantised checkpoint are adopted as shipped when the plan stores them in the
    shipped format. There is no original module to self-check against; the kernel replaces
    the meta module.
    """

    def __init__(self, site: MoEBlockSite, keys: ExpertKeys, reader: ShippedReader) -> None:
        """The block at ``site``, whose checkpoint keys are ``keys``, read through ``reader``."""
        self.site = site
        self.keys = keys
        self.reader = reader
        arch = site.arch
        self._module: nn.Module = getattr(site.block, arch.experts_attr)
        self._meta = {p: getattr(self._module, p) for p in arch.stored_shapes(0, 0, 0)}

    @property
    def module(self) -> nn.Module:
        """The experts module on the meta device."""
        return self._module

    def stored(self) -> dict[str, torch.Tensor]:
        """CPU descriptions of the meta tensors (shape and dtype; no storage is touched)."""
        return {p: _like(t) for p, t in self._meta.items()}

    def _ships(self, fmt: kt_kernel.WeightFormat) -> bool:
        """Whether the checkpoint holds this block's experts in ``fmt`` already."""
        shipped = self.reader.shipped
        keys = [*self.keys.fused.values(), *self.keys.per_expert.values()]
        return (
            shipped is not None
            and fmt.weight_dtype == shipped.name
            and any(self.reader.ships(k) for k in keys)
        )

    def kernel_weights(
        self, spec: kt_kernel.ExpertSpec, fmt: kt_kernel.WeightFormat
    ) -> kt_kernel.ExpertWeights:
        """The block's experts read from the checkpoint into kernel storage in ``fmt``."""
        site, arch = self.site, self.site.arch
        if self._ships(fmt):  # the checkpoint's own parts (bytes and scales), as shipped
            _, bias_kw = read_biases(site, self.keys, self.reader, self._meta)
            gu_parts, dn_parts = shipped_parts(site, self.keys, self.reader, spec, fmt)
            return kt_kernel.ExpertWeights.from_parts(spec, fmt, gu_parts, dn_parts, **bias_kw)
        dense = isinstance(fmt, kt_kernel.Dense)
        model_dtype = self._meta[arch.gate_up_param].dtype
        storage = fmt.compute_dtype if dense else model_dtype
        gate_up, down, biases = assemble(site, self.keys, self.reader, self._meta, storage)
        gate_up_bias = biases.get(arch.gate_up_bias_param or "")
        if gate_up_bias is not None:
            gate_up_bias = arch.kernel_rows(gate_up_bias, dim=1)
        down_bias = biases.get(arch.down_bias_param or "")
        if dense:  # already filled in the storage dtype: adopted without a copy
            return kt_kernel.ExpertWeights.from_parts(
                spec, fmt, (gate_up,), (down,), gate_up_bias=gate_up_bias, down_bias=down_bias
            )
        return kt_kernel.ExpertWeights.from_fused(
            spec,
            gate_up,
            down,
            dtype=fmt.compute_dtype,
            weight_dtype=fmt,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
        )

    def check(self, kernel: KernelExperts) -> BlockCheck | None:
        """Nothing to check against: the original module never held weights."""
        return None

    def install(self, kernel: KernelExperts) -> bool:
        """Replace the meta experts module by ``kernel``."""
        setattr(self.site.block, self.site.arch.experts_attr, kernel)
        return False


def _mtp_layers(model: nn.Module, config: Any) -> Callable[[str], bool]:
    """Whether a checkpoint key is in a multi-token-prediction layer the model never builds.

    DeepSeek-V3 and GLM-4.5 ship it as the layer after the last, and their classes ignore it
    by its released index (``model\\.layers\\.61.*``); this is that rule at any depth: the
    ``num_nextn_predict_layers`` (at least one) layers after ``num_hidden_layers``.
    """
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    if not any(re.search(r"layers\\\.\d", p) for p in patterns):
        return lambda key: False
    text = config.get_text_config()
    first = int(text.num_hidden_layers)
    count = getattr(text, "num_nextn_predict_layers", None) or getattr(text, "num_mtp_layers", None)
    layers = range(first, first + int(count or 1))

    def beyond(key: str) -> bool:
        match = _LAYER.match(key)
        return match is not None and int(match.group(1)) in layers

    return beyond


def load_pretrained(
    path: str | Path,
    *,
    weight_dtype: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    dense_device: str | torch.device = "cpu",
    policy: Policy = "save",
    share_experts: bool | None = None,
) -> nn.Module:
    """Build a model with its LM head from a local checkpoint, experts streamed onto kt-kernel.

    Equivalent to ``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` followed by
    :func:`moe_experts.wrap` ``(model, weight_dtype=weight_dtype, policy=policy)``, bitwise, but
    without ever holding the model's experts in ``dtype``: at most one MoE block's experts are
    resident beyond the final footprint. Checkpoint experts may be per-expert 2-D keys (as hub
    checkpoints ship them, e.g. ``mlp.experts.{e}.gate_proj.weight``) or fused 3-D tensors,
    also stored transposed where transformers' converter transposes them (Qwen3-VL-MoE).

    A multimodal checkpoint that transformers maps to no causal LM (Qwen3-VL-MoE, GLM-4.5V,
    Aria, Mistral-Large-3; and Mistral 4) is built with ``AutoModelForImageTextToText``
    (:func:`moe_experts.architectures.lm_class`) and equals its ``from_pretrained`` + ``wrap``:
    the vision tower loads like any dense weight, the experts stream.

    FP8-block checkpoints (DeepSeek-V3 style: ``weight`` in float8_e4m3fn plus
    ``weight_scale_inv`` per 128x128 block, ``quantization_config`` ``quant_method: fp8`` in
    ``config.json``) keep their experts' bytes and scales as kt-kernel's FP8 format (nothing
    is re-quantised and no bf16 copy is made), and GPT-OSS's MXFP4 checkpoints
    (``*_blocks``/``*_scales``, ``quant_method: mxfp4``) keep theirs as its MXFP4 format: any
    format of :data:`kt_kernel.FORMATS` that checkpoints ship is read through its own
    ``checkpoint_suffixes`` and ``from_checkpoint``. Their dense FP8 weights are dequantised to
    ``dtype`` as transformers does (``weight * scale_inv`` in fp32, rounded once).

    Args:
        path: a local directory with ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``.
        weight_dtype: kernel storage, a name in :data:`kt_kernel.FORMATS` or ``"auto"``.
            ``"auto"``: the checkpoint's own format (``"fp8"``/``"mxfp4"`` for a FP8/MXFP4
            checkpoint, the shipped bytes; else dense in its dtype: ``"fp32"`` for float32,
            otherwise ``"bf16"``). ``None`` (default): the shipped format of a quantised
            checkpoint, else ``"bf16"``. ``"bf16"``/``"fp32"``: dense storage (a quantised
            checkpoint is dequantised while streaming). ``"int8"``/``"int4"``/``"fp8"``/
            ``"mxfp4"`` quantise an unquantised checkpoint as ``wrap`` does; a quantised
            checkpoint is never quantised a second time.
        dtype: the model dtype (dense weights, and what ``from_pretrained`` would give experts).
        dense_device: device of the dense (non-expert) weights, e.g. ``"cuda:0"``; the experts
            stay on the CPU kernel and hidden states cross over and back (autograd too).
        policy: kt-kernel activation policy, ``"save"`` or ``"recompute"``.
        share_experts: as in :func:`moe_experts.wrap`: under torchrun only local rank 0 reads
            the checkpoint's experts, into one shared copy per machine (``False``: per rank).

    Returns:
        The model in eval mode, every supported MoE block's experts on the kernel.

    Raises:
        LoadError: missing files, a missing or mis-shaped tensor, a FP8 weight without a valid
            128x128 scale grid (naming the key and file), an unsupported
            ``quantization_config``, or ``"int8"``/``"int4"`` for a FP8 checkpoint; hostile
            or corrupt input, before it is used: an invalid safetensors header or index,
            NaN/inf or integer weights, negative/NaN/inf FP8 scales (naming file and tensor),
            a ``config.json`` whose ``model_type``, sizes, expert count or experts per token
            are invalid or disagree with the checkpoint (naming the key), or a load needing
            more than 90% of the available host memory (naming both figures).
        UnsupportedModelError: the checkpoint is not a supported MoE family.
        TransformersVersionError: the installed transformers is older than the family needs,
            or converts this type's stored experts in a way the streaming reader does not follow
            (Qwen3-VL-MoE before transformers 5.17).
        WrapError: an unknown ``weight_dtype``/``policy`` or an unsupported activation.
    """
    from transformers import AutoConfig

    # Bad arguments fail before any file is read.
    weight_dtype = storage_name(weight_dtype) if weight_dtype is not None else None
    check_policy(policy)
    try:
        dense_device = torch.device(dense_device)
        torch.empty(0, device=dense_device)
    except (RuntimeError, AssertionError) as exc:  # torch's "not compiled with CUDA" is one
        raise LoadError(
            f"dense_device={str(dense_device)!r} is not usable here ({exc}); pass 'cpu' or an "
            "available accelerator such as 'cuda:0'"
        ) from exc
    path = Path(path)
    config_file = path / "config.json"
    model_type = checkpoint_model_type(path)  # LoadError: no readable config.json
    require_transformers(model_type)
    if not streams_with_installed_transformers(model_type):
        import transformers

        raise TransformersVersionError(
            f"{config_file}: streaming the experts of {model_type!r} needs a transformers whose "
            f"checkpoint conversion this loader follows (5.17 and later); transformers "
            f"{transformers.__version__} converts them another way. Upgrade with: pip install -U "
            "'transformers>=5.17', or load the model whole with from_pretrained and call "
            "moe_experts.wrap"
        )
    check_model_type(config_file, model_type)
    shards = Shards()
    where = weight_map(path, shards)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's StrictDataclassError
        raise LoadError(f"{config_file}: transformers refuses it: {exc}") from exc
    check_sizes(config, config_file)
    quant = getattr(config, "quantization_config", None)
    shipped = shipped_format(config_file, quant)
    plan = StoragePlan.for_checkpoint(path, weight_dtype, policy=policy)
    if quant is not None:
        # Shipped dense weights are dequantised here, so the model is built (and later saved)
        # as a plain one; transformers' quantised modules would expect the parts as parameters.
        del config.quantization_config
    # A lossy format the checkpoint ships is adopted as shipped; any other one is quantised.
    quantising = plan.format.lossy and not (
        shipped is not None and plan.format.weight_dtype == shipped.name
    )
    counts = check_load_fits(
        config,
        config_file,
        dtype,
        plan,
        quantising=quantising,
        dense_device=dense_device,
        share_experts=share_experts,
    )
    with _parameters_on_meta():
        # transformers: _BaseAutoModelClass.from_config is unannotated
        model: PreTrainedModel = lm_class(model_type).from_config(config, dtype=dtype)
    arch = find_architecture(model)
    sites = list(iter_moe_blocks(model, arch))
    mapper = KeyMapper(model, sites)
    reader = ShippedReader(shards, where, shipped)  # the shards whose headers were validated

    # Sort every checkpoint key: expert tensors per block, dense ones transformers converts
    # (fused, split) per target, the rest by model name.
    expert_keys: dict[str, ExpertKeys] = {s.experts_name: ExpertKeys() for s in sites}
    dense: dict[str, str] = {}
    converted = DenseConversions(model)
    for key in reader.param_keys():  # a shipped parameter once, by its name (its parts beside it)
        hit = mapper.expert_key(key)
        if hit is None:
            renamed = mapper.rename(key)
            if not converted.claim(renamed, key):
                dense[renamed] = key
            continue
        site, slot = hit
        keys = expert_keys[site.experts_name]
        if isinstance(slot, str):
            keys.fused[slot] = key
            if not reader.ships(key):
                stored = shards.info(where[key], key)[0]
                model_shape = getattr(getattr(site.block, site.arch.experts_attr), slot).shape
                dims = mapper.stored_transpose(key, stored, tuple(model_shape))
                if dims is not None:
                    keys.transposed[slot] = dims
        else:
            keys.per_expert[slot] = key

    # A shipped parameter is counted by its first part (FP8's weight, MXFP4's blocks).
    first = {k: reader.parts.get(k, (k,))[0] for k in reader.param_keys()}
    for site in sites:  # before any block's storage exists
        keys = expert_keys[site.experts_name]
        per_expert = {slot: first[k] for slot, k in keys.per_expert.items()}
        fused = {p: first[k] for p, k in keys.fused.items()}
        check_expert_count(site, per_expert, fused, shards, where, counts)

    # Experts first, one block at a time, so the meta experts never need storage.
    default_kernel_threads()
    # Every rank leaves the loop together: an error on one is an error on all, sockets closed.
    with expert_sharing(share_experts) as sharing:  # only its writers read the experts
        for site in sites:
            source = CheckpointSource(site, expert_keys[site.experts_name], reader)
            build_block(site, source, plan, sharing)
            del source

    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    # Keys the model class declares it does not load (DeepSeek-V4's multi-token-prediction
    # ``mtp.*`` layers, DeepSeek-V3's extra layer), skipped as from_pretrained skips them.
    ignored = [re.compile(p) for p in model._keys_to_ignore_on_load_unexpected or ()]
    mtp = _mtp_layers(model, config)
    dense = {
        n: k
        for n, k in dense.items()
        if n in state or not (any(r.search(n) or r.search(k) for r in ignored) or mtp(k))
    }
    unexpected = sorted(k for k in dense if k not in state)
    if unexpected:
        raise LoadError(
            f"{path}: checkpoint keys the {type(model).__name__} does not have: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    # Shard by shard, in file order.
    for name, key in sorted(dense.items(), key=lambda kv: str(reader.file(kv[1]))):
        current = state[name]
        target = _target_dtype(model, name, current.dtype, dtype)
        t = reader.read(key, tuple(current.shape), target)
        _set_tensor(model, name, t)
        del t

    def read_source(key: str, target: str) -> torch.Tensor:
        return read_stored(reader, key, _target_dtype(model, target, state[target].dtype, dtype))

    for name, t in converted.tensors(read_source, reader.file):
        _set_tensor(model, name, t)
        del t
    # As from_pretrained ties: only a head the checkpoint lacks (or ships equal to the
    # embeddings); a different shipped head is kept, whatever tie_word_embeddings says.
    meta = {n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"}
    model.tie_weights(missing_keys=meta, recompute_mapping=False)
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
        # transformers wraps PreTrainedModel.to/.eval, which loses their signatures.
        model.to(dense_device)  # type: ignore[arg-type]
    return model.eval()  # type: ignore[no-untyped-call, no-any-return]
