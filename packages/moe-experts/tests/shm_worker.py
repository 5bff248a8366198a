"""One rank of the shared-expert tests (``torchrun ... shm_worker.py MODEL OUT MODE [CRASH]``).

MODE ``load`` builds the model with ``load_pretrained``, ``wrap`` with ``from_pretrained`` +
``wrap``. The rank records what its expert storage is (a digest of every byte, which also
makes every page resident), the proportional set size of the shared segments it maps, then
trains a few steps of expert LoRA with gradients averaged over all ranks.

CRASH ``map`` makes local rank 1 SIGKILL itself while mapping the second block (it holds the
descriptor, local rank 0 has handed it over); ``train`` after its first training step. (The
test pauses local rank 0 right after it creates a block's storage through
``MOE_EXPERTS_TEST_PAUSE_AFTER_CREATE`` and SIGKILLs it there.) ``nomem`` caps local rank 0's
file size (RLIMIT_FSIZE) below one block, as a machine without the memory would refuse it.

CRASH ``fail`` expects the build to raise (the test hands over a checkpoint with a bad tensor)
and records each rank's error and the descriptors it opened meanwhile; ``fail-install`` makes
local rank 1 alone fail to install the last block it loaded (after the block was shared),
``fail-selfcheck`` makes it alone refuse the first block's self-check in ``wrap``: a failure
outside the hand-over, which the other rank must learn about instead of waiting for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import signal
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import kt_kernel
import moe_experts
from lora_core import LoraConfig
from lora_core.fsdp import sync_replicated_lora_gradients
from moe_experts.finetune.distributed import init_distributed, teardown_distributed

STEPS = 3
# Expert LoRA only (adapt); target_modules is required by LoraConfig but unused here.
CFG = LoraConfig(enable=True, rank=2, alpha=4, init_seed=5, target_modules=["q_proj"])


def batch_for(rank: int) -> torch.Tensor:
    """Each rank's tokens differ, so unsynchronised gradients would differ."""
    return torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(300 + rank))


def init_b(named: list[tuple[str, torch.Tensor]]) -> None:
    """Non-zero B everywhere (identically on every rank) so every A gets a gradient."""
    with torch.no_grad():
        for n, p in named:
            if n.endswith("_b"):
                p.fill_(0.05)


def build(model_dir: Path, mode: str) -> torch.nn.Module:
    """The model with its experts on the kernel, by ``load_pretrained`` or ``wrap``."""
    if mode == "load":
        return moe_experts.load_pretrained(model_dir, weight_dtype="fp32", dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    moe_experts.wrap(model, weight_dtype="fp32")
    return model


def storage_digest(model: torch.nn.Module) -> tuple[str, list[int]]:
    """sha256 of every block's kernel storage, and each storage tensor's address."""
    h = hashlib.sha256()
    ptrs = []
    for _, kernel in moe_experts.experts_sites(model):
        w = kernel.expert_weights
        for t in (*w.storage[0], *w.storage[1]):
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            ptrs.append(t.data_ptr())
    return h.hexdigest(), ptrs


_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def shared_mappings() -> list[dict]:
    """Every mapping of kt-kernel shared storage: name, address range, Pss and Rss in bytes."""
    out, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = _HEAD.match(line)
        if m:
            cur = None
            if "/memfd:ktk-" in m.group(3):
                cur = {
                    "path": m.group(3),
                    "start": int(m.group(1), 16),
                    "end": int(m.group(2), 16),
                    "pss": 0,
                    "rss": 0,
                }
                out.append(cur)
        elif cur is not None and line.startswith(("Pss:", "Rss:")):
            key, value = line.split(":")[0].lower(), int(line.split()[1]) * 1024
            cur[key] = value
    return out


def open_fds() -> dict[int, str]:
    """This process's open descriptors: number -> what it is."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory listing's own descriptor, closed meanwhile
            continue
    return out


def inject_failure(crash: str) -> None:
    """Make this rank alone fail outside the hand-over (``fail-install``/``fail-selfcheck``)."""
    if crash == "fail-install":
        import moe_experts.loading as loading

        real_install, calls = loading.CheckpointSource.install, []

        def install(source, kernel):
            name = source.site.experts_name
            calls.append(name)
            if len(calls) == 2:  # the last block: the other rank has left its loop by now
                raise moe_experts.LoadError(f"{name}: injected install failure")
            return real_install(source, kernel)

        loading.CheckpointSource.install = install
    elif crash == "fail-selfcheck":
        import moe_experts.wrapping as wrapping

        def refuse(name, *args, **kwargs):
            raise moe_experts.SelfCheckError(f"{name}: injected self-check failure")

        wrapping.self_check_block = refuse


def expect_failure(model_dir: Path, out_dir: Path, mode: str, crash: str) -> None:
    """Build, expecting an error; record it and the descriptors left open by the failure."""
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    if local_rank == 1:
        inject_failure(crash)
    before = open_fds()
    error = None
    try:
        build(model_dir, mode)
    except Exception as exc:  # the test checks its type and message
        error = {"type": type(exc).__name__, "message": str(exc)}
    after = open_fds()
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "error": error,
                "leaked": sorted(
                    target for fd, target in after.items() if before.get(fd) != target
                ),
            }
        )
    )
    dist.barrier()
    leave()


def leave() -> None:
    """Destroy the process groups; nothing of the library may still hold one (see teardown)."""
    if not teardown_distributed():
        raise SystemExit("the default process group outlived destroy_process_group")


def main() -> None:
    model_dir, out_dir, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    crash = sys.argv[4] if len(sys.argv) > 4 else ""
    init_distributed()
    if crash.startswith("fail"):
        expect_failure(model_dir, out_dir, mode, crash)
        return
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    if crash == "map" and local_rank == 1:
        real, calls = kt_kernel.map_shared, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        kt_kernel.map_shared = dying
    if crash == "nomem" and local_rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    model = build(model_dir, mode)
    digest, ptrs = storage_digest(model)  # reads every page of this rank's storage
    dist.barrier()  # every rank has touched every page before any measures its share
    maps = shared_mappings()
    inside = all(any(m["start"] <= p < m["end"] for m in maps) for p in ptrs)
    kernel_bytes = sum(k.expert_weights.nbytes for _, k in moe_experts.experts_sites(model))
    torch.manual_seed(0)
    result = moe_experts.adapt(model, CFG)
    named = list(result.named_optimizer_parameters)
    init_b(named)
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    ids = batch_for(rank)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        sync_replicated_lora_gradients(named)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if crash == "train" and local_rank == 1 and step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "digest": digest,
                "inside_shared": inside,
                "maps": maps,
                "kernel_bytes": kernel_bytes,
                "kernel_threads": kt_kernel.get_num_threads(),
                "losses": losses,
                "pid": os.getpid(),
                "local_rank": local_rank,
            }
        )
    )
    torch.save({n: p.detach().clone() for n, p in named}, out_dir / f"params{rank}.pt")
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()
