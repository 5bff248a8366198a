"""The table of fine-tune settings: each one's flag, YAML place, type and check (no torch at
import; kt-kernel's weight formats are read when ``--weight-dtype`` is checked).

:mod:`moe_experts.finetune.config` reads flags and ``--config`` files through it; each row's
``dest`` is a field of :class:`~moe_experts.finetune.config.FinetuneArgs` (section ``lora``
rows override a key of its ``lora`` mapping instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import DATA_FORMATS

__all__ = ["OPTIONS", "Check", "Option", "check_seed"]


Check = Callable[[Any], str | None]


def _positive_finite(v: float) -> str | None:
    return None if math.isfinite(v) and v > 0 else "must be a finite number > 0"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be a number > 0 (inf: no clipping)"


def _at_least(n: int) -> Check:
    return lambda v: None if v >= n else f"must be >= {n}"


def _fraction(v: float) -> str | None:
    return None if 0 < v < 1 else "must be a fraction strictly between 0 and 1, e.g. 0.05"


def _half_probability(v: float) -> str | None:
    return None if 0 <= v < 0.5 else "must be in [0, 0.5), e.g. 0.1 (0: no smoothing)"


def _int64(v: int) -> str | None:
    # torch.manual_seed and torch.Generator take at most 64 bits (OverflowError beyond).
    return None if -(2**63) <= v < 2**63 else f"must fit in 64 bits (-2**63 to {2**63 - 1})"


def check_seed(seed: int, where: str) -> None:
    """Refuse a seed torch cannot take.

    Raises:
        FinetuneError: ``WHERE SEED: must fit in 64 bits ...``.
    """
    problem = _int64(seed)
    if problem:
        raise FinetuneError(f"{where} {seed}: {problem}")


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
        "kernel storage of the frozen experts: auto (the checkpoint's own: a quantised "
        "checkpoint's shipped bytes, FP8 blocks or MXFP4, else its own values: fp32, or bf16 "
        "repacked as bf16-packed where the CPU has AVX512_BF16) or a weight "
        "format registered "
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
        "kernel_norms",
        "--kernel-norms",
        "model",
        "kernel_norms",
        bool,
        "run a CPU model's RMSNorms on kt-kernel's fused op where it reproduces them "
        "(calls off the CPU keep the module's own forward; --no-kernel-norms: keep "
        "transformers' norms everywhere)",
        negation="--no-kernel-norms",
    ),
    Option(
        "device",
        "--device",
        "model",
        "device",
        str,
        "where the dense layers, LoRA and optimizer state run: cuda (cuda:LOCAL_RANK, dense "
        "weights in bf16), cpu, or auto (cuda when torch sees a GPU); the routed experts stay "
        "in the host kernel either way",
        choices=("auto", "cpu", "cuda"),
    ),
    Option(
        "gpu_experts",
        "--gpu-experts",
        "model",
        "gpu_experts",
        int,
        "keep each MoE layer's N most-routed experts (counted over the first steps, then "
        "fixed and saved in the checkpoint) resident on the GPU in bf16; needs --device cuda",
        check=_at_least(0),
    ),
    Option(
        "overlap",
        "--overlap",
        "model",
        "overlap",
        bool,
        "run the host experts asynchronously while the dense device computes what does not "
        "depend on them (shared experts; --no-overlap: one after the other; default: on "
        "with --device cuda, off on the CPU)",
        nullable=True,
        negation="--no-overlap",
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
        "gradient_checkpointing",
        "--gradient-checkpointing",
        "training",
        "gradient_checkpointing",
        bool,
        "recompute each decoder layer in backward instead of keeping its activations (the "
        "host experts' output is kept, and the kernel keeps what its policy says)",
    ),
    Option(
        "lora_dtype",
        "--lora-dtype",
        "training",
        "lora_dtype",
        str,
        "dtype of the LoRA factors, their gradients and the AdamW state",
        choices=("fp32", "bf16"),
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
    Option(
        "seed",
        "--seed",
        "training",
        "seed",
        int,
        "data order and LoRA initialisation",
        check=_int64,
    ),
    Option(
        "method",
        "--method",
        "training",
        "method",
        str,
        "sft: supervised (text, chat, instruction data); dpo or orpo: preference pairs "
        "(--batch-size then counts pairs)",
        choices=("sft", "dpo", "orpo"),
    ),
    Option(
        "dpo_loss",
        "--dpo-loss",
        "training",
        "dpo_loss",
        str,
        "--method dpo: sigmoid (DPO) or ipo (IPO, length-normalised), as TRL's loss_type",
        choices=("sigmoid", "ipo"),
    ),
    Option(
        "beta",
        "--beta",
        "training",
        "beta",
        float,
        "--method dpo: how far the policy may move from the reference (IPO: tau)",
        check=_positive_finite,
    ),
    Option(
        "label_smoothing",
        "--label-smoothing",
        "training",
        "label_smoothing",
        float,
        "--method dpo with --dpo-loss sigmoid: the assumed share of flipped preference "
        "labels (conservative DPO), e.g. 0.1",
        check=_half_probability,
    ),
    Option(
        "orpo_lambda",
        "--orpo-lambda",
        "training",
        "orpo_lambda",
        float,
        "--method orpo: the weight of the odds-ratio term beside the chosen answers' NLL",
        check=_positive_finite,
    ),
    Option(
        "precompute_reference",
        "--precompute-reference",
        "training",
        "precompute_reference",
        bool,
        "--method dpo: compute every reference log-probability in one pass before training "
        "and keep them in --output (a resumed run reuses them)",
    ),
    Option(
        "heap_reuse",
        "--heap-reuse",
        "training",
        "heap_reuse",
        bool,
        "keep host memory freed by a step in the process heap for the next one (glibc: no "
        "mmap per large tensor, no trim), so steps stop faulting in and zeroing their "
        "activations again; --no-heap-reuse keeps glibc's defaults, where the heap's growth "
        "matters more than the speed (default: on)",
        negation="--no-heap-reuse",
    ),
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
