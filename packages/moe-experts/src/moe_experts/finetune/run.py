"""``run_finetune``: the composition of data, model, adaptation, resume and the loop."""

from __future__ import annotations

import random
import sys
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from moe_experts.finetune.checks import writable_dir
from moe_experts.finetune.config import FinetuneArgs, lora_config
from moe_experts.finetune.data import (
    Batch,
    DataError,
    PackedBatches,
    default_corpus_path,
    load_samples,
    tokenize_samples,
)
from moe_experts.finetune.devices import (
    Placement,
    placement_summary,
    prepare_hybrid,
    resolve_placement,
    restore_gpu_experts,
)
from moe_experts.finetune.distributed import (
    Ranks,
    diagnose_peer_loss,
    init_distributed,
    shard_dense,
)
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import Sample
from moe_experts.finetune.interrupts import StopRequest
from moe_experts.finetune.loop import (
    BatchSource,
    FinetuneSummary,
    TrainingJob,
    check_later_checkpoints,
    restore_checkpoint,
    train,
)
from moe_experts.finetune.loss import full_logits_reason
from moe_experts.finetune.models import (
    BUILTIN_MODELS,
    LoadedModel,
    builtin_model_dir,
    load_model,
)
from moe_experts.finetune.objective import Objective
from moe_experts.finetune.targets import resolve_targets
from moe_experts.memory import reuse_freed_host_memory

__all__ = ["run_finetune"]


def _hold_out(
    samples: list[Sample], fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """Split records into (train, eval), the eval share drawn by ``seed``."""
    n_eval = max(1, round(len(samples) * fraction))
    if n_eval >= len(samples):
        raise FinetuneError(
            f"--eval-split {fraction}: --data has only {len(samples)} record(s); nothing would "
            "be left to train on (use --eval-data FILE instead)"
        )
    held = set(random.Random(seed).sample(range(len(samples)), n_eval))
    return (
        [s for i, s in enumerate(samples) if i not in held],
        [s for i, s in enumerate(samples) if i in held],
    )


def _read_samples(args: FinetuneArgs) -> tuple[list[Sample], list[Sample]]:
    """Every training and evaluation record, read before the model loads."""
    from moe_experts.finetune.preference_data import check_preference_samples

    path = args.data or default_corpus_path()
    samples = load_samples(path, args.data_format)
    check_preference_samples(path, samples, args.method)  # pairs exactly for dpo/orpo
    if args.eval_data is not None:
        held = load_samples(args.eval_data, args.data_format)
        check_preference_samples(args.eval_data, held, args.method)
        return samples, held
    if args.eval_split is not None:
        return _hold_out(samples, args.eval_split, args.seed)
    return samples, []


def _datasets(
    args: FinetuneArgs,
    tokenizer: Any,
    samples: list[Sample],
    eval_samples: list[Sample],
    one_per_row: bool = False,
) -> tuple[PackedBatches, list[Batch]]:
    """Training batches by step, and the evaluation set in micro-batch sized chunks.

    ``one_per_row``: the model's family cannot keep examples apart within a row.
    """
    path = args.data or default_corpus_path()
    examples = tokenize_samples(path, samples, tokenizer, train_on_prompt=args.train_on_prompt)
    train_batches = PackedBatches.from_examples(
        examples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        one_per_row=one_per_row,
    )
    if not eval_samples:
        return train_batches, []
    micro = args.batch_size // args.grad_accum
    eval_path = args.eval_data or path
    try:
        packed = PackedBatches.from_examples(
            tokenize_samples(
                eval_path, eval_samples, tokenizer, train_on_prompt=args.train_on_prompt
            ),
            seq_len=args.seq_len,
            batch_size=1,
            seed=args.seed,
            one_per_row=one_per_row,
        )
    except DataError:
        raise
    except FinetuneError as exc:
        raise FinetuneError(f"the evaluation data ({eval_path}): {exc}") from exc
    # One batch of every row, then cut in micro-batches: each row is evaluated exactly once.
    everything = replace(packed, batch_size=packed.rows.shape[0]).model_batch(0)
    n = packed.rows.shape[0]
    return train_batches, [everything.select(i, min(i + micro, n)) for i in range(0, n, micro)]


def _load_on_ranks(args: FinetuneArgs, ranks: Ranks, placement: Placement) -> LoadedModel:
    """Every rank loads together (sharing the experts is collective), experts on kt-kernel.

    Raises:
        PeerLostError: another rank died meanwhile (named, in place of gloo's error).
    """
    if ranks.rank == 0 and args.model in BUILTIN_MODELS:
        builtin_model_dir(args.model)  # rank 0 creates the cache directory the others read
    try:
        if ranks.world > 1:
            dist.barrier()
        return load_model(
            args.model,
            dtype=placement.dense_dtype,
            weight_dtype=args.weight_dtype,
            share_experts=args.share_experts,
            dense_device=placement.dense,
        )
    except (RuntimeError, FinetuneError) as exc:
        lost = diagnose_peer_loss(
            exc, ranks, 0, during="while the ranks loaded the model", lost_only=True
        )
        if lost is not None:
            raise lost from exc
        raise


def _expert_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    from moe_experts import KernelExperts

    return {p for m in model.modules() if isinstance(m, KernelExperts) for p in m.parameters()}


def run_finetune(args: FinetuneArgs, stop: StopRequest | None = None) -> FinetuneSummary:
    """Fine-tune LoRA adapters on a MoE model and save verified checkpoints.

    Args:
        args: the resolved run (see :mod:`moe_experts.finetune.config`).
        stop: a signal-driven stop request the loop honours at step boundaries.

    Raises:
        FinetuneError: for every user-facing problem (config, files, model, checkpoint).
        TrainingInterrupted: SIGINT/SIGTERM stopped the run after saving a checkpoint.
    """
    import moe_experts
    from lora_core import LoraTargetError, rebind_parameters

    lora_config(args)  # a bad lora setting fails before the data and the model load
    writable_dir(args.output, "output")  # the CLI made it already; a Python caller may not have
    samples, eval_samples = _read_samples(args)  # bad records fail before the model loads
    placement = resolve_placement(args.device, args.lora_dtype)  # checked by the CLI already
    # Nothing to save yet, and joining waits in C++ where no Python handler runs: a peer that
    # died before the group formed must not leave this rank deaf to torchrun's SIGTERM.
    with stop.exit_at_once("waiting for the other ranks to join") if stop else nullcontext():
        ranks = init_distributed(placement.backend, placement.dense if placement.cuda else None)
    loaded = _load_on_ranks(args, ranks, placement)
    if ranks.rank == 0 and loaded.storage is not None:
        print(f"expert storage: {loaded.storage}", file=sys.stderr)
    args = resolve_targets(args, loaded.model)  # "auto" targets: this model's routers, attention
    lora = lora_config(args)
    torch.manual_seed(args.seed)
    if ranks.rank == 0 and ranks.world > 1:
        shared_by = loaded.shared_by or 1
        copies = (
            f"one copy per machine, shared by {shared_by} local ranks"
            if shared_by > 1
            else "one copy per rank"
        )
        print(f"frozen experts: {copies}", file=sys.stderr)
    try:
        result = moe_experts.adapt_model(
            loaded.model,
            lora,
            weight_dtype=args.weight_dtype,
            kernel_attention=args.kernel_attention,
            kernel_norms=args.kernel_norms,
        )
    except LoraTargetError as exc:  # a target the user wrote that this model does not have
        raise FinetuneError(f"--model {args.model}: {exc}") from exc
    if ranks.rank == 0:
        print(moe_experts.coverage_summary(loaded.model, result), file=sys.stderr)
        why = full_logits_reason(loaded.model) if args.loss == "chunked" else None
        if why is not None:
            print(
                f"note: --loss chunked uses the full logits for this model: {why}", file=sys.stderr
            )
    setup = prepare_hybrid(loaded.model, result, args, placement)
    if ranks.rank == 0:
        line = placement_summary(setup, loaded.model, checkpointing=args.gradient_checkpointing)
        print(line, file=sys.stderr)
    if dist.is_initialized():  # torchrun: several ranks, or one GPU rank on NCCL
        shard_dense(loaded.model, _expert_parameters(loaded.model), placement.dense.type)
        result = rebind_parameters(result, loaded.model)  # fully_shard made new Parameters
    optimizer = torch.optim.AdamW(result.parameters(), lr=args.lr, weight_decay=0.0)
    objective: Objective | None = None  # sft: token cross-entropy
    batches: BatchSource
    eval_batches: list[Any]
    # The family decides whether sequences may share a row (SFT examples and DPO sides alike).
    packing = moe_experts.find_architecture(loaded.model).packing
    if args.method != "sft":
        from moe_experts.finetune.preference_setup import prepare_preference

        pref = prepare_preference(args, loaded, samples, eval_samples, ranks, packing)
        batches, eval_batches, objective = pref.batches, pref.eval_batches, pref.objective
    else:
        packed, eval_batches = _datasets(
            args, loaded.tokenizer, samples, eval_samples, one_per_row=not packing.shares_rows
        )
        batches = packed
        if ranks.rank == 0:
            print(
                f"packed {packed.rows.shape[0]} rows of {args.seq_len + 1} tokens "
                f"({packed.padding_fraction:.1%} padding; {packing.description})",
                file=sys.stderr,
            )
    job = TrainingJob(
        args=args,
        model=loaded.model,
        result=result,
        optimizer=optimizer,
        batches=batches,
        eval_batches=eval_batches,
        ranks=ranks,
        model_source=loaded.source,
        stop=stop,
        position_extra=setup.position,
        objective=objective,
    )
    if args.resume is not None:
        job.first_step, job.last_eval = restore_checkpoint(
            args.resume, result, optimizer, args.steps, ranks
        )
        check_later_checkpoints(args.output / "checkpoints", job.first_step, args.steps)
        restore_gpu_experts(setup, args.resume)
    # After the load (whose transient buffers went back to the OS): steps reuse freed memory.
    reused = args.heap_reuse and reuse_freed_host_memory()
    if ranks.rank == 0:
        if reused:
            heap = "freed memory reused by the next step"
        elif args.heap_reuse:
            heap = "the allocator's defaults (glibc mallopt unavailable or refused)"
        else:  # mallopt is process-wide: an earlier caller in this process may have set it
            heap = "not switched to reuse by this run (--no-heap-reuse)"
        print(f"host heap: {heap}", file=sys.stderr)
    return train(job)
