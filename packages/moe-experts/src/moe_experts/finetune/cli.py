"""``moe-experts finetune`` and ``python -m moe_experts.finetune``: flags, messages, exit codes.

Exit codes: 0 success, 1 a user-facing error (one line on stderr; ``--debug`` adds the
traceback), 2 bad command-line usage (argparse).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import DATA_FORMATS
from moe_experts.finetune.loop import FinetuneArgs, run_finetune

__all__ = ["COMMANDS", "build_parser", "finetune_main", "main", "report_error"]


def build_parser(prog: str = "moe-experts finetune") -> argparse.ArgumentParser:
    """The flags of the fine-tune command."""
    d = FinetuneArgs()
    p = argparse.ArgumentParser(prog=prog, description="LoRA fine-tune of a MoE model on CPU.")
    p.add_argument("--model", default=d.model,
                   help="'tiny-qwen3-moe' (built in) or a local Hugging Face model directory")
    p.add_argument("--data", type=Path, default=None,
                   help=".txt (one document per line), .jsonl or .json records: text, chat "
                        "messages, alpaca or sharegpt (detected per file); default: a small "
                        "corpus shipped with the package")
    p.add_argument("--data-format", choices=sorted(DATA_FORMATS), default=None,
                   help="force the record format instead of detecting it")
    p.add_argument("--train-on-prompt", action="store_true",
                   help="chat/instruction data: loss on every token, not only the replies")
    p.add_argument("--config", type=Path, default=None,
                   help="YAML file with a models.<role>.lora block (default: rank 8 on "
                        "attention and experts)")
    p.add_argument("--role", default=d.role, help="the <role> in models.<role>.lora")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch size (split across torchrun ranks)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="save a checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-last", type=int, default=d.keep_last)
    p.add_argument("--output", type=Path, default=d.output)
    p.add_argument("--resume", type=Path, default=None,
                   help="a checkpoint directory (or checkpoints root) to continue from")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--weight-dtype", choices=("fp32", "bf16", "int8"), default=d.weight_dtype)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def report_error(exc: FinetuneError, *, debug: bool = False) -> int:
    """Print a user-facing error as ``error:`` lines on stderr; returns the exit code 1."""
    if debug:
        traceback.print_exc()
    # One line per problem (a DataError lists each bad record), whatever the formatting.
    for problem in getattr(exc, "lines", None) or [str(exc)]:
        print(f"error: {' '.join(problem.split())}", file=sys.stderr)
    return 1


def finetune_main(argv: Sequence[str] | None = None, prog: str = "moe-experts finetune") -> int:
    """Run the fine-tune from command-line arguments; returns the exit code."""
    ns = build_parser(prog).parse_args(argv)
    args = FinetuneArgs(
        model=ns.model, data=ns.data, data_format=ns.data_format,
        train_on_prompt=ns.train_on_prompt, config=ns.config, role=ns.role, steps=ns.steps,
        lr=ns.lr, batch_size=ns.batch_size, seq_len=ns.seq_len, save_every=ns.save_every,
        keep_last=ns.keep_last, output=ns.output, resume=ns.resume, seed=ns.seed,
        weight_dtype=ns.weight_dtype, max_grad_norm=ns.max_grad_norm,
        progress=not ns.no_progress,
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        summary = run_finetune(args)
    except FinetuneError as exc:
        return report_error(exc, debug=ns.debug)
    if summary.world_size > 1:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    first, last = summary.losses[0], summary.losses[-1]
    print(f"loss {first:.4f} -> {last:.4f} over {len(summary.losses)} steps "
          f"({summary.tokens_per_second:,.0f} tokens/s, {summary.world_size} process(es))")
    print(f"checkpoint: {summary.checkpoint}")
    print("load the adapter with PEFT:")
    print("  from transformers import AutoModelForCausalLM; from peft import PeftModel")
    print(f"  model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
          f"{str(summary.model_source)!r}), {str(summary.checkpoint)!r})")
    return 0


# command -> (module, function, summary); modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "finetune": ("moe_experts.finetune.cli", "finetune_main", "LoRA fine-tune of a MoE model"),
    "generate": ("moe_experts.finetune.generate", "generate_main",
                 "generate text with the base model and a trained adapter"),
    "export": ("moe_experts.finetune.export", "export_main",
               "export a checkpoint as a PEFT adapter, vLLM per-expert LoRA or a merged model"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The ``moe-experts`` console script: ``moe-experts COMMAND [flags]``."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: moe-experts {" + ",".join(COMMANDS) + "} [--help] [flags]"
    if not argv or argv[0] in ("-h", "--help"):
        lines = [usage, "", "commands:"]
        lines += [f"  {name:<10}{summary}" for name, (_, _, summary) in COMMANDS.items()]
        print("\n".join(lines), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{usage}\nerror: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), function)(argv[1:])
