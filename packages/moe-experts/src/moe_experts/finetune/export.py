"""``moe-experts export``: a checkpoint as a PEFT adapter, vLLM per-expert LoRA, or a merged model.

Every format is produced from the adapter as PEFT itself loads it onto the base model, so what
is exported is what ``PeftModel.from_pretrained`` would run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "EXPORT_FORMATS",
    "VLLM_EXTRA_MODULES",
    "VLLM_MODULES",
    "build_parser",
    "export",
    "export_main",
    "parse_shard_size",
    "vllm_tensors",
]

EXPORT_FORMATS = ("peft", "vllm", "merged")
# transformers' fused expert parameters and the per-expert projections vLLM names them by.
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# The modules exported for vLLM: attention and (shared or routed) expert projections, the
# names its loader expects for Qwen3-MoE-style models (checked against vLLM 0.34's rules in
# tests/test_generate_export.py; vLLM itself cannot be installed beside this torch). vLLM 0.34
# also lists lm_head and the router (mlp.gate) as LoRA modules there; they are left out until
# an export with them has been loaded by vLLM itself.
VLLM_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
# Multi-head latent attention as vLLM's DeepseekV2ForCausalLM (also DeepseekV3ForCausalLM and
# the V3.2 models) builds it: q_a_proj and kv_a_proj_with_mqa are the parts of its packed
# fused_qkv_a_proj (packed_modules_mapping), q_b_proj is a column-parallel linear on the
# forward path, and all three take LoRA. model_type -> modules exported beyond VLLM_MODULES.
VLLM_EXTRA_MODULES: dict[str, frozenset[str]] = {
    model_type: frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"})
    for model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v32")
}
# Modules vLLM's loader accepts but whose LoRA it would not apply; exporting them would drop
# the trained delta without a word, so they are left out with this reason.
_VLLM_NOT_APPLIED = {
    "kv_b_proj": "vLLM loads LoRA on kv_b_proj but its MLA attention never applies it (the "
    "weight is split into W_UK/W_UV when the model loads; vllm-project/vllm#48974)",
}
_NOT_VERIFIED = "vLLM's loader for this model takes no LoRA on them, or it is not verified to"


def build_parser(prog: str = "moe-experts export") -> argparse.ArgumentParser:
    """The flags of the export command."""
    p = argparse.ArgumentParser(prog=prog, description="Export a trained adapter.")
    p.add_argument(
        "checkpoint",
        type=Path,
        help="a checkpoint root (its latest checkpoint) or one checkpoint directory",
    )
    p.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        required=True,
        help="peft: the PEFT adapter directory; vllm: per-expert 2-D LoRA keys; "
        "merged: the base model with every LoRA merged in",
    )
    p.add_argument("--output", type=Path, required=True, help="directory to create")
    p.add_argument(
        "--model",
        default=None,
        help="built-in model name or local directory (default: the adapter's base)",
    )
    p.add_argument(
        "--max-shard-size",
        default="2GB",
        help="merged: the largest safetensors shard (save_pretrained's max_shard_size)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def _owner(name: str) -> str:
    """The module a (possibly nested) PEFT ParamWrapper adapts, without PEFT's prefix."""
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name.removeprefix("base_model.model.")


def vllm_tensors(
    peft_model: Any, *, fused_experts: bool = False
) -> tuple[dict[str, Any], list[str], dict[str, list[str]]]:
    """LoRA tensors from a loaded PEFT model in the layout vLLM reads for the served model.

    Modules are named as the base checkpoint names their weights (transformers' reversed
    load-time conversion, :func:`~moe_experts.finetune.vllm_serving.checkpoint_rows`), since
    vLLM loads LoRA by those names: Mixtral's experts become
    ``block_sparse_moe.experts.{e}.w1/w3/w2``. With ``fused_experts`` (a vLLM model class with
    ``is_3d_moe_weight``, e.g. GPT-OSS) the fused experts keep PEFT's ``target_parameters``
    tensors: ``<experts>.base_layer`` holds gate_up_proj (``lora_A [E*r, H]``,
    ``lora_B [2I, r*E]``, rows in the stored order, gate/up interleaved for GPT-OSS) and
    ``<experts>`` holds down_proj, whatever order PEFT nested them in. Otherwise each expert
    gets 2-D keys with A ``[r, in]`` and B ``[out, r]``: gate and up share A and take their
    rows of B (``<experts>.{e}.{gate_proj,up_proj,down_proj}``, the runtime module path, where
    the checkpoint keeps the experts fused). B carries any scaling that differs from the
    config's ``lora_alpha / r``.

    Returns:
        ``(tensors, target_modules, skipped)``: keys under ``base_model.model.``, the module
        names for ``target_modules``, and the adapted modules left out (routers, ``lm_head``,
        MLA's ``kv_b_proj``, attention of families without a verified vLLM mapping), keyed
        by the reason.
    """
    import torch
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    from moe_experts.architectures import find_architecture
    from moe_experts.errors import UnsupportedModelError
    from moe_experts.finetune.vllm_serving import (
        checkpoint_module,
        checkpoint_rows,
        conversion_twin,
    )
    from moe_experts.peft_mapping import unstack_lora_a, unstack_lora_b

    try:
        arch = find_architecture(peft_model)
    except UnsupportedModelError:  # no MoE family: only dense LoRA to export
        arch = None
    interleaved = arch is not None and arch.interleaved
    transposed = arch is not None and arch.transposed
    base_model = conversion_twin(peft_model.get_base_model())

    cfg = peft_model.peft_config["default"]
    default_scale = (cfg.lora_alpha / cfg.r**0.5) if cfg.use_rslora else cfg.lora_alpha / cfg.r
    model_type = getattr(getattr(peft_model, "config", None), "model_type", None)
    allowed = VLLM_MODULES | VLLM_EXTRA_MODULES.get(model_type, frozenset())
    out: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    skipped: dict[str, list[str]] = {}

    def put(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out[f"base_model.model.{module}.lora_A.weight"] = a.contiguous().clone()
        out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous().clone()

    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        # peft types ModuleDict items as Module; a LoRA factor's ``weight`` is a Tensor.
        a = cast("torch.Tensor", module.lora_A["default"].weight).detach()
        b = cast("torch.Tensor", module.lora_B["default"].weight).detach() * (
            module.scaling["default"] / default_scale
        )
        if isinstance(module, ParamWrapper):
            param = module.get_base_layer().get_parameter(module.parameter_name)
            owner = _owner(name)
            if param.ndim != 3 or module.parameter_name not in _FUSED:
                skipped.setdefault(_NOT_VERIFIED, []).append(f"{owner}.{module.parameter_name}")
                continue
            if fused_experts:
                # vLLM's _stack_moe_lora_weights: `.base_layer` is gate_up, the bare key down.
                stored = checkpoint_module(base_model, owner)
                gate_up = module.parameter_name == "gate_up_proj"
                put(stored + (".base_layer" if gate_up else ""), a, b)
                targets.add(stored.rsplit(".", 1)[-1])
                continue
            where = checkpoint_rows(
                base_model,
                f"{owner}.{module.parameter_name}",
                tuple(param.shape),
                out_dim=2 if transposed else 1,
            )
            if where[0].rows is None:  # the checkpoint keeps the experts fused
                # vLLM's per-expert names then hang off the runtime module path.
                projections = _FUSED[module.parameter_name]
                stored = checkpoint_module(base_model, owner)
                where = [
                    _generic_rows(stored, e, proj, k, len(projections), param, transposed)
                    for e in range(param.shape[0])
                    for k, proj in enumerate(projections)
                ]
                if interleaved:
                    where = [w._replace(rows=_interleave(w.rows, len(projections))) for w in where]
            a_e, b_e = unstack_lora_a(a, param.shape[0]), unstack_lora_b(b, param.shape[0])
            for w in where:
                put(w.key, a_e[w.expert], b_e[w.expert][w.rows])
                targets.add(w.key.rsplit(".", 1)[-1])
        else:
            owner = name.removeprefix("base_model.model.")
            leaf = owner.rsplit(".", 1)[-1]
            if leaf not in allowed:
                skipped.setdefault(_VLLM_NOT_APPLIED.get(leaf, _NOT_VERIFIED), []).append(owner)
                continue
            weight = module.get_base_layer().get_parameter("weight")
            for w in checkpoint_rows(base_model, f"{owner}.weight", tuple(weight.shape), out_dim=0):
                put(w.key, a, b if w.rows is None else b[w.rows])
                targets.add(w.key.rsplit(".", 1)[-1])
    return out, sorted(targets), skipped


def _generic_rows(
    experts: str, e: int, proj: str, k: int, parts: int, param: Any, transposed: bool
) -> Any:
    """``<experts>.{e}.{proj}`` with block ``k`` of ``parts`` of the expert's output rows."""
    import torch

    from moe_experts.finetune.vllm_serving import CheckpointRows

    n_out = param.shape[2 if transposed else 1] // parts
    return CheckpointRows(f"{experts}.{e}.{proj}", e, torch.arange(k * n_out, (k + 1) * n_out))


def _interleave(rows: Any, parts: int) -> Any:
    """Block ``k`` of ``parts`` (``[k*n, (k+1)*n)``) as every parts-th row from ``k`` instead."""
    n = len(rows)
    k = int(rows[0]) // n
    return rows.new_tensor(range(k, n * parts, parts))


def parse_shard_size(value: str | int) -> int:
    """``--max-shard-size`` in bytes: an int, or a number with TB/GB/MB/KB (``"2GB"``, ``"500MB"``).

    Raises:
        FinetuneError: the value is not such a size or is not positive.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = _SHARD_SIZE.fullmatch(str(value).strip())
        if m is None:
            raise FinetuneError(
                f"--max-shard-size {value!r}: expected a number of bytes or a number with "
                "TB, GB, MB or KB, e.g. 2GB or 500MB"
            )
        size = int(float(m["num"]) * _SIZE_UNITS[(m["unit"] or "").upper()])
    if size <= 0:
        raise FinetuneError(f"--max-shard-size {value!r}: must be more than 0 bytes")
    return size


_SHARD_SIZE = re.compile(r"(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]B)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _check_output(output: Path) -> None:
    # Refused before anything is read or written: a file at or above --output, a used one.
    for above in (output, *output.parents):
        if above.exists() and not above.is_dir():
            where = "is a file" if above == output else f"lies under {above}, which is a file"
            raise FinetuneError(
                f"--output {output}: {where}, not a directory; choose a directory path"
            )
    if output.is_dir() and any(output.iterdir()):
        raise FinetuneError(f"--output {output}: exists and is not empty; choose a new directory")


def _make_parents(parent: Path, output: Path) -> list[Path]:
    # Creates the missing parents of --output; returns those it created, deepest first.
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FinetuneError(f"--output {output}: cannot create {parent}: {exc.strerror}") from exc
    return missing


def _fsync_tree(root: Path) -> None:
    # Every file and directory of the export reaches the disk before the rename publishes it.
    for path in sorted(root.rglob("*"), reverse=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export(
    checkpoint: Path,
    fmt: str,
    output: Path,
    *,
    model: str | None = None,
    max_shard_size: str | int = "2GB",
) -> list[str]:
    """Write ``checkpoint`` to ``output`` in format ``fmt``; returns warnings for the user.

    The checkpoint is verified first (digests, as ``lora-checkpoint verify`` does). Every
    file goes into a temporary sibling directory, which one rename publishes as ``output``
    at the end: a failure leaves nothing behind, and ``output`` is complete when it exists.

    Raises:
        FinetuneError: for an unknown format or shard size, an ``output`` that is a file,
            under a file or not empty, a checkpoint that fails verification, or a write
            that fails.
    """
    if fmt not in EXPORT_FORMATS:
        raise FinetuneError(f"--format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    shard_bytes = parse_shard_size(max_shard_size)
    output = Path(os.path.abspath(output))
    _check_output(output)
    from moe_experts.finetune.adapters import verified_adapter

    src = verified_adapter(checkpoint)
    created = _make_parents(output.parent, output)
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
        notes = _write(src, fmt, tmp, model=model, max_shard_size=shard_bytes, published=output)
        _fsync_tree(tmp)
        os.rename(tmp, output)  # replaces an empty directory; refuses a non-empty one
        tmp = None
        fd = os.open(output.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise FinetuneError(
            f"--output {output}: cannot write the export ({exc.strerror or exc}); nothing was "
            "left behind"
        ) from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            for parent in created:
                with contextlib.suppress(OSError):
                    parent.rmdir()
    return notes


def _write(
    checkpoint: Path,
    fmt: str,
    output: Path,
    *,
    model: str | None,
    max_shard_size: int,
    published: Path,
) -> list[str]:
    """Write the verified checkpoint directory ``checkpoint`` into the directory ``output``.

    ``published`` is where ``output`` will be renamed to: the path the serving command names.
    """
    import lora_checkpoint
    from moe_experts.finetune.adapters import load_with_adapter, read_adapter_config

    notes: list[str] = []
    if fmt == "peft":
        for name in (lora_checkpoint.ADAPTER_CONFIG, lora_checkpoint.ADAPTER_MODEL):
            shutil.copy2(checkpoint / name, output / name)
        return notes
    loaded = load_with_adapter(model, checkpoint, verify=False)
    if fmt == "merged":
        merged = loaded.model.merge_and_unload()
        merged.save_pretrained(output, max_shard_size=max_shard_size)
        loaded.tokenizer.save_pretrained(output)
        return notes
    from safetensors.torch import save_file

    from moe_experts.finetune.vllm_serving import (
        VLLM_LORA_ARCHITECTURES,
        VLLM_VERSION,
        base_architecture,
        serving_info,
    )

    cfg = read_adapter_config(loaded.checkpoint)
    serving = serving_info(
        base_architecture(str(loaded.base), loaded.model),
        str(loaded.base),
        published,
        name=published.name,
        rank=cfg["r"],
    )
    tensors, targets, skipped = vllm_tensors(loaded.model, fused_experts=serving.is_3d_lora_weight)
    cfg.update(
        {
            "target_modules": targets,
            "target_parameters": None,
            "base_model_name_or_path": str(loaded.base),
        }
    )
    save_file(tensors, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})
    (output / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    serving.write(output)
    known = VLLM_LORA_ARCHITECTURES.get(serving.architecture or "")
    if known is not None and known.issue is not None:
        notes.append(f"vLLM {VLLM_VERSION} does not load this adapter: {known.issue}")
    if not serving.vllm_lora_model:
        notes.append(
            f"vLLM {VLLM_VERSION}'s model registry maps architecture {serving.architecture!r} "
            "to no model that takes LoRA; the adapter is written in vLLM's per-expert 2-D "
            "layout, which no vLLM release checked here loads for this model"
        )
    for reason, modules in skipped.items():
        notes.append(
            f"LoRA on {len(modules)} trained module(s) is left out of the vLLM export "
            f"({reason}): " + ", ".join(modules) + "; --format merged or --format "
            "peft keeps them"
        )
    return notes


def export_main(argv: Sequence[str] | None = None) -> int:
    """The ``moe-experts export`` command; returns the exit code."""
    from moe_experts.finetune.cli import report_error

    ns = build_parser().parse_args(argv)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
        notes = export(
            ns.checkpoint, ns.format, ns.output, model=ns.model, max_shard_size=ns.max_shard_size
        )
    except FinetuneError as exc:
        return report_error(exc, debug=ns.debug)
    for note in notes:
        # A trained part that the export does not carry is a warning, on stderr.
        print(f"warning: {note}", file=sys.stderr)
    print(f"exported {ns.format}: {ns.output}")
    if ns.format == "vllm":
        from moe_experts.finetune.vllm_serving import SERVING_FILE

        serving = json.loads((ns.output / SERVING_FILE).read_text())
        print(f"serve it with: {serving['command_line']}")
    return 0
