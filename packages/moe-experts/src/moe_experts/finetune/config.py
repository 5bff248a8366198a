"""Every setting of a fine-tune run in one table: its flag, its YAML key, its check (no torch).

A run is described by :class:`FinetuneArgs`. Its values come, in rising priority, from the
defaults here, one YAML file (``--config``) and the command-line flags. The YAML file has one
section per group of :data:`OPTIONS` (``model``, ``data``, ``training``, ``output``) plus
``lora`` (fields of :class:`lora_core.LoraConfig`, applied over :data:`DEFAULT_LORA`); the
older form ``models.<role>.lora`` (a complete LoRA config) is still read. Unknown keys anywhere
are errors that suggest the nearest known key. ``--print-config`` renders the resolved run in
the same YAML shape, so its output is itself a valid ``--config`` file.

Adding a setting is one row in :data:`OPTIONS` and one field in :class:`FinetuneArgs`; a row
of section ``lora`` (``--lora-rank``) needs no field: it overrides that key of ``lora``.
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import DATA_FORMATS

__all__ = [
    "DEFAULT_LORA",
    "OPTIONS",
    "SECTIONS",
    "FinetuneArgs",
    "Option",
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
    # After the first backward a trainable parameter without a finite, non-zero gradient stops
    # the run (silently untrained experts or routers are the commonest MoE-LoRA failure).
    warn_missing_gradients: bool = False
    seed: int = 0
    eval_every: int | None = None  # None: evaluate at the end only (when there is eval data)
    output: Path = Path("finetune-output")
    save_every: int | None = None  # None: save at the end (and on interrupt) only
    keep_last: int = 2
    report_to: str = "none"
    lora: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_LORA))
    resume: Path | None = None
    progress: bool = True


Check = Callable[[Any], str | None]


def _positive_finite(v: float) -> str | None:
    return None if math.isfinite(v) and v > 0 else "must be a finite number > 0"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be a number > 0 (inf: no clipping)"


def _at_least(n: int) -> Check:
    return lambda v: None if v >= n else f"must be >= {n}"


def _fraction(v: float) -> str | None:
    return None if 0 < v < 1 else "must be a fraction strictly between 0 and 1, e.g. 0.05"


def _probability(v: float) -> str | None:
    return None if 0 <= v < 1 else "must be a probability in [0, 1), e.g. 0.05 (0: no dropout)"


@dataclass(frozen=True)
class Option:
    """One setting: the :class:`FinetuneArgs` field, its flag, its YAML place and its check."""

    dest: str
    flag: str
    section: str
    key: str
    kind: type
    help: str
    check: Check | None = None
    choices: tuple[str, ...] = ()
    # Choices owned by another package, read only when a value is checked (it may import
    # torch): (choices, old spelling -> current one). Old spellings are accepted with a warning.
    vocabulary: Callable[[], tuple[tuple[str, ...], Mapping[str, str]]] | None = None
    nullable: bool = False  # None (unset) is a valid value
    aliases: tuple[str, ...] = ()  # the Hugging Face TrainingArguments spelling, where it fits
    negation: str | None = None  # a bool's flag that sets False (the two exclude each other)


def _weight_formats() -> tuple[tuple[str, ...], Mapping[str, str]]:
    """``--weight-dtype``'s vocabulary: ``auto`` and kt-kernel's registry of weight formats."""
    import kt_kernel

    return ("auto", *kt_kernel.FORMATS), kt_kernel.FORMAT_ALIASES


OPTIONS: tuple[Option, ...] = (
    Option(
        "model",
        "--model",
        "model",
        "name",
        str,
        "'tiny-qwen3-moe' (built in) or a local Hugging Face model directory",
    ),
    Option(
        "weight_dtype",
        "--weight-dtype",
        "model",
        "weight_dtype",
        str,
        "kernel storage of the frozen experts: auto (the checkpoint's own: a FP8-block "
        "checkpoint's shipped bytes, else dense in its dtype) or a weight format registered "
        "in kt_kernel.FORMATS (an unknown name lists them)",
        vocabulary=_weight_formats,
    ),
    Option(
        "share_experts",
        "--share-experts",
        "model",
        "share_experts",
        bool,
        "under torchrun with several ranks per machine, keep one copy of the frozen experts "
        "per machine in shared memory (--no-share-experts: one copy per rank; default: "
        "share unless MOE_EXPERTS_SHARE_EXPERTS=0)",
        nullable=True,
        negation="--no-share-experts",
    ),
    Option(
        "kernel_attention",
        "--kernel-attention",
        "model",
        "kernel_attention",
        bool,
        "run plain causal attention of a CPU model on kt-kernel's causal attention op "
        "instead of transformers' SDPA (other calls still use SDPA; "
        "--no-kernel-attention: keep SDPA everywhere)",
        negation="--no-kernel-attention",
    ),
    Option(
        "data",
        "--data",
        "data",
        "path",
        Path,
        "training data file; default: a small corpus shipped with the package",
        nullable=True,
    ),
    Option(
        "data_format",
        "--data-format",
        "data",
        "format",
        str,
        "force the record format instead of detecting it per file",
        choices=tuple(sorted(DATA_FORMATS)),
        nullable=True,
    ),
    Option(
        "train_on_prompt",
        "--train-on-prompt",
        "data",
        "train_on_prompt",
        bool,
        "chat/instruction data: loss on every token, not only the replies",
    ),
    Option(
        "eval_data",
        "--eval-data",
        "data",
        "eval_data",
        Path,
        "evaluation data file (same formats as --data)",
        nullable=True,
    ),
    Option(
        "eval_split",
        "--eval-split",
        "data",
        "eval_split",
        float,
        "hold out this fraction of --data's documents for evaluation, e.g. 0.05",
        check=_fraction,
        nullable=True,
    ),
    Option("seq_len", "--seq-len", "data", "seq_len", int, "tokens per row", check=_at_least(2)),
    Option(
        "steps",
        "--steps",
        "training",
        "steps",
        int,
        "optimizer steps in total",
        check=_at_least(1),
        aliases=("--max-steps",),
    ),
    Option(
        "lr",
        "--lr",
        "training",
        "lr",
        float,
        "peak learning rate",
        check=_positive_finite,
        aliases=("--learning-rate",),
    ),
    Option(
        "lr_schedule",
        "--lr-schedule",
        "training",
        "lr_schedule",
        str,
        "learning-rate schedule after warm-up",
        choices=("constant", "linear", "cosine"),
        aliases=("--lr-scheduler-type",),
    ),
    Option(
        "warmup_steps",
        "--warmup-steps",
        "training",
        "warmup_steps",
        int,
        "linear warm-up from 0 to --lr over this many steps",
        check=_at_least(0),
    ),
    Option(
        "batch_size",
        "--batch-size",
        "training",
        "batch_size",
        int,
        "global rows per optimizer step (split across torchrun ranks and --grad-accum)",
        check=_at_least(1),
    ),
    Option(
        "grad_accum",
        "--grad-accum",
        "training",
        "grad_accum",
        int,
        "split each step's batch into N micro-batches (same result, less memory)",
        check=_at_least(1),
        aliases=("--gradient-accumulation-steps",),
    ),
    Option(
        "max_grad_norm",
        "--max-grad-norm",
        "training",
        "max_grad_norm",
        float,
        "clip the global gradient norm to this",
        check=_positive,
    ),
    Option(
        "loss",
        "--loss",
        "training",
        "loss",
        str,
        "chunked: cross-entropy over the LM head in chunks, never the full fp32 logits "
        "(falls back to full where the model transforms its logits); full: from the "
        "model's logits",
        choices=("chunked", "full"),
    ),
    Option(
        "warn_missing_gradients",
        "--warn-missing-gradients",
        "training",
        "warn_missing_gradients",
        bool,
        "only warn (instead of stopping) when a trainable parameter gets no finite, "
        "non-zero gradient in the first step",
    ),
    Option("seed", "--seed", "training", "seed", int, "data order and LoRA initialisation"),
    Option(
        "eval_every",
        "--eval-every",
        "training",
        "eval_every",
        int,
        "evaluate every N steps (and at the end)",
        check=_at_least(1),
        nullable=True,
        aliases=("--eval-steps",),
    ),
    Option(
        "output",
        "--output",
        "output",
        "dir",
        Path,
        "run directory: checkpoints/, train_log.jsonl, loss.png",
    ),
    Option(
        "save_every",
        "--save-every",
        "output",
        "save_every",
        int,
        "save a checkpoint every N steps (default: at the end and on interrupt only)",
        check=_at_least(1),
        nullable=True,
        aliases=("--save-steps",),
    ),
    Option(
        "keep_last",
        "--keep-last",
        "output",
        "keep_last",
        int,
        "keep only the newest N checkpoints",
        check=_at_least(1),
        aliases=("--save-total-limit",),
    ),
    Option(
        "report_to",
        "--report-to",
        "output",
        "report_to",
        str,
        "also log scalars to TensorBoard (OUTPUT/tensorboard) or Weights & Biases (offline)",
        choices=("none", "tensorboard", "wandb"),
    ),
    # Section lora: each overrides one key of the resolved lora mapping (FinetuneArgs.lora).
    Option(
        "lora_rank",
        "--lora-rank",
        "lora",
        "rank",
        int,
        "LoRA rank r of every adapted module, router and expert",
        check=_at_least(1),
    ),
    Option(
        "lora_alpha",
        "--lora-alpha",
        "lora",
        "alpha",
        float,
        "LoRA alpha: updates are scaled by alpha / rank",
        check=_positive_finite,
    ),
    Option(
        "lora_dropout",
        "--lora-dropout",
        "lora",
        "dropout",
        float,
        "dropout probability on the LoRA input",
        check=_probability,
    ),
)
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


def _load_yaml(path: Path) -> Any:
    import yaml

    if not path.is_file():
        raise FinetuneError(f"--config {path}: no such file")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise FinetuneError(f"--config {path}: not valid UTF-8 ({exc.reason})") from exc
    except yaml.YAMLError as exc:
        raise FinetuneError(f"--config {path}: invalid YAML: {exc}") from exc


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


def read_config_file(path: Path, role: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a run YAML into ``FinetuneArgs`` field values and where each one came from.

    Returns:
        ``(values, sources)``: field name -> value (``lora`` is the complete LoRA mapping),
        field name -> ``"FILE: section.key"`` for messages.

    Raises:
        FinetuneError: unreadable YAML, an unknown key (with the nearest known key), or a bad
            value (naming the key).
    """
    doc = _mapping(_load_yaml(path), f"--config {path}: the document")
    every = [f"{o.section}.{o.key}" for o in OPTIONS]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for section, body in doc.items():
        if section == "models":  # the older models.<role>.lora block: a complete LoRA config
            roles = _mapping(body, f"--config {path}: models")
            for r, block in roles.items():
                block = _mapping(block, f"--config {path}: models.{r}")
                for k in block:
                    if k != "lora":
                        raise _unknown(path, f"models.{r}.", k, ["lora"], [])
                if r == role and block.get("lora") is not None:
                    values["lora"] = dict(
                        _mapping(block["lora"], f"--config {path}: models.{r}.lora")
                    )
                    sources["lora"] = f"{path}: models.{r}.lora"
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
    role: str,
    resume: Path | None,
    progress: bool,
) -> tuple[FinetuneArgs, dict[str, str]]:
    """Defaults, then the YAML file, then the flags given (``None`` means not given).

    Returns:
        The resolved args and, per field, where its value came from (a flag or a YAML key).
    """
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
