"""The training loop: accumulation, schedule, evaluation, checkpoints, divergence, interrupts.

Each optimizer step takes the global batch ``batches.batch(step)`` (a pure function of seed
and step), splits it into ``--grad-accum`` micro-batches and, under torchrun, each micro-batch
into one slice per rank. The run's objective (``finetune.objective``: token cross-entropy, or
DPO/ORPO over preference pairs) gives each slice's contribution already divided by the whole
step's counts (target tokens, pairs), so neither accumulation nor the number of ranks changes
the result.
Checkpoints are taken only at step boundaries, so the accumulation position of every
checkpoint is 0 and a resumed run starts the next step from its first micro-batch.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lora_core.contracts import ParameterOwnership
from moe_experts.finetune.config import FinetuneArgs
from moe_experts.finetune.distributed import Ranks, clip_grad_norm, diagnose_peer_loss
from moe_experts.finetune.errors import (
    FinetuneError,
    PeerLostError,
    TrainingDivergedError,
    TrainingInterrupted,
)
from moe_experts.finetune.evaluation import evaluate
from moe_experts.finetune.interrupts import StopRequest
from moe_experts.finetune.objective import Objective, TokenObjective
from moe_experts.finetune.reporting import Reporter, TrainLog, plot_losses
from moe_experts.finetune.schedule import lr_at

# lora-checkpoint's own bound on a manifest it reads.
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024

__all__ = [
    "BatchSource",
    "FinetuneSummary",
    "TrainingJob",
    "check_later_checkpoints",
    "restore_checkpoint",
    "train",
]


class BatchSource(Protocol):
    """Anything that gives the global batch of an optimizer step (``data.PackedBatches``,
    ``preference_data.PreferenceBatches``)."""

    def model_batch(self, step: int) -> Any:
        """The global batch of optimizer step ``step`` (0-based): a ``data.Batch`` or the
        batch type of the job's objective (``select``, ``num_targets``, ``num_tokens``)."""
        ...


@dataclass
class FinetuneSummary:
    """What a run did: the losses per step, where its checkpoint is, how fast it went."""

    losses: list[float]
    first_step: int
    checkpoint: Path | None
    tokens_per_second: float
    world_size: int
    model_source: Path
    eval_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingJob:
    """Everything the loop needs, built by ``run_finetune``."""

    args: FinetuneArgs
    model: nn.Module
    result: Any  # lora_core.contracts.AdaptationResult
    optimizer: torch.optim.Optimizer
    batches: BatchSource
    eval_batches: list[Any]  # data.Batch, or the objective's batch type
    ranks: Ranks
    model_source: Path
    first_step: int = 0
    last_eval: float | None = None
    stop: StopRequest | None = None
    last_checkpoint: Path | None = None
    # More checkpoint fields beside the data position (the fixed hot-expert sets).
    position_extra: Callable[[], dict[str, Any]] | None = None
    objective: Objective | None = None  # None: token cross-entropy with args.loss (sft)
    eval_metrics: dict[str, float] = field(default_factory=dict)

    def step_objective(self) -> Objective:
        """The objective of this run (``--method``)."""
        return self.objective if self.objective is not None else TokenObjective(self.args.loss)


def _candidates(path: Path) -> list[Path]:
    """The checkpoints ``--resume path`` may mean, newest first.

    One checkpoint directory means itself. A root means every checkpoint in it, by step then
    creation time, whatever its ``latest`` says: a kill between publishing ``step-N`` and
    updating ``latest`` leaves ``latest`` one checkpoint behind.
    """
    import lora_checkpoint

    if (path / lora_checkpoint.MANIFEST).exists() or not path.is_dir():
        return [path]
    manifests = lora_checkpoint.list_checkpoints(path)
    if not manifests:
        return [path]  # load() names what is missing
    manifests.sort(
        key=lambda m: (-1 if m.training_state is None else m.training_state.step, m.created_at),
        reverse=True,
    )
    return [path / m.name for m in manifests]


def _rank_to_read(ckpt: Path, ranks: Ranks) -> int:
    """Whose files this rank reads: its own, or rank 0's when the world size changed.

    Adapters and AdamW state are stored whole (lora-checkpoint >= 0.3), the data order is
    a function of seed and step, and the global batch is --batch-size at any world size, so
    a run saved by N ranks continues on M: every rank reads rank 0's training state.

    Raises:
        FinetuneError: the checkpoint holds rank-local parameters (they exist per rank).
        CheckpointError: the manifest cannot be read.
    """
    import lora_checkpoint

    path = ckpt / lora_checkpoint.MANIFEST
    if not path.is_file():
        return ranks.rank  # load() names what is missing
    try:
        with path.open("rb") as fh:
            data = fh.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise lora_checkpoint.CheckpointError(f"{path}: cannot be read ({exc})") from exc
    if len(data) > _MAX_MANIFEST_BYTES:
        raise lora_checkpoint.CheckpointError(f"{path}: larger than {_MAX_MANIFEST_BYTES} bytes")
    manifest = lora_checkpoint.parse_manifest(data, str(path))
    if manifest.world_size == ranks.world:
        return ranks.rank
    local = [p.name for p in manifest.parameters if p.ownership == ParameterOwnership.RANK_LOCAL]
    if local:
        raise FinetuneError(
            f"--resume {ckpt}: saved by {manifest.world_size} rank(s) with rank-local "
            f"parameters {local[:4]}, which exist once per rank; resume with "
            f"{manifest.world_size} rank(s) (this run has {ranks.world})"
        )
    return 0


def _load_agreed(path: Path, ranks: Ranks) -> Any:
    """The newest checkpoint for ``--resume path`` that verifies on every rank.

    Raises:
        FinetuneError: none verifies (naming why the newest did not).
    """
    import lora_checkpoint

    skipped: list[str] = []
    first_error: Exception | None = None
    for candidate in _candidates(path):
        loaded, error, cause = None, None, None
        try:
            rank = _rank_to_read(candidate, ranks)
            loaded = lora_checkpoint.load(candidate, verify=True, rank=rank)
        except (lora_checkpoint.CheckpointError, OSError) as exc:
            error, cause = str(exc), exc
        ok = error is None
        if ranks.world > 1:
            # Every rank must resume from the same checkpoint; each verified its own files.
            flag = torch.tensor([1 if ok else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(int(flag))
            if not ok and error is None:
                error = "its files of another rank fail verification"
        if ok:
            if skipped and ranks.rank == 0:
                print(
                    f"warning: --resume {path}: skipped {'; '.join(skipped)}; resuming from "
                    f"{candidate.name}",
                    file=sys.stderr,
                )
            return loaded
        if first_error is None:
            first_error = cause or FinetuneError(error or "")
        skipped.append(f"{candidate.name} ({error})")
    raise FinetuneError(f"--resume {path}: {first_error}") from first_error


def restore_checkpoint(
    path: Path, result: Any, optimizer: torch.optim.Optimizer, total_steps: int, ranks: Ranks
) -> tuple[int, float | None]:
    """Load adapters, AdamW state, RNG and position from a checkpoint, or a root's newest.

    For a root the newest checkpoint that verifies is taken (``latest`` may lag behind after
    a kill mid-save); a newer one that fails verification is named in a warning.

    Returns:
        ``(step, last eval loss or None)`` recorded in the checkpoint.

    Raises:
        FinetuneError: unreadable/corrupt checkpoint, no training state, or already past
            ``total_steps``.
    """
    import lora_checkpoint

    ckpt = _load_agreed(path, ranks)
    try:
        lora_checkpoint.restore(result, ckpt)
    except (lora_checkpoint.CheckpointError, OSError) as exc:
        raise FinetuneError(f"--resume {ckpt.path}: {exc}") from exc
    state = ckpt.training_state
    if state is None:
        raise FinetuneError(f"--resume {ckpt.path}: the checkpoint has no training state")
    try:
        state.apply(optimizer, result)
    except lora_checkpoint.CheckpointError as exc:
        raise FinetuneError(f"--resume {ckpt.path}: {exc}") from exc
    if state.step >= total_steps:
        raise FinetuneError(
            f"--resume {ckpt.path}: the checkpoint is at step {state.step}; pass --steps greater "
            f"than {state.step} to train further"
        )
    last_eval = state.data_position.get("eval_loss")
    return state.step, float(last_eval) if isinstance(last_eval, (int, float)) else None


def check_later_checkpoints(root: Path, first_step: int, total_steps: int) -> None:
    """Refuse a resume whose steps' checkpoints already exist under ``root`` (its output).

    Without this the run would retrain those steps and then fail to save them. (Resuming
    from the root itself takes its newest verified checkpoint, so only a newer one that
    fails verification, or an older resume point, gets here.)

    Raises:
        FinetuneError: naming the first checkpoint this run would write again.
    """
    if not root.is_dir():
        return
    for name in sorted(p.name for p in root.iterdir()):
        digits = name.removeprefix("step-")
        if (
            name.startswith("step-")
            and digits.isdigit()
            and first_step < int(digits) <= total_steps
        ):
            raise FinetuneError(
                f"--resume: {root / name} already exists, newer than the checkpoint resumed at "
                f"step {first_step}, and this run would write it again; resume from it (if it "
                "verifies) or move it out of the way"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _first_nonfinite(result: Any, world: int) -> str | None:
    bad = next(
        (
            n
            for n, p in result.named_optimizer_parameters
            if not bool(torch.isfinite(_local(p.detach())).all())
        ),
        None,
    )
    if world > 1:
        # Every rank must agree before the collective save (or none of them calls it).
        flag = torch.tensor([0 if bad is None else 1])
        dist.all_reduce(flag)
        if bad is None and int(flag) > 0:
            bad = "a parameter on another rank"
    return bad


def _save(job: TrainingJob, done: int) -> Path:
    import lora_checkpoint

    bad = _first_nonfinite(job.result, job.ranks.world)
    if bad is not None:
        raise TrainingDivergedError(
            f"training diverged by step {done}: {bad} is not finite, so no checkpoint was "
            f"saved; lower --lr (it is {job.args.lr:g})"
        )
    last_eval = (
        job.last_eval if job.last_eval is not None and math.isfinite(job.last_eval) else None
    )
    state = lora_checkpoint.TrainingState.capture(
        job.optimizer,
        job.result,
        step=done,
        data_position={
            "step": done,
            "seed": job.args.seed,
            "micro_step": 0,
            "eval_loss": last_eval,
            **(job.position_extra() if job.position_extra is not None else {}),
        },
    )
    try:
        manifest = lora_checkpoint.save(
            job.args.output / "checkpoints",
            job.result,
            training_state=state,
            keep_last=job.args.keep_last,
            base_model_name_or_path=str(job.model_source),
        )
    except lora_checkpoint.CheckpointError as exc:
        raise FinetuneError(f"saving the checkpoint of step {done} failed: {exc}") from exc
    job.last_checkpoint = job.args.output / "checkpoints" / manifest.name
    return job.last_checkpoint


def _agreed_stop(job: TrainingJob) -> int:
    signum = job.stop.signum if job.stop is not None and job.stop.signum else 0
    if job.ranks.world > 1:
        # A signal may reach the ranks at different steps; all stop at the same one.
        flag = torch.tensor([signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag)
    return signum


def _diverged(job: TrainingJob, step: int, loss: float, norm: float, lr: float) -> str:
    why = " (the gradient vanished: the activations overflowed)" if norm == 0.0 else ""
    resume = (
        f"; the last good checkpoint is {job.last_checkpoint}"
        if job.last_checkpoint is not None
        else ""
    )
    return (
        f"training diverged at step {step}: loss {loss:.6g}, gradient norm {norm:.6g}{why}. "
        f"Nothing from this step was saved. Lower --lr (it is {job.args.lr:g}; try "
        f"{job.args.lr / 10:g}){resume}"
    )


def _check_coverage(job: TrainingJob) -> None:
    """Stop (or warn) when a trainable parameter got no finite, non-zero first gradient."""
    import moe_experts

    try:
        moe_experts.check_gradients(job.result, warn_only=job.args.warn_missing_gradients)
    except moe_experts.GradientCheckError as exc:
        raise FinetuneError(f"{exc}\n(--warn-missing-gradients makes this a warning)") from exc


@dataclass
class _StepResult:
    loss: float
    norm: float
    lr: float
    tokens: int
    metrics: dict[str, float]


def _all_reduce(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not values:
        return values
    flat = torch.stack([values[k] for k in sorted(values)])
    dist.all_reduce(flat)
    return dict(zip(sorted(values), flat, strict=True))


def _step(job: TrainingJob, step: int, params: list[nn.Parameter]) -> _StepResult:
    from lora_core.fsdp import sync_replicated_lora_gradients

    args, ranks = job.args, job.ranks
    lr = lr_at(
        step,
        peak=args.lr,
        schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        total_steps=args.steps,
    )
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    batch = job.batches.model_batch(step)
    objective = job.step_objective()
    totals = objective.totals(batch)
    targets = batch.num_targets
    micro = args.batch_size // args.grad_accum
    per_rank = micro // ranks.world
    sums = {"loss": torch.zeros((), dtype=torch.float64)}
    for m in range(args.grad_accum):
        lo = m * micro + ranks.rank * per_rank
        parts = objective.loss(job.model, batch.select(lo, lo + per_rank), totals)
        # FSDP averages gradients over ranks, so each rank's share is scaled up by world.
        (parts.loss * ranks.world).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        sums["loss"] += parts.loss.detach().double().cpu()
        for key, value in parts.metrics.items():
            sums[key] = (
                sums.get(key, torch.zeros((), dtype=torch.float64)) + value.detach().double().cpu()
            )
    sync_replicated_lora_gradients(job.result)
    if step == job.first_step:
        _check_coverage(job)
    if ranks.world > 1:
        sums = _all_reduce(sums)
    loss = float(sums.pop("loss"))
    norm = clip_grad_norm(params, args.max_grad_norm)
    vanished = norm == 0.0 and targets > 0 and loss > 0
    if not math.isfinite(loss) or not math.isfinite(norm) or vanished:
        raise TrainingDivergedError(_diverged(job, step + 1, loss, norm, lr))
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    return _StepResult(loss, norm, lr, batch.num_tokens, {k: float(v) for k, v in sums.items()})


def train(job: TrainingJob) -> FinetuneSummary:
    """Run optimizer steps ``first_step .. args.steps``; save, evaluate and log on the way.

    Raises:
        TrainingDivergedError: a non-finite loss/gradient norm, or a vanished gradient.
        TrainingInterrupted: SIGINT/SIGTERM; a checkpoint of the current step was saved.
        PeerLostError: another torchrun rank died.
        FinetuneError: a checkpoint could not be saved.
    """
    args, ranks = job.args, job.ranks
    lead = ranks.rank == 0
    log = TrainLog(args.output / "train_log.jsonl")
    if lead:
        log.start_at(job.first_step)
    reporter = Reporter(args, job.first_step) if lead else None
    bar = None
    if lead and args.progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=job.first_step, desc="finetune", unit="step")
    params = job.result.parameters()
    losses: list[float] = []
    tokens, start = 0, time.perf_counter()
    saved_at = job.first_step if args.resume is not None else None
    step = job.first_step
    job.model.train()
    try:
        if signum := _agreed_stop(job):  # stopped while the model was loading
            before = str(args.resume) if args.resume is not None else None
            raise TrainingInterrupted(signum, job.first_step, before)
        for step in range(job.first_step, args.steps):
            result = _step(job, step, params)
            loss, norm, lr = result.loss, result.norm, result.lr
            done = step + 1
            losses.append(loss)
            tokens += result.tokens
            elapsed = time.perf_counter() - start
            record: dict[str, Any] = {
                "step": done,
                "loss": loss,
                "grad_norm": norm,
                "lr": lr,
                "tokens_per_s": tokens / max(elapsed, 1e-9),
                "elapsed_s": elapsed,
                **result.metrics,  # TRL's names for preference methods: rewards/chosen ...
            }
            if job.eval_batches and (
                done == args.steps or (args.eval_every and done % args.eval_every == 0)
            ):
                job.last_eval, job.eval_metrics = evaluate(
                    job.model, job.eval_batches, job.step_objective()
                )
                record["eval_loss"] = job.last_eval
                record.update({f"eval_{k}": v for k, v in job.eval_metrics.items()})
            if reporter is not None:
                log.append(record)
                reporter.log(
                    done,
                    {
                        "train/loss": loss,
                        "train/grad_norm": norm,
                        "train/lr": lr,
                        "eval/loss": record.get("eval_loss"),
                        **{f"train/{k}": v for k, v in result.metrics.items()},
                        **{
                            f"eval/{k}": v
                            for k, v in job.eval_metrics.items()
                            if "eval_loss" in record  # evaluated at this step
                        },
                    },
                )
                if bar is not None:
                    post = {"loss": f"{loss:.4f}", "tok_s": f"{record['tokens_per_s']:,.0f}"}
                    if job.last_eval is not None:
                        post["eval"] = f"{job.last_eval:.4f}"
                    bar.set_postfix(post)
                    bar.update(1)
            if done == args.steps or (args.save_every and done % args.save_every == 0):
                _save(job, done)
                saved_at = done
            if done < args.steps and (signum := _agreed_stop(job)):
                if saved_at != done:
                    _save(job, done)
                raise TrainingInterrupted(signum, done, str(job.last_checkpoint))
    except TrainingInterrupted:
        if lead:
            plot_losses(log, args.output / "loss.png")
        raise
    except (TrainingDivergedError, PeerLostError, KeyboardInterrupt):
        raise
    except Exception as exc:
        lost = diagnose_peer_loss(exc, ranks, step + 1)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        if bar is not None:
            bar.close()
        if reporter is not None:
            reporter.close()
    if lead:
        plot_losses(log, args.output / "loss.png")
    elapsed = time.perf_counter() - start
    return FinetuneSummary(
        losses=losses,
        first_step=job.first_step,
        checkpoint=job.last_checkpoint,
        tokens_per_second=tokens / max(elapsed, 1e-9),
        world_size=ranks.world,
        model_source=job.model_source,
        eval_loss=job.last_eval,
        extra={"eval_metrics": job.eval_metrics} if job.eval_metrics else {},
    )
