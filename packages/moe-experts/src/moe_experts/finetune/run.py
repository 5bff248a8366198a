"""``run_finetune``: the composition of data, model, adaptation, resume and the loop."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_experts.finetune.config import FinetuneArgs, lora_config
from moe_experts.finetune.data import PackedBatches, default_corpus_path, load_texts
from moe_experts.finetune.distributed import Ranks, init_distributed, shard_dense
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.evaluation import Batch
from moe_experts.finetune.interrupts import StopRequest
from moe_experts.finetune.loop import FinetuneSummary, TrainingJob, restore_checkpoint, train
from moe_experts.finetune.models import LoadedModel, load_model

__all__ = ["run_finetune"]


def _hold_out(texts: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Split documents into (train, eval), the eval share drawn by ``seed``."""
    n_eval = max(1, round(len(texts) * fraction))
    if n_eval >= len(texts):
        raise FinetuneError(
            f"--eval-split {fraction}: --data has only {len(texts)} document(s); nothing would "
            "be left to train on (use --eval-data FILE instead)"
        )
    held = set(random.Random(seed).sample(range(len(texts)), n_eval))
    return ([t for i, t in enumerate(texts) if i not in held],
            [t for i, t in enumerate(texts) if i in held])


def _datasets(args: FinetuneArgs, encode: Callable[[str], list[int]],
              texts: list[str], eval_texts: list[str]) -> tuple[PackedBatches, list[Batch]]:
    """Training batches by step, and the evaluation set in micro-batch sized chunks."""
    train_batches = PackedBatches.build(texts, encode, seq_len=args.seq_len,
                                        batch_size=args.batch_size, seed=args.seed)
    if not eval_texts:
        return train_batches, []
    micro = args.batch_size // args.grad_accum
    try:
        rows = PackedBatches.build(eval_texts, encode, seq_len=args.seq_len, batch_size=micro,
                                   seed=args.seed).rows
    except FinetuneError as exc:
        raise FinetuneError(f"the evaluation data: {exc}") from exc
    return train_batches, [rows[i:i + micro] for i in range(0, rows.shape[0], micro)]


def _read_texts(args: FinetuneArgs) -> tuple[list[str], list[str]]:
    texts = load_texts(args.data or default_corpus_path())
    if args.eval_data is not None:
        return texts, load_texts(args.eval_data)
    if args.eval_split is not None:
        return _hold_out(texts, args.eval_split, args.seed)
    return texts, []


def _load_on_ranks(name: str, ranks: Ranks) -> LoadedModel:
    # Rank 0 first: it creates the built-in model's cache directory the others then read.
    loaded = load_model(name) if ranks.rank == 0 else None
    if ranks.world > 1:
        dist.barrier()
    return loaded if loaded is not None else load_model(name)


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
    from lora_core import rebind_parameters

    lora = lora_config(args)
    texts, eval_texts = _read_texts(args)
    ranks = init_distributed()
    loaded = _load_on_ranks(args.model, ranks)
    torch.manual_seed(args.seed)
    result = moe_experts.adapt_model(loaded.model, lora, weight_dtype=args.weight_dtype)
    if ranks.world > 1:
        shard_dense(loaded.model, _expert_parameters(loaded.model))
        result = rebind_parameters(result, loaded.model)  # fully_shard made new Parameters
    optimizer = torch.optim.AdamW(result.parameters(), lr=args.lr, weight_decay=0.0)
    batches, eval_batches = _datasets(args, loaded.encode, texts, eval_texts)
    job = TrainingJob(args=args, model=loaded.model, result=result, optimizer=optimizer,
                      batches=batches, eval_batches=eval_batches, ranks=ranks,
                      model_source=loaded.source, stop=stop)
    if args.resume is not None:
        job.first_step, job.last_eval = restore_checkpoint(args.resume, result, optimizer,
                                                           args.steps)
    return train(job)
