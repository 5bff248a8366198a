"""Checks that run before any model loads: combined values, files, the output directory.

Nothing here imports torch, so a bad run is refused in about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from moe_experts.finetune.config import FinetuneArgs
from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "OUTPUT_ARTIFACTS",
    "check_combination",
    "check_output_path",
    "check_reporter",
    "check_text_file",
    "existing_checkpoints",
    "prepare_output",
]

# What a run writes into --output; --overwrite removes exactly these, nothing else.
OUTPUT_ARTIFACTS = (
    "checkpoints",
    "train_log.jsonl",
    "loss.png",
    "tensorboard",
    "wandb",
    "reference_logps.safetensors",
)

# Settings of one preference method: given with another --method they would do nothing.
_METHOD_OF = {
    "dpo_loss": "dpo",
    "beta": "dpo",
    "label_smoothing": "dpo",
    "precompute_reference": "dpo",
    "orpo_lambda": "orpo",
}


def _world_size() -> int:
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_combination(args: FinetuneArgs, sources: dict[str, str], *, overwrite: bool) -> None:
    """Refuse settings that are valid one by one but not together.

    Raises:
        FinetuneError: naming the settings and how to make them agree.
    """
    world = _world_size()
    split = args.grad_accum * world
    if args.batch_size % split:
        raise FinetuneError(
            f"{sources['batch_size']} {args.batch_size} is the global batch per step; it must "
            f"divide by --grad-accum {args.grad_accum} x {world} rank(s) = {split}"
        )
    if args.eval_data is not None and args.eval_split is not None:
        raise FinetuneError("--eval-data and --eval-split both given; pass one of them")
    if args.eval_every is not None and args.eval_data is None and args.eval_split is None:
        raise FinetuneError(
            f"{sources['eval_every']} needs evaluation data: add --eval-data FILE or "
            "--eval-split 0.05"
        )
    if args.warmup_steps and args.warmup_steps >= args.steps:
        raise FinetuneError(
            f"{sources['warmup_steps']} {args.warmup_steps} is not below --steps {args.steps}; "
            "the learning rate would never reach --lr"
        )
    defaults = FinetuneArgs()
    for dest, method in _METHOD_OF.items():
        if getattr(args, dest) != getattr(defaults, dest) and args.method != method:
            raise FinetuneError(
                f"{sources[dest]} applies to --method {method}, but this run is --method "
                f"{args.method}; drop it or pass --method {method}"
            )
    if args.label_smoothing and args.dpo_loss != "sigmoid":
        raise FinetuneError(
            f"{sources['label_smoothing']} applies to --dpo-loss sigmoid, not "
            f"{args.dpo_loss}; drop it or pass --dpo-loss sigmoid"
        )
    if overwrite and args.resume is not None:
        raise FinetuneError("--overwrite and --resume exclude each other; pass one of them")
    if args.resume is not None and not args.resume.exists():
        raise FinetuneError(f"--resume {args.resume}: no such checkpoint or directory")


def check_sharing(args: FinetuneArgs, sources: dict[str, str]) -> None:
    """Refuse ``--share-experts`` where there is nobody to share with.

    Raises:
        FinetuneError: naming the flag (or YAML key) and how to launch the run instead.
    """
    if not args.share_experts:
        return
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not local.isdigit() or int(local) < 2:
        raise FinetuneError(
            f"{sources['share_experts']} shares the frozen experts between the ranks of one "
            f"machine, but this run has LOCAL_WORLD_SIZE={local}; launch it with torchrun "
            "--nproc-per-node N (N >= 2), or drop the setting"
        )
    world = os.environ.get("WORLD_SIZE") or "1"
    if not world.isdigit() or int(world) < 2:
        # Without torchrun's WORLD_SIZE no process group forms, so the run would load its own
        # experts and train unshared.
        raise FinetuneError(
            f"{sources['share_experts']} shares the frozen experts between the ranks of one "
            f"machine, but this process has LOCAL_WORLD_SIZE={local} and WORLD_SIZE={world}: "
            f"it was not launched by torchrun; launch it with torchrun --nproc-per-node "
            f"{local}, or drop the setting"
        )


def check_reporter(report_to: str) -> None:
    """Refuse ``--report-to`` when its optional package is not installed.

    Raises:
        FinetuneError: naming the package and the pip command.
    """
    needs = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(report_to)
    if needs and importlib.util.find_spec(needs) is None:
        raise FinetuneError(
            f"--report-to {report_to} needs the {needs} package, which is not installed: "
            f"pip install {needs} (or pass --report-to none)"
        )


def check_text_file(path: Path, flag: str) -> None:
    """Refuse a data file that is missing or not valid UTF-8, naming the line.

    Raises:
        FinetuneError: ``FLAG PATH: line N ...`` with the offending byte and a fix.
    """
    if not path.is_file():
        raise FinetuneError(f"{flag} {path}: no such file")
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise FinetuneError(
            f"{flag} {path}: line {line} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at "
            f"column {column}); save the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from exc


def existing_checkpoints(output: Path) -> list[str]:
    """Names of the checkpoints (published, not temporary) under ``OUTPUT/checkpoints``."""
    root = output / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def check_output_path(output: Path, flag: str) -> None:
    """Refuse an output that is a file or lies under one (no side effects).

    Raises:
        FinetuneError: naming the file in the way.
    """
    for parent in [output, *output.parents]:
        if parent.exists():
            if not parent.is_dir():
                what = "is a file" if parent == output else f"is under the file {parent}"
                raise FinetuneError(
                    f"{flag} {output} {what}, not a directory; choose another {flag}"
                )
            break


def writable_dir(output: Path, flag: str) -> None:
    """Make ``output`` (and its parents) a directory this process can write into.

    Raises:
        FinetuneError: it is, or lies under, a file, or cannot be created or written.
    """
    check_output_path(output, flag)
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise FinetuneError(
            f"{flag} {output}: cannot write there ({exc.strerror or exc}); choose a writable "
            f"directory for {flag}"
        ) from exc


def prepare_output(
    args: FinetuneArgs, sources: dict[str, str], *, overwrite: bool, rank: int = 0
) -> None:
    """Make sure ``--output`` is a writable directory that this run may write into.

    An output that already holds checkpoints is refused unless ``--resume`` (continue) or
    ``--overwrite`` (rank 0 then deletes what an earlier run wrote there) is given.

    Raises:
        FinetuneError: the output is under a file, not writable, or holds another run.
    """
    flag = sources["output"]
    writable_dir(args.output, flag)
    found = existing_checkpoints(args.output)
    if found and args.resume is None and not overwrite:
        raise FinetuneError(
            f"{flag} {args.output} already holds checkpoints ({found[-1]} is the newest); "
            f"continue with --resume {args.output / 'checkpoints'}, start again with "
            f"--overwrite (deletes them), or choose another {flag}"
        )
    if args.resume is not None and found:
        ckpt = args.resume.resolve()
        if ckpt.parent == (args.output / "checkpoints").resolve():
            later = [n for n in found if n > ckpt.name]
            if later:
                raise FinetuneError(
                    f"--resume {args.resume}: {flag} {args.output} already holds later "
                    f"checkpoints ({', '.join(later)}) that the resumed run would collide "
                    f"with; delete them, or resume into another {flag}"
                )
    if overwrite and rank == 0:
        for name in OUTPUT_ARTIFACTS:
            target = args.output / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
