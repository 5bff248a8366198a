"""What ``run_finetune`` builds for ``--method dpo|orpo``: pairs, objective, kept references.

``--precompute-reference`` computes every reference log-probability (train and eval pairs)
in one pass before training and keeps them in ``OUTPUT/reference_logps.safetensors`` with a
fingerprint of the pairs' tokens, the model and its expert storage. A run (a resumed one in
particular) whose fingerprint matches reuses the file instead of computing them again; a
mismatch (other data, another model) computes them anew and replaces it.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_experts.finetune.config import FinetuneArgs
from moe_experts.finetune.distributed import Ranks
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import Sample
from moe_experts.finetune.objective import Objective
from moe_experts.finetune.preference import DPOObjective, ORPOObjective, reference_logps
from moe_experts.finetune.preference_data import PairBatch, PreferenceBatches, tokenize_pairs
from moe_experts.isolation import Packing

__all__ = ["REFERENCE_FILE", "PreferenceRun", "preference_objective", "prepare_preference"]

REFERENCE_FILE = "reference_logps.safetensors"
_FORMAT = "1"


@dataclass
class PreferenceRun:
    """The training pairs by step, the evaluation chunks and the objective of the run."""

    batches: PreferenceBatches
    eval_batches: list[PairBatch]
    objective: Objective


def preference_objective(args: FinetuneArgs) -> Objective:
    """The :class:`~moe_experts.finetune.objective.Objective` of ``args.method``."""
    if args.method == "orpo":
        return ORPOObjective(lam=args.orpo_lambda, loss_mode=args.loss)
    if args.method == "dpo":
        return DPOObjective(
            beta=args.beta,
            loss_type=args.dpo_loss,
            label_smoothing=args.label_smoothing,
            loss_mode=args.loss,
        )
    raise ValueError(f"--method {args.method!r} is not a preference method")


def _pairs(
    args: FinetuneArgs,
    path: Path,
    samples: list[Sample],
    tokenizer: Any,
    batch_size: int,
    packing: Packing,
) -> PreferenceBatches:
    pairs, cut = tokenize_pairs(path, samples, tokenizer, max_tokens=args.seq_len + 1)
    if cut and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"note: {cut} of {len(pairs)} pairs in {path} are longer than --seq-len "
            f"{args.seq_len} + 1 tokens; their responses were cut at the end",
            file=sys.stderr,
        )
    # A family that cannot keep packed sequences apart gets one sequence per row instead.
    return PreferenceBatches(
        tuple(pairs), batch_size, args.seed, args.seq_len, one_per_row=not packing.shares_rows
    )


def _key(
    args: FinetuneArgs, model: nn.Module, source: Path, train: PreferenceBatches, held: Any
) -> dict[str, str]:
    """What the kept reference values depend on (compared as a whole on reuse)."""
    from moe_experts import KernelExperts

    # The storage the experts were resolved to, not the flag: "auto" names different formats
    # on different CPUs and versions (bf16-packed where kt-kernel runs its products).
    storage = sorted(
        {m.expert_weights.weight_dtype for m in model.modules() if isinstance(m, KernelExperts)}
    )
    return {
        "format": _FORMAT,
        "train_pairs": train.fingerprint(),
        "eval_pairs": held.fingerprint() if held is not None else "",
        "model": str(source),
        "weight_dtype": ",".join(storage) or args.weight_dtype,
        "loss": args.loss,
    }


def _read_kept(path: Path, key: dict[str, str], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """The kept tensors when ``path`` matches ``key`` and ``sizes``, else ``{}``."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            if f.metadata() != key:
                return {}
            kept = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError):
        return {}
    if {k: tuple(v.shape) for k, v in kept.items()} != {k: (n, 2) for k, n in sizes.items()}:
        return {}
    return kept


def _write_kept(path: Path, key: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=key)
    os.replace(tmp, path)


def _kept_reference(
    args: FinetuneArgs,
    model: nn.Module,
    source: Path,
    run: PreferenceRun,
    held: PreferenceBatches | None,
    ranks: Ranks,
) -> PreferenceRun:
    path = args.output / REFERENCE_FILE
    key = _key(args, model, source, run.batches, held)
    sizes = {"train": len(run.batches.pairs)}
    if held is not None:
        sizes["eval"] = len(held.pairs)
    kept = _read_kept(path, key, sizes)
    usable = torch.tensor([1 if kept else 0])
    if ranks.world > 1:  # every rank computes, or none does (the forwards are collective)
        dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    lead = ranks.rank == 0
    if int(usable) and kept:
        if lead:
            print(f"reference log-probs: reused {path}", file=sys.stderr)
    else:
        micro = max(args.batch_size // args.grad_accum // ranks.world, 1)
        start = time.perf_counter()
        kept = {
            name: reference_logps(
                model,
                pairs.chunks(micro),
                len(pairs.pairs),
                mode=args.loss,
                rank=ranks.rank,
                world=ranks.world,
            )
            for name, pairs in (("train", run.batches), ("eval", held))
            if pairs is not None
        }
        if lead:
            _write_kept(path, key, kept)
            pairs_done = sum(v.shape[0] for v in kept.values())
            print(
                f"reference log-probs: {pairs_done} pairs in {time.perf_counter() - start:.1f} s, "
                f"kept in {path}",
                file=sys.stderr,
            )
        if ranks.world > 1:
            dist.barrier()
    run.batches = run.batches.with_reference(kept["train"])
    if held is not None:
        held = held.with_reference(kept["eval"])
        run.eval_batches = held.chunks(max(args.batch_size // args.grad_accum, 1))
    return run


def prepare_preference(
    args: FinetuneArgs,
    loaded: Any,
    samples: list[Sample],
    eval_samples: list[Sample],
    ranks: Ranks,
    packing: Packing,
) -> PreferenceRun:
    """Tokenise the pairs, choose the objective and, with ``--precompute-reference``, the
    reference log-probabilities (computed now, or reused from ``--output``).

    Args:
        args: the resolved run (``method`` is dpo or orpo).
        loaded: the :class:`~moe_experts.finetune.models.LoadedModel`, already adapted.
        samples: the training records (all preference pairs).
        eval_samples: the evaluation records (may be empty).
        ranks: this process's place under torchrun.
        packing: how the model's family keeps sequences sharing a row apart
            (``find_architecture(model).packing``); a pair's sequences share rows only where
            it allows.

    Raises:
        DataError: a pair whose prompt leaves no room for a response.
        FinetuneError: the pairs would not fill one step.
    """
    from moe_experts.finetune.data import default_corpus_path

    path = args.data or default_corpus_path()
    train = _pairs(args, path, samples, loaded.tokenizer, args.batch_size, packing)
    if not train.pairs:
        raise FinetuneError(f"--data {path}: holds no preference pair")
    micro = max(args.batch_size // args.grad_accum, 1)
    held = None
    if eval_samples:
        held = _pairs(args, args.eval_data or path, eval_samples, loaded.tokenizer, micro, packing)
    run = PreferenceRun(
        train, held.chunks(micro) if held is not None else [], preference_objective(args)
    )
    if ranks.rank == 0:
        held_out = f", {len(held.pairs)} evaluation pairs" if held is not None else ""
        print(
            f"--method {args.method}: {len(train.pairs)} pairs{held_out} ({packing.description})",
            file=sys.stderr,
        )
    if args.method == "dpo" and args.precompute_reference:
        run = _kept_reference(args, loaded.model, loaded.source, run, held, ranks)
    return run
