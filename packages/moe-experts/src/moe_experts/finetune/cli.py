"""The ``moe-experts`` command line: a table of subcommands, each imported only when it runs.

Nothing heavy is imported here, so ``moe-experts --help`` and argument errors answer before
torch and transformers load. Exit codes: 0 success; 1 a user-facing error (one ``error:``
line on stderr, ``--debug`` adds the traceback); 2 bad usage (argparse); 130/143 stopped by
SIGINT/SIGTERM after saving a checkpoint (the resume command is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import shlex
import shutil
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_experts.finetune.config import (
    OPTIONS,
    ROLE_DEFAULT,
    SECTIONS,
    FinetuneArgs,
    default_value,
)
from moe_experts.finetune.errors import FinetuneError, TrainingInterrupted

__all__ = ["COMMANDS", "Command", "build_parser", "finetune_main", "main", "report_error"]


@dataclass(frozen=True)
class Command:
    """A ``moe-experts`` subcommand: ``module.function(argv) -> exit code``."""

    module: str
    function: str
    summary: str


# One row per subcommand; the module is imported only when its command runs.
COMMANDS: dict[str, Command] = {
    "finetune": Command(
        "moe_experts.finetune.cli",
        "finetune_main",
        "LoRA fine-tune a MoE model (one process, or under torchrun)",
    ),
    "generate": Command(
        "moe_experts.finetune.generate",
        "generate_main",
        "generate text with the base model and a trained adapter",
    ),
    "export": Command(
        "moe_experts.finetune.export",
        "export_main",
        "export a checkpoint as a PEFT adapter, vLLM per-expert LoRA or a merged model",
    ),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    rows = "\n".join(f"  {n.ljust(width)}  {c.summary}" for n, c in COMMANDS.items())
    return (
        "usage: moe-experts COMMAND [--help] [flags]\n\n"
        f"commands:\n{rows}\n\n"
        "'moe-experts COMMAND --help' shows a command's flags."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``moe-experts`` console script: dispatch to a subcommand of :data:`COMMANDS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    command = COMMANDS.get(name)
    if command is None:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(
            f"error: unknown command {name!r}{hint} (commands: {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    function = getattr(importlib.import_module(command.module), command.function)
    return int(function(argv[1:]))


def report_error(exc: FinetuneError, *, debug: bool = False) -> int:
    """Print a user-facing error as ``error:`` lines on stderr; returns the exit code 1."""
    if debug:
        traceback.print_exc()
    # One line per problem (a DataError lists each bad record), whatever the formatting.
    for problem in getattr(exc, "lines", None) or [str(exc)]:
        print(f"error: {' '.join(problem.split())}", file=sys.stderr)
    return 1


def build_parser(prog: str = "moe-experts finetune") -> argparse.ArgumentParser:
    """The flags of the fine-tune command, one group per ``--config`` section."""
    p = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="LoRA fine-tune of a MoE model: dense layers on a GPU or the CPU "
        "(--device), routed experts on the host kernel. Settings come from the defaults, "
        "then --config FILE (YAML, sections: model, data, training, lora, output), "
        "then these flags.",
    )
    groups = {s: p.add_argument_group(s) for s in SECTIONS}
    for opt in OPTIONS:
        default = default_value(opt)
        shown = "unset" if default is None else default
        if opt.kind is bool and opt.negation:
            both = groups[opt.section].add_mutually_exclusive_group()
            both.add_argument(
                opt.flag,
                *opt.aliases,
                dest=opt.dest,
                default=None,
                action="store_const",
                const=True,
                help=f"{opt.help} (YAML {opt.section}.{opt.key}: true/false)",
            )
            both.add_argument(
                opt.negation,
                dest=opt.dest,
                default=None,
                action="store_const",
                const=False,
                help=f"the opposite of {opt.flag}",
            )
            continue
        if opt.kind is bool:
            groups[opt.section].add_argument(
                opt.flag,
                *opt.aliases,
                dest=opt.dest,
                default=None,
                action="store_const",
                const=True,
                help=f"{opt.help} (YAML {opt.section}.{opt.key}: true)",
            )
            continue
        groups[opt.section].add_argument(
            opt.flag,
            *opt.aliases,
            dest=opt.dest,
            default=None,
            metavar="{" + ",".join(opt.choices) + "}" if opt.choices else opt.dest.upper(),
            help=f"{opt.help} (default: {shown}; YAML {opt.section}.{opt.key})",
        )
    run = p.add_argument_group("run")
    run.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML file holding any of the settings above; its lora: block "
        "takes every field of lora_core.LoraConfig; flags override it",
    )
    run.add_argument(
        "--role",
        default=None,
        help="the <role> of an older-style models.<role>.lora block in --config "
        f"(default: {ROLE_DEFAULT})",
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a checkpoint directory, or a checkpoints root (follows its latest)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="--output holds an earlier run: delete its checkpoints and logs and start again",
    )
    run.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as --config YAML and exit",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def _launcher(prog: str) -> list[str]:
    if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return [
            "torchrun",
            "--nproc-per-node",
            os.environ.get("LOCAL_WORLD_SIZE", "1"),
            "-m",
            "moe_experts.finetune",
        ]
    if prog.startswith("python"):
        return [sys.executable, "-m", "moe_experts.finetune"]
    script = sys.argv[0]
    found = shutil.which("moe-experts")
    if found and Path(script).name == "moe-experts" and Path(found).samefile(script):
        script = "moe-experts"
    return [script, "finetune"]


def resume_command(argv: Sequence[str], prog: str, output: Path) -> str:
    """The command line that continues this run from ``OUTPUT/checkpoints`` (its latest)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume=") and arg != "--overwrite":
            kept.append(arg)
    return shlex.join([*_launcher(prog), *kept, "--resume", str(output / "checkpoints")])


def _prepare(ns: argparse.Namespace, made: list[Path]) -> FinetuneArgs:
    """Resolve and check everything that can be checked before a model loads.

    ``made`` receives ``--output`` when this run creates it (removed again if the run fails
    before writing anything there).
    """
    from moe_experts.finetune import checks
    from moe_experts.finetune.config import lora_config, render_config, resolve_args

    flags = {o.dest: getattr(ns, o.dest) for o in OPTIONS}
    args, sources = resolve_args(
        flags, config=ns.config, role=ns.role, resume=ns.resume, progress=not ns.no_progress
    )
    checks.check_combination(args, sources, overwrite=ns.overwrite)
    checks.check_reporter(args.report_to)
    lora_source = sources.get("lora", "the lora settings")
    if ns.print_config:
        from moe_experts.finetune.targets import model_skeleton, needs_model, resolve_targets

        lora_config(args, lora_source)  # a bad lora setting is named before the model is built
        if needs_model(args):  # show the targets "auto" stands for with this model
            args = resolve_targets(args, model_skeleton(args.model))
        print(render_config(args, lora_config(args, lora_source)), end="")
        return args
    # File and path checks first: they need no torch, lora_config imports it (seconds).
    for path, flag in ((args.data, sources["data"]), (args.eval_data, sources["eval_data"])):
        if path is not None:
            checks.check_text_file(path, flag)
    checks.check_output_path(args.output, sources["output"])
    checks.check_sharing(args, sources)
    lora_config(args, lora_source)
    from moe_experts.finetune.devices import check_devices

    check_devices(args, sources)  # --device cuda without CUDA etc.: before the model loads
    if not args.output.exists():
        made.append(args.output)
    checks.prepare_output(
        args, sources, overwrite=ns.overwrite, rank=int(os.environ.get("RANK", "0"))
    )
    return args


def _report(summary: object) -> None:
    from moe_experts.finetune.loop import FinetuneSummary

    assert isinstance(summary, FinetuneSummary)
    first, last = summary.losses[0], summary.losses[-1]
    print(
        f"loss {first:.4f} -> {last:.4f} over {len(summary.losses)} steps "
        f"({summary.tokens_per_second:,.0f} tokens/s, {summary.world_size} process(es))"
    )
    if summary.eval_loss is not None:
        print(f"eval loss {summary.eval_loss:.4f}")
    print(f"checkpoint: {summary.checkpoint}")
    from moe_experts.finetune.models import pretrained_class

    auto = pretrained_class(Path(summary.model_source)).__name__
    print("load the adapter with PEFT:")
    print(f"  from transformers import {auto}; from peft import PeftModel")
    print(
        f"  model = PeftModel.from_pretrained({auto}.from_pretrained("
        f"{str(summary.model_source)!r}), {str(summary.checkpoint)!r})"
    )


def _train(ns: argparse.Namespace, argv: list[str], prog: str) -> tuple[int, object | None]:
    """Run the fine-tune; returns the exit code and, on success, the summary to report."""
    from moe_experts.finetune.interrupts import StopRequest

    lead = int(os.environ.get("RANK", "0")) == 0
    made: list[Path] = []
    try:
        with StopRequest() as stop:
            args = _prepare(ns, made)
            if ns.print_config:
                return 0, None
            from transformers.utils import logging as hf_logging

            from moe_experts.finetune.run import run_finetune

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
            summary = run_finetune(args, stop=stop)
    except TrainingInterrupted as exc:
        if lead:
            name = {2: "SIGINT", 15: "SIGTERM"}.get(exc.signum, f"signal {exc.signum}")
            where = (
                f"checkpoint {exc.checkpoint}"
                if exc.checkpoint
                else "before the first step; nothing to save"
            )
            print(f"stopped by {name} at step {exc.step}; {where}", file=sys.stderr)
            if exc.checkpoint:
                print(f"resume with:\n  {resume_command(argv, prog, args.output)}", file=sys.stderr)
        return 128 + exc.signum, None
    except FinetuneError as exc:
        if lead:
            _drop_if_empty(made)
        return report_error(exc, debug=ns.debug), None
    return 0, summary


def _drop_if_empty(made: list[Path]) -> None:
    """Remove an output directory this failed run created and left empty (no litter)."""
    for path in made:
        with contextlib.suppress(OSError):  # rmdir only ever removes an empty directory
            path.rmdir()


def _distributed() -> bool:
    """Whether this process is in a torch.distributed process group (torch already loaded)."""
    if "torch.distributed" not in sys.modules:  # never imported: keeps usage errors fast
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def finetune_main(argv: Sequence[str] | None = None, prog: str = "moe-experts finetune") -> int:
    """Run the fine-tune from command-line arguments; returns the exit code.

    Under torchrun every way out (success, error, signal, a bug's traceback) first tears the
    process groups down in order (:func:`moe_experts.finetune.distributed.teardown_distributed`)
    with nothing left referring to them, so that no gloo worker thread is still running when
    the interpreter exits. Where that cannot be done (a second signal: stop at once; torch's
    own DTensor caches still hold the groups after FSDP) the process ends with ``os._exit``
    after the atexit handlers and flushing its output, without the interpreter's finalisation,
    in which such a thread aborts the process.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(prog).parse_args(argv)
    at_once = False
    try:
        code, summary = _train(ns, argv, prog)
    except KeyboardInterrupt:
        print(
            "error: interrupted again; stopped at once (the last saved checkpoint stands)",
            file=sys.stderr,
        )
        code, summary, at_once = 130, None, True
    except Exception:
        if not _distributed():
            raise
        traceback.print_exc()  # as the interpreter would, but before the groups go
        code, summary = 1, None
    freed = True
    if _distributed():
        from moe_experts.finetune.distributed import teardown_distributed

        try:
            freed = not at_once and teardown_distributed()
        except (RuntimeError, ValueError):  # a broken group: leave without finalising instead
            freed = False
    if summary is not None and int(os.environ.get("RANK", "0")) == 0:
        _report(summary)
    if not freed:
        from moe_experts.finetune.distributed import exit_without_finalizing

        exit_without_finalizing(code)
    return code
