"""A fine-tune run's settings: defaults, ``--config`` files and flags resolved (no torch).

A run is described by :class:`FinetuneArgs`. Its values come, in rising priority, from the
defaults here, one YAML file (``--config``) and the command-line flags. The YAML file has one
section per group of :data:`OPTIONS` (``model``, ``data``, ``training``, ``output``) plus
``lora`` (fields of :class:`lora_core.LoraConfig`, applied over :data:`DEFAULT_LORA`); the
older form ``models.<role>.lora`` (a complete LoRA config) is still read. Unknown keys anywhere
are errors that suggest the nearest known key. ``--print-config`` renders the resolved run in
the same YAML shape, so its output is itself a valid ``--config`` file.

Adding a setting is one row in :data:`OPTIONS` (``finetune/options.py``) and one field in
:class:`FinetuneArgs`; a row of section ``lora`` (``--lora-rank``) needs no field: it
overrides that key of ``lora``.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moe_experts.finetune.documents import load_config_yaml
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.options import OPTIONS, Option, check_seed

__all__ = [
    "DEFAULT_LORA",
    "OPTIONS",
    "ROLE_DEFAULT",
    "SECTIONS",
    "FinetuneArgs",
    "Option",
    "check_seed",
    "default_value",
    "lora_config",
    "read_config_file",
    "render_config",
    "resolve_args",
]

DEFAULT_LORA: dict[str, Any] = {
    "enable": True,
    "rank": 8,
    "alpha": 16,
    # "auto" is resolved against the loaded model (finetune/targets.py): the attention
    # projections here, every router (a bare weight: LoRAParameter) below. lm_head too: the
    # built-in model is random, and a frozen random head caps its logits.
    "target_modules": ["auto", "lm_head"],
    "target_parameters": ["auto"],
    "init_seed": 0,
}

SECTIONS = ("model", "data", "training", "lora", "output")
ROLE_DEFAULT = "moe"  # the models.<role> block read when --role is not given


@dataclass
class FinetuneArgs:
    """Everything one fine-tune run needs; filled from defaults, ``--config`` and flags."""

    model: str = "tiny-qwen3-moe"
    weight_dtype: str = "auto"  # "auto" (the checkpoint's own format) or a kt_kernel.FORMATS name
    # Under torchrun with several local ranks: one copy of the frozen experts per machine
    # (True), one per rank (False); None shares unless MOE_EXPERTS_SHARE_EXPERTS=0.
    share_experts: bool | None = None
    # CPU models on transformers' SDPA run plain causal attention on kt-kernel's op instead.
    kernel_attention: bool = True
    # RMSNorms on kt-kernel's fused op where a probe shows it reproduces them (CPU calls only).
    kernel_norms: bool = True
    # Dense layers, LoRA and optimizer state: "cuda" (cuda:LOCAL_RANK), "cpu", or "auto" (CUDA
    # when torch sees one). The routed experts always stay in the host kernel.
    device: str = "auto"
    gpu_experts: int = 0  # per MoE layer, the N most-routed experts resident on the GPU
    overlap: bool | None = None  # host experts beside independent GPU work; None: on with CUDA
    data: Path | None = None  # None: the corpus shipped in the package
    data_format: str | None = None  # a key of formats.DATA_FORMATS; None: detected per file
    train_on_prompt: bool = False  # chat/instruction data: loss on every token, not replies only
    eval_data: Path | None = None
    eval_split: float | None = None  # a fraction of --data held out for evaluation
    seq_len: int = 64
    steps: int = 60
    lr: float = 3e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    batch_size: int = 8  # global per optimizer step, across ranks and accumulation
    grad_accum: int = 1  # micro-batches per optimizer step (memory, not the batch's size)
    max_grad_norm: float = 1.0
    # chunked: loss from the last hidden state and the head weight, a chunk of rows at a time
    # (no fp32 [tokens, vocab] logits); full: from model(...).logits. Families whose logits
    # are not a plain lm_head (soft-capping, logit scales) always use full.
    loss: str = "chunked"
    gradient_checkpointing: bool = False  # recompute decoder layers (not the host experts)
    lora_dtype: str = "fp32"  # LoRA factors, their gradients and AdamW state
    # After the first backward a trainable parameter without a finite, non-zero gradient stops
    # the run (silently untrained experts or routers are the commonest MoE-LoRA failure).
    warn_missing_gradients: bool = False
    seed: int = 0
    # sft: cross-entropy on the data; dpo/orpo: preference pairs (finetune/preference.py).
    method: str = "sft"
    dpo_loss: str = "sigmoid"  # a name in preference.DPO_LOSSES
    beta: float = 0.1  # DPO's beta (IPO's tau)
    label_smoothing: float = 0.0  # conservative DPO: the share of pairs assumed flipped
    orpo_lambda: float = 0.1  # the weight of ORPO's odds-ratio term (TRL's ORPOConfig.beta)
    # DPO: every reference log-probability in one pass before training, kept in --output.
    precompute_reference: bool = False
    # Steps keep freed host memory in the heap (moe_experts.memory.reuse_freed_host_memory).
    heap_reuse: bool = True
    eval_every: int | None = None  # None: evaluate at the end only (when there is eval data)
    output: Path = Path("finetune-output")
    save_every: int | None = None  # None: save at the end (and on interrupt) only
    keep_last: int = 2
    report_to: str = "none"
    lora: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_LORA))
    resume: Path | None = None
    progress: bool = True


_BY_DEST = {o.dest: o for o in OPTIONS}
_BY_PLACE = {(o.section, o.key): o for o in OPTIONS}


def default_value(opt: Option) -> Any:
    """The value ``opt`` has when neither ``--config`` nor its flag sets it."""
    if opt.section == "lora":
        from_lora_core = {"dropout": 0.0}  # lora_core.LoraConfig's default (no torch import)
        return DEFAULT_LORA.get(opt.key, from_lora_core.get(opt.key))
    return getattr(FinetuneArgs(), opt.dest)


def _nearest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(candidates)}"


def coerce(opt: Option, value: Any, where: str) -> Any:
    """Convert a flag string or a YAML value to ``opt``'s type, then run its check.

    Raises:
        FinetuneError: naming ``where`` (the flag or the YAML key), the value and the fix.
    """
    if value is None:
        if opt.nullable:
            return None
        raise FinetuneError(f"{where}: a value is required")
    try:
        if opt.kind is bool:
            if not isinstance(value, bool):
                raise ValueError
            out: Any = value
        elif opt.kind is int:
            if isinstance(value, (bool, float)):
                raise ValueError
            out = int(value)
        elif opt.kind is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        elif opt.kind is Path:
            if not isinstance(value, (str, Path)):
                raise ValueError
            out = Path(value)
        else:
            if not isinstance(value, str):
                raise ValueError
            out = value
    except (TypeError, ValueError):
        expected = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            Path: "a path",
        }.get(opt.kind, "a string")
        raise FinetuneError(f"{where} {value!r}: expected {expected}") from None
    choices = opt.choices
    if opt.vocabulary is not None:
        choices, renamed = opt.vocabulary()
        if out in renamed:
            print(f"warning: {where} {out!r} is deprecated; use {renamed[out]!r}", file=sys.stderr)
            out = renamed[out]
    if choices and out not in choices:
        close = difflib.get_close_matches(out, choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FinetuneError(f"{where} {out!r}: expected one of {', '.join(choices)}{hint}")
    if opt.check is not None:
        problem = opt.check(out)
        if problem:
            raise FinetuneError(f"{where} {value}: {problem}")
    return out


def _mapping(node: Any, where: str) -> dict[str, Any]:
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise FinetuneError(f"{where} must be a mapping of settings, got {type(node).__name__}")
    return node


def _unknown(path: Path, where: str, key: Any, known: list[str], also: list[str]) -> FinetuneError:
    # A key in the wrong section (e.g. top-level `lr`) is pointed at its real place.
    elsewhere = [k for k in also if k.rsplit(".", 1)[-1] == str(key)]
    hint = f"; did you mean {elsewhere[0]!r}?" if elsewhere else _nearest(str(key), known)
    return FinetuneError(f"--config {path}: unknown key {where}{key}{hint}")


def read_config_file(path: Path, role: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a run YAML into ``FinetuneArgs`` field values and where each one came from.

    ``role`` (``--role``; None: not given, :data:`ROLE_DEFAULT`) picks the older-style
    ``models.<role>.lora`` block.

    Returns:
        ``(values, sources)``: field name -> value (``lora`` is the complete LoRA mapping),
        field name -> ``"FILE: section.key"`` for messages.

    Raises:
        FinetuneError: unreadable YAML, an unknown key (with the nearest known key), a bad
            value (naming the key), or a role with no ``models.<role>`` block.
    """
    doc = _mapping(load_config_yaml(path), f"--config {path}: the document")
    every = [f"{o.section}.{o.key}" for o in OPTIONS]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    wanted = ROLE_DEFAULT if role is None else role
    named = f"--role (default {ROLE_DEFAULT})" if role is None else f"--role {role}"
    if role is not None and "models" not in doc:
        raise FinetuneError(
            f"--config {path}: {named} picks a models.{role}.lora block, but the file has no "
            "models: section; drop --role (its lora: section needs none)"
        )
    for section, body in doc.items():
        if section == "models":  # the older models.<role>.lora block: a complete LoRA config
            roles = _mapping(body, f"--config {path}: models")
            for r, block in roles.items():
                block = _mapping(block, f"--config {path}: models.{r}")
                for k in block:
                    if k != "lora":
                        raise _unknown(path, f"models.{r}.", k, ["lora"], [])
            if wanted not in roles and (roles or role is not None):
                # Training without the block the file holds would silently ignore it.
                there = ", ".join(map(str, roles)) or "none"
                raise FinetuneError(
                    f"--config {path}: {named} has no models.{wanted} block (roles there: "
                    f"{there}); pass --role naming one of them"
                )
            block = _mapping(roles.get(wanted), f"--config {path}: models.{wanted}")
            if block.get("lora") is not None:
                values["lora"] = dict(
                    _mapping(block["lora"], f"--config {path}: models.{wanted}.lora")
                )
                sources["lora"] = f"{path}: models.{wanted}.lora"
            continue
        if section not in SECTIONS:
            raise _unknown(path, "", section, [*SECTIONS, "models"], every)
        body = _mapping(body, f"--config {path}: {section}")
        if section == "lora":
            values["lora"] = {**DEFAULT_LORA, **body}
            sources["lora"] = f"{path}: lora"
            for key, value in body.items():  # keys that have a flag get the flag's check
                opt = _BY_PLACE.get((section, key))
                if opt is not None and value is not None:
                    values["lora"][key] = coerce(opt, value, f"--config {path}: lora.{key}")
            continue
        known = [o.key for o in OPTIONS if o.section == section]
        for key, value in body.items():
            opt = _BY_PLACE.get((section, key))
            if opt is None:
                raise _unknown(path, f"{section}.", key, known, every)
            where = f"--config {path}: {section}.{key}"
            values[opt.dest] = coerce(opt, value, where)
            sources[opt.dest] = where
    return values, sources


def resolve_args(
    flags: Mapping[str, Any],
    *,
    config: Path | None,
    role: str | None,
    resume: Path | None,
    progress: bool,
) -> tuple[FinetuneArgs, dict[str, str]]:
    """Defaults, then the YAML file, then the flags given (``None`` means not given).

    Returns:
        The resolved args and, per field, where its value came from (a flag or a YAML key).

    Raises:
        FinetuneError: a bad file or value (see :func:`read_config_file`), or ``role``
            without ``config``.
    """
    if config is None and role is not None:
        raise FinetuneError(
            f"--role {role}: no --config; --role picks a models.<role>.lora block of a "
            "--config file"
        )
    values: dict[str, Any] = {}
    sources = {o.dest: o.flag for o in OPTIONS}
    if config is not None:
        file_values, file_sources = read_config_file(config, role)
        values.update(file_values)
        sources.update(file_sources)
    lora_flags: list[str] = []
    for dest, raw in flags.items():
        if raw is None:
            continue
        opt = _BY_DEST[dest]
        value = coerce(opt, raw, opt.flag)
        sources[dest] = opt.flag
        if opt.section == "lora":  # over the YAML's lora block (or the defaults)
            values["lora"] = {**values.get("lora", DEFAULT_LORA), opt.key: value}
            lora_flags.append(f"{opt.flag} {raw}")
        else:
            values[dest] = value
    if lora_flags:  # a LoRA config error names the flags that made it
        under = f" over {sources['lora']}" if "lora" in sources else ""
        sources["lora"] = ", ".join(lora_flags) + under
    args = replace(FinetuneArgs(), **values, resume=resume, progress=progress)
    return args, sources


def lora_config(args: FinetuneArgs, source: str = "the lora settings") -> Any:
    """Validate ``args.lora`` as a :class:`lora_core.LoraConfig` (imports lora_core, torch).

    Raises:
        FinetuneError: an unknown key (with the nearest known key) or an invalid value.
    """
    from lora_core import LoraConfig

    known = list(LoraConfig.model_fields)
    for key in args.lora:
        if key not in known:
            raise FinetuneError(f"{source}: unknown key lora.{key}{_nearest(str(key), known)}")
    try:
        cfg = LoraConfig.model_validate(args.lora)
    except ValueError as exc:
        errors = getattr(exc, "errors", None)  # pydantic: one clean line per problem
        if callable(errors):
            message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in errors())
        else:
            message = str(exc)
        raise FinetuneError(f"{source}: {' '.join(message.split())}") from exc
    if not cfg.enable:
        raise FinetuneError(f"{source}: lora.enable is false; there would be nothing to train")
    return cfg


def render_config(args: FinetuneArgs, lora: Any) -> str:
    """The resolved run as YAML in the ``--config`` shape (``lora`` fully spelled out)."""
    import yaml

    doc: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for opt in OPTIONS:
        if opt.section == "lora":
            continue  # the whole validated LoRA config is written below
        value = getattr(args, opt.dest)
        doc[opt.section][opt.key] = str(value) if isinstance(value, Path) else value
    doc["lora"] = {
        k: list(v) if isinstance(v, tuple) else v for k, v in lora.model_dump(mode="json").items()
    }
    return yaml.safe_dump(doc, sort_keys=False)
