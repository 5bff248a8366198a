"""One rank of the distributed test (run as ``python dist_worker.py MODEL_DIR OUT_DIR``).

FSDP2 shards the dense layers (placeholders passed as ``ignored_params``), dense LoRA is
replicated through ``lora_core.fsdp``, expert LoRA lives in kt-kernel buffers and its
gradients are averaged with ``lora_core.fsdp.sync_replicated_lora_gradients``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import moe_experts
from lora_core import LoraConfig, enable_lora_training
from lora_core.fsdp import replicate_lora_parameters, sync_replicated_lora_gradients
from moe_experts.finetune.distributed import (
    exit_without_finalizing,
    init_distributed,
    teardown_distributed,
)

STEPS = 5
# One config for both producers: AdaptationResult.merge refuses two different lora_configs;
# target_modules/target_parameters select the dense layers and the routers, expert LoRA
# covers every wrapped experts module.
CFG = LoraConfig(
    enable=True,
    rank=2,
    alpha=4,
    init_seed=21,
    target_modules=["q_proj", "o_proj"],
    target_parameters=["mlp.gate.weight"],
)


def batch_for(rank: int) -> torch.Tensor:
    """Each rank trains on different tokens, so unsynchronised gradients would differ."""
    return torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(100 + rank))


def init_b(named: list[tuple[str, torch.Tensor]]) -> None:
    """Make every B non-zero, identically on every rank, so every A also gets gradients."""
    with torch.no_grad():
        for n, p in named:
            if n.endswith(("_b", "lora_B.weight", "le_down")):
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(torch.full(local.shape, 0.05))


# Extra LoRA experts are replicated LoRA too: synchronised like the expert LoRA.
LORA_EXPERTS = {"lora_experts": 2, "lora_expert_intermediate": 8}


def main() -> None:
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    report = moe_experts.wrap(model, weight_dtype="fp32")
    placeholders = {p for _, p in moe_experts.named_placeholders(model)}
    for layer in model.model.layers:
        fully_shard(layer, ignored_params=placeholders)
    fully_shard(model, ignored_params=placeholders)
    dense = enable_lora_training(model, CFG)
    n_replicated = replicate_lora_parameters(model)
    experts = moe_experts.adapt(model, CFG, **LORA_EXPERTS)
    result = dense.merge(experts)
    # replicate_lora_parameters swaps the dense LoRA weights for new DTensor Parameters, so
    # the optimizer takes the live objects by name (the result's names stay valid).
    named = dict(model.named_parameters())
    stale = [n for n, p in result.named_optimizer_parameters if named[n] is not p]
    live = [(n, named[n]) for n in result.parameter_names]
    init_b(live)
    opt = torch.optim.AdamW([p for _, p in live], lr=1e-2)
    ids = batch_for(rank)
    losses, pre_sync_norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        pre_sync_norms.append(
            float(sum(p.grad.double().pow(2).sum() for p in experts.parameters()))
        )
        sync_replicated_lora_gradients(live)
        opt.step()
        losses.append(loss.item())
    params = {}
    for n, p in live:
        t = p.detach()
        params[n] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    torch.save(params, out_dir / f"params_rank{rank}.pt")
    placeholder_names = set(report.placeholders)
    dtensor_placeholders = [
        n for n, p in model.named_parameters() if n in placeholder_names and isinstance(p, DTensor)
    ]
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "losses": losses,
                "pre_sync_norms": pre_sync_norms,
                "placeholders": sorted(placeholder_names),
                "placeholders_all_placeholders": all(
                    moe_experts.is_placeholder(p)
                    for n, p in model.named_parameters()
                    if n in placeholder_names
                ),
                "dtensor_placeholders": dtensor_placeholders,
                "n_dtensor_params": len(sharded),
                "n_replicated": n_replicated,
                "names": list(result.parameter_names),
                "stale_after_replicate": stale,
            }
        )
    )
    dist.barrier()


if __name__ == "__main__":
    main()
    # torch's DTensor caches keep FSDP's mesh, and with it the groups, past their destruction:
    # then the gloo threads must not meet the interpreter's finalisation (see teardown).
    if not teardown_distributed():
        exit_without_finalizing(0)
