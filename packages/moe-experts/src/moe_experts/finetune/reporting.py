"""What a run shows: train_log.jsonl, loss.png, the progress bar, TensorBoard and wandb."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moe_experts.finetune.config import FinetuneArgs
from moe_experts.finetune.errors import FinetuneError

__all__ = ["Reporter", "TrainLog", "plot_losses"]


class TrainLog:
    """``OUTPUT/train_log.jsonl``: one JSON record per optimizer step, each step once."""

    def __init__(self, path: Path) -> None:
        """Point at the log file (it is created on the first record)."""
        self.path = path

    def records(self) -> list[dict[str, Any]]:
        """Every record in the file (none when it does not exist)."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: the step is logged again on resume
        return out

    def start_at(self, step: int) -> None:
        """Keep only the records of steps ``<= step`` (a resumed run logs the rest again)."""
        kept = [r for r in self.records() if isinstance(r.get("step"), int) and r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        """Add one step's record."""
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


def plot_losses(log: TrainLog, target: Path) -> Path | None:
    """Draw train (and eval) loss against step into ``target`` (a PNG).

    Returns:
        ``target``, or None when matplotlib is missing (a note goes to stderr) or the log is
        empty.
    """
    records = log.records()
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "note: loss.png not drawn: matplotlib is not installed "
            "(pip install 'moe-experts[train]')",
            file=sys.stderr,
        )
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if isinstance(r.get("eval_loss"), float)]
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = target.with_name(target.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, target)
    return target


class Reporter:
    """Sends each step's scalars to TensorBoard or wandb (``--report-to``), or nowhere."""

    def __init__(self, args: FinetuneArgs, first_step: int) -> None:
        """Open the writer; a resumed run drops events after ``first_step`` first.

        Raises:
            FinetuneError: the optional package of the chosen reporter is missing.
        """
        self.kind = args.report_to
        self._tb: Any = None
        self._wandb: Any = None
        if self.kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise FinetuneError(
                    "--report-to tensorboard needs the tensorboard package: pip install tensorboard"
                ) from exc
            # purge_step: events of steps a resumed run repeats are dropped, not doubled.
            self._tb = SummaryWriter(
                str(args.output / "tensorboard"), purge_step=first_step + 1 if first_step else None
            )
        elif self.kind == "wandb":
            try:
                import wandb
            except ImportError as exc:
                raise FinetuneError(
                    "--report-to wandb needs the wandb package: pip install wandb"
                ) from exc
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "moe-experts"),
                dir=str(args.output),
                mode=os.environ.get("WANDB_MODE", "offline"),
                config={k: str(v) for k, v in asdict(args).items()},
                resume="allow",
            )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (e.g. ``train/loss``) at ``step``."""
        clean = {k: v for k, v in scalars.items() if isinstance(v, float) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        """Flush and close the writer."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
