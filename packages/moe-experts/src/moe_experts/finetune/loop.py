"""The training loop: one process or ``torchrun`` ranks with gloo and FSDP2 on the dense layers."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_experts.finetune.data import PackedBatches, default_corpus_path, load_texts
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.models import load_model

__all__ = ["FinetuneArgs", "FinetuneSummary", "run_finetune"]

DEFAULT_LORA: dict[str, Any] = {
    "enable": True,
    "rank": 8,
    "alpha": 16,
    # lm_head too: the built-in model is random, and a frozen random head caps its logits.
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
    # Every supported family keeps its router at mlp.gate (a bare weight: LoRAParameter).
    "target_parameters": ["mlp.gate.weight"],
    "init_seed": 0,
}


@dataclass
class FinetuneArgs:
    """Everything one fine-tune run needs; the CLI fills it from flags."""

    model: str = "tiny-qwen3-moe"
    data: Path | None = None  # None: the corpus shipped in the package
    config: Path | None = None  # a YAML file with a models.<role>.lora block
    role: str = "moe"
    steps: int = 60
    lr: float = 3e-3
    batch_size: int = 8  # global, across all ranks
    seq_len: int = 64
    save_every: int = 0  # 0: only at the end
    keep_last: int | None = 2
    output: Path = Path("finetune-output")
    resume: Path | None = None
    seed: int = 0
    weight_dtype: str = "fp32"
    max_grad_norm: float = 1.0
    progress: bool = True
    # After the first backward: a parameter without a finite, non-zero gradient stops the run
    # (True: only a warning).
    gradient_check_warn_only: bool = False


@dataclass
class FinetuneSummary:
    """What a run did: the losses per step, where its checkpoint is, how fast it went."""

    losses: list[float]
    first_step: int
    checkpoint: Path | None
    tokens_per_second: float
    world_size: int
    model_source: Path
    extra: dict[str, Any] = field(default_factory=dict)


def _lora_config(args: FinetuneArgs) -> Any:
    from lora_core import LoraConfig, LoraConfigError

    if args.config is None:
        return LoraConfig.model_validate(DEFAULT_LORA)
    if not args.config.is_file():
        raise FinetuneError(f"--config {args.config}: no such file")
    try:
        cfg = LoraConfig.from_yaml(args.config, args.role)
    except (LoraConfigError, ValueError) as exc:
        raise FinetuneError(f"--config {args.config}: {exc}") from exc
    if cfg is None or not cfg.enable:
        raise FinetuneError(
            f"--config {args.config}: models.{args.role}.lora is missing or not enabled; "
            "there would be nothing to train"
        )
    return cfg


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard_dense(model: nn.Module, ignored: set[nn.Parameter]) -> None:
    """FSDP2 over each decoder layer and the root; expert tensors stay out of FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", model), "layers", [])
    for layer in layers:
        mine = {p for p in layer.parameters() if p in ignored}
        fully_shard(layer, mesh=mesh, ignored_params=mine)
    fully_shard(model, mesh=mesh, ignored_params=ignored)


def _clip(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global norm over sharded (DTensor) and replicated gradients alike."""
    from torch.distributed.tensor import DTensor

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            sharded += p.grad.to_local().double().pow(2).sum()
        else:
            replicated += p.grad.double().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sharded)
    norm = float((sharded + replicated).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def run_finetune(args: FinetuneArgs) -> FinetuneSummary:
    """Fine-tune LoRA adapters on a MoE model and save verified checkpoints.

    Raises:
        FinetuneError: for every user-facing problem (config, files, model, checkpoint).
    """
    import lora_checkpoint
    import moe_experts
    from lora_core import enable_lora_training, rebind_parameters
    from lora_core.fsdp import sync_replicated_lora_gradients

    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        raise FinetuneError("--steps and --batch-size must be >= 1 and --seq-len >= 2")
    rank, world = _init_distributed()
    if args.batch_size % world:
        raise FinetuneError(
            f"--batch-size {args.batch_size} is the global batch; it must divide by the "
            f"{world} ranks"
        )
    lora = _lora_config(args)
    texts = load_texts(args.data or default_corpus_path())
    if rank == 0:
        loaded = load_model(args.model)
    if world > 1:
        dist.barrier()  # rank 0 creates the built-in model's cache directory first
    if rank != 0:
        loaded = load_model(args.model)
    model = loaded.model
    torch.manual_seed(args.seed)
    wrap_report = moe_experts.wrap(model, weight_dtype=args.weight_dtype)
    # Dense first: enable_lora_training freezes every parameter that is not its own LoRA.
    dense = enable_lora_training(model, lora)
    experts = moe_experts.adapt(model, lora)
    result = dense.merge(experts)
    if rank == 0:
        print(moe_experts.coverage_summary(model, result), file=sys.stderr)
    if world > 1:
        kept_out = {p for _, p in experts.named_optimizer_parameters}
        kept_out |= {model.get_parameter(n) for n in experts.placeholders}
        _shard_dense(model, kept_out)
        # fully_shard replaces the dense Parameter objects with DTensor ones.
        result = rebind_parameters(result, model)
    params = result.parameters()
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    batches = PackedBatches.build(texts, loaded.encode, seq_len=args.seq_len,
                                  batch_size=args.batch_size, seed=args.seed)

    first_step = 0
    if args.resume is not None:
        try:
            ckpt = lora_checkpoint.load(args.resume, verify=True)
        except (lora_checkpoint.CheckpointError, OSError) as exc:
            raise FinetuneError(f"--resume {args.resume}: {exc}") from exc
        try:
            lora_checkpoint.restore(result, ckpt)
        except lora_checkpoint.CheckpointError as exc:
            raise FinetuneError(f"--resume {args.resume}: {exc}") from exc
        if ckpt.training_state is None:
            raise FinetuneError(f"--resume {args.resume}: the checkpoint has no training state")
        ckpt.training_state.apply(optimizer, result)
        first_step = ckpt.training_state.step
        if first_step >= args.steps:
            raise FinetuneError(
                f"--resume {args.resume}: the checkpoint is at step {first_step}; pass "
                f"--steps greater than {first_step} to train further"
            )

    out = Path(args.output)
    log_path = out / "train_log.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    per_rank = args.batch_size // world
    losses: list[float] = []
    bar = None
    if rank == 0 and args.progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=first_step, desc="finetune", unit="step")
    checkpoint: Path | None = None
    tokens = 0
    start = time.perf_counter()
    model.train()
    for step in range(first_step, args.steps):
        rows = batches.batch(step)[rank * per_rank:(rank + 1) * per_rank]
        inputs, labels = rows[:, :-1], rows[:, 1:]
        logits = model(input_ids=inputs).logits
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1))
        loss.backward()
        sync_replicated_lora_gradients(experts.named_optimizer_parameters)
        if step == first_step:
            try:
                moe_experts.check_gradients(result, warn_only=args.gradient_check_warn_only)
            except moe_experts.GradientCheckError as exc:
                raise FinetuneError(str(exc)) from exc
        grad_norm = _clip(params, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        value = float(reported)
        if not math.isfinite(value):
            raise FinetuneError(f"the loss became {value} at step {step}; lower --lr")
        losses.append(value)
        tokens += args.batch_size * args.seq_len
        elapsed = time.perf_counter() - start
        tps = tokens / max(elapsed, 1e-9)
        if rank == 0:
            record = {"step": step + 1, "loss": value, "grad_norm": grad_norm,
                      "tokens_per_s": tps, "lr": args.lr, "elapsed_s": elapsed}
            with log_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{tps:,.0f}")
                bar.update(1)
        done = step + 1
        if done == args.steps or (args.save_every and done % args.save_every == 0):
            state = lora_checkpoint.TrainingState.capture(
                optimizer, result, step=done, data_position={"step": done, "seed": args.seed})
            manifest = lora_checkpoint.save(out / "checkpoints", result, training_state=state,
                                            keep_last=args.keep_last,
                                            base_model_name_or_path=str(loaded.source))
            checkpoint = out / "checkpoints" / manifest.name
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start
    return FinetuneSummary(
        losses=losses, first_step=first_step, checkpoint=checkpoint,
        tokens_per_second=tokens / max(elapsed, 1e-9), world_size=world,
        model_source=loaded.source,
        extra={"wrap_bytes_moved": wrap_report.bytes_moved,
               "args": {k: str(v) for k, v in asdict(args).items()}},
    )
