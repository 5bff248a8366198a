"""Where each part of a fine-tune runs: the dense device, the process group, the kernel's cores.

``--device cuda`` puts the dense weights (bf16), the LoRA factors and the AdamW state (fp32 by
default, ``--lora-dtype``) on ``cuda:LOCAL_RANK``; the routed experts stay in the host kernel,
one copy per machine. Under torchrun the default process group is ``cpu:gloo,cuda:nccl``: the
dense LoRA gradients (CUDA tensors, FSDP2 on a CUDA mesh) go over NCCL, host tensors (expert
LoRA gradients, the experts' shared-memory handshake, loss and flags) over gloo. Each rank's
kernel threads take their share of the host's cores, on the NUMA node of the rank's GPU where
the host has several (read from ``/sys``; without it, an even share of the allowed cores).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "DEVICE_CHOICES",
    "HybridSetup",
    "KernelCores",
    "Placement",
    "apply_kernel_cores",
    "check_devices",
    "expert_count",
    "parse_cpulist",
    "placement_summary",
    "plan_kernel_cores",
    "prepare_hybrid",
    "read_numa_nodes",
    "resolve_placement",
    "restore_gpu_experts",
    "set_lora_dtype",
]

DEVICE_CHOICES = ("auto", "cpu", "cuda")
LORA_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
# config.json keys that hold the routed expert count, across the supported families.
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_SYS_NODES = Path("/sys/devices/system/node")
_SYS_PCI = Path("/sys/bus/pci/devices")


@dataclass(frozen=True)
class Placement:
    """The devices and dtypes of one rank's run.

    Attributes:
        dense: ``cuda:LOCAL_RANK`` or ``cpu``: dense weights, LoRA, optimizer state.
        dense_dtype: bf16 on CUDA (what GPUs train in), fp32 on the CPU (the oracle's dtype).
        lora_dtype: the LoRA factors', their gradients' and AdamW's state dtype.
        backend: the default process group's backend under torchrun.
    """

    dense: torch.device
    dense_dtype: torch.dtype
    lora_dtype: torch.dtype
    backend: str

    @property
    def cuda(self) -> bool:
        """Whether the dense layers run on a CUDA device."""
        return self.dense.type == "cuda"


def _local_rank() -> int:
    try:
        return max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0


def _local_world() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU or driver"


def resolve_placement(device: str, lora_dtype: str = "fp32", flag: str = "--device") -> Placement:
    """The placement ``--device`` asks for on this machine and this local rank.

    Raises:
        FinetuneError: ``cuda`` without a usable CUDA device, or a local rank without a GPU.
    """
    if device not in DEVICE_CHOICES:
        raise FinetuneError(f"{flag} {device!r}: expected one of {', '.join(DEVICE_CHOICES)}")
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise FinetuneError(
            f"{flag} cuda: {_no_cuda_reason()}; run on a machine with a GPU and a CUDA build "
            f"of torch, or pass {flag} cpu"
        )
    use_cuda = device == "cuda" or (device == "auto" and available)
    if not use_cuda:
        return Placement(torch.device("cpu"), torch.float32, LORA_DTYPES[lora_dtype], "gloo")
    rank, count = _local_rank(), torch.cuda.device_count()
    if rank >= count:
        raise FinetuneError(
            f"{flag} {device}: local rank {rank} would use cuda:{rank}, but this machine has "
            f"{count} GPU(s); launch at most {count} processes per machine (torchrun "
            f"--nproc-per-node {count})"
        )
    return Placement(
        torch.device("cuda", rank), torch.bfloat16, LORA_DTYPES[lora_dtype], "cpu:gloo,cuda:nccl"
    )


def expert_count(model_dir: Path) -> int | None:
    """Routed experts per MoE layer as ``config.json`` states it (``None``: not stated)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for node in (config, config.get("text_config") or {}):
        if isinstance(node, Mapping):
            for key in _EXPERT_KEYS:
                value = node.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def check_devices(args: Any, sources: Mapping[str, str]) -> Placement:
    """Resolve ``--device`` and refuse what cannot run, before any model loads.

    Raises:
        FinetuneError: ``--device cuda`` without CUDA, ``--gpu-experts`` on the CPU or above
            the model's expert count.
    """
    n = args.gpu_experts
    flag = sources.get("gpu_experts", "--gpu-experts")
    if n:
        from moe_experts.finetune.models import BUILTIN_MODELS

        if args.model in BUILTIN_MODELS:
            total = BUILTIN_MODELS[args.model].get("num_experts")
        else:
            total = expert_count(Path(args.model))
        if isinstance(total, int) and n > total:
            raise FinetuneError(
                f"{flag} {n} is more than the {total} routed experts per layer of --model "
                f"{args.model}; pass at most {total}"
            )
    placement = resolve_placement(args.device, args.lora_dtype, sources.get("device", "--device"))
    if n and not placement.cuda:
        why = "--device cpu" if args.device == "cpu" else "--device auto found no CUDA device"
        raise FinetuneError(
            f"{flag} {n} keeps the most-routed experts resident on the GPU, but the dense "
            f"layers run on the CPU ({why}); run with --device cuda, or drop {flag}"
        )
    return placement


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def read_numa_nodes(root: Path = _SYS_NODES) -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from ``/sys`` (empty where the host does not say)."""
    nodes: dict[int, list[int]] = {}
    try:
        entries = sorted(root.glob("node[0-9]*"))
    except OSError:
        return {}
    for entry in entries:
        try:
            cpus = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(entry.name[4:])] = cpus
    return nodes


def _gpu_numa_node(index: int) -> int | None:
    """The NUMA node of ``cuda:index`` from its PCI address, or ``None`` where unknown."""
    try:
        props = torch.cuda.get_device_properties(index)
        # getattr: older torch builds lack the PCI fields (then: unknown, an even share).
        bus, slot = getattr(props, "pci_bus_id"), getattr(props, "pci_device_id")  # noqa: B009
        address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{slot:02x}.0"
        node = int((_SYS_PCI / address / "numa_node").read_text())
    except (AttributeError, OSError, ValueError, RuntimeError, AssertionError):
        return None
    return node if node >= 0 else None


@dataclass(frozen=True)
class KernelCores:
    """The host cores one rank's kernel threads run on.

    Attributes:
        cores: CPU ids (the thread count is their number).
        node: the NUMA node they belong to, or ``None`` (one node, or unknown).
    """

    cores: tuple[int, ...]
    node: int | None

    def describe(self) -> str:
        """``"8 threads on cores 0-7 (NUMA node 0)"``."""
        c = self.cores
        span = (
            f"{c[0]}-{c[-1]}"
            if len(c) > 1 and c[-1] - c[0] == len(c) - 1
            else ",".join(map(str, c))
        )
        where = f" (NUMA node {self.node})" if self.node is not None else ""
        return f"{len(c)} threads on cores {span}{where}"


def _share(cores: Sequence[int], index: int, parts: int) -> list[int]:
    """The ``index``-th of ``parts`` contiguous, near-equal slices of ``cores``."""
    n = len(cores)
    lo, hi = index * n // parts, (index + 1) * n // parts
    return list(cores[lo:hi])


def plan_kernel_cores(
    allowed: Sequence[int],
    nodes: Mapping[int, Sequence[int]],
    gpu_nodes: Sequence[int | None],
    local_rank: int,
) -> KernelCores:
    """Split the host's cores between the local ranks, each on its GPU's NUMA node if known.

    Args:
        allowed: the CPUs this process may run on (its affinity).
        nodes: NUMA node -> CPUs (one entry or none: no NUMA choice to make).
        gpu_nodes: per local rank, the NUMA node of its GPU (``None``: unknown or no GPU).
        local_rank: this process's local rank.

    Returns:
        The cores of this rank: an even share of its GPU's node's allowed cores among the
        ranks whose GPU is on that node, else an even share of every allowed core.
    """
    allowed = sorted(set(allowed))
    world = max(1, len(gpu_nodes))
    mine = gpu_nodes[local_rank] if local_rank < len(gpu_nodes) else None
    if len(nodes) > 1 and mine is not None and mine in nodes:
        peers = [r for r, n in enumerate(gpu_nodes) if n == mine]
        node_cores = [c for c in nodes[mine] if c in set(allowed)]
        share = _share(node_cores, peers.index(local_rank), len(peers))
        if share:
            return KernelCores(tuple(share), mine)
    share = _share(allowed, min(local_rank, world - 1), world) or allowed
    return KernelCores(tuple(share), None)


def apply_kernel_cores(placement: Placement) -> KernelCores | None:
    """Give this rank's kernel its share of the cores (pinned on CUDA hosts); describe it.

    Only under torchrun with several local ranks, and never over the user's own choice
    (``KT_KERNEL_THREADS``, or ``OMP_NUM_THREADS`` other than torchrun's 1). On a CUDA host
    every thread of the process is pinned to the rank's cores, so the kernel's pool and its
    memory stay on the GPU's NUMA node. Any failure to read the topology or to pin falls back
    to an even share (or leaves the defaults), never stops the run.

    Returns:
        The cores chosen, or ``None`` when the defaults were left alone.
    """
    import kt_kernel

    local = _local_world()
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if local <= 1 or os.environ.get("KT_KERNEL_THREADS") or (omp and omp != "1"):
        return None
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    gpu_nodes: list[int | None] = [None] * local
    if placement.cuda:
        gpu_nodes = [_gpu_numa_node(i) for i in range(min(local, torch.cuda.device_count()))]
        gpu_nodes += [None] * (local - len(gpu_nodes))
    plan = plan_kernel_cores(allowed, read_numa_nodes(), gpu_nodes, _local_rank())
    if placement.cuda and hasattr(os, "sched_setaffinity"):
        # Every existing thread (the kernel's pool was started while loading), and through
        # inheritance every later one.
        try:
            tasks = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tasks = [0]
        for tid in tasks:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, plan.cores)
    kt_kernel.set_num_threads(len(plan.cores))
    return plan


def placement_summary(setup: HybridSetup, model: nn.Module, *, checkpointing: bool) -> str:
    """One line saying where each part lives (printed by rank 0 before training)."""
    from moe_experts import KernelExperts

    kernels = [m for m in model.modules() if isinstance(m, KernelExperts)]
    storage = sorted({k.expert_weights.weight_dtype for k in kernels}) or ["none"]
    shared = max((k.shared_by for k in kernels), default=1)
    copies = f"one copy shared by {shared} local ranks" if shared > 1 else "one copy per process"
    placement, cores = setup.placement, setup.cores
    threads = cores.describe() if cores is not None else "default threads"
    dense = f"{placement.dense} ({str(placement.dense_dtype).removeprefix('torch.')})"
    lora = str(placement.lora_dtype).removeprefix("torch.")
    first = None if setup.gpu is None else next(iter(setup.gpu.layers.values()), None)
    hot = (
        f"{first.n} per MoE layer on {placement.dense} ({str(first.dtype).removeprefix('torch.')})"
        if first is not None
        else "none"
    )
    return (
        f"placement: dense weights {dense}; LoRA, gradients and AdamW state {lora} beside "
        f"their weights (dense on {placement.dense}, expert LoRA with the host kernel); "
        f"routed experts on the host kernel ({'/'.join(storage)} storage, {copies}, {threads}); "
        f"hot experts: {hot}; overlap {'on' if setup.overlap else 'off'}; gradient checkpointing "
        f"{'on' if checkpointing else 'off'}"
    )


@dataclass
class HybridSetup:
    """What :func:`prepare_hybrid` switched on, for the loop and the checkpoint."""

    placement: Placement
    overlap: bool
    gpu: Any = None  # moe_experts.hot_experts.GpuExperts, or None
    cores: KernelCores | None = None

    def position(self) -> dict[str, Any]:
        """Checkpoint fields: the fixed hot-expert sets (a resumed run keeps them)."""
        if self.gpu is None or not self.gpu.fixed:
            return {}
        return {"gpu_experts": self.gpu.sets()}


def set_lora_dtype(result: Any, dtype: torch.dtype) -> int:
    """Cast every trainable LoRA tensor of ``result`` to ``dtype`` in place; returns how many."""
    changed = 0
    with torch.no_grad():
        for _, p in result.named_optimizer_parameters:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
                changed += 1
    return changed


def prepare_hybrid(model: nn.Module, result: Any, args: Any, placement: Placement) -> HybridSetup:
    """LoRA dtype, overlap, activation checkpointing, hot experts and kernel cores of a run.

    Raises:
        FinetuneError: ``--gpu-experts`` above a layer's expert count (where ``config.json``
            did not say, so it could not be refused before loading).
    """
    from moe_experts.checkpointing import enable_gradient_checkpointing
    from moe_experts.hot_experts import GpuExpertsError, enable_gpu_experts
    from moe_experts.hybrid import enable_overlap
    from moe_experts.wrapping import experts_sites

    set_lora_dtype(result, placement.lora_dtype)
    overlap = placement.cuda if args.overlap is None else bool(args.overlap)
    has_kernel = bool(experts_sites(model))
    if overlap and has_kernel:
        enable_overlap(model)
    if args.gradient_checkpointing:
        try:
            enable_gradient_checkpointing(model)
        except ValueError as exc:
            raise FinetuneError(f"--gradient-checkpointing: {exc}") from exc
    gpu = None
    if args.gpu_experts and has_kernel:
        try:
            # Counted over the first optimizer step's micro-batches, fixed from the second.
            gpu = enable_gpu_experts(
                model, args.gpu_experts, count_calls=args.grad_accum, device=placement.dense
            )
        except GpuExpertsError as exc:
            raise FinetuneError(f"--gpu-experts {args.gpu_experts}: {exc}") from exc
    return HybridSetup(placement, overlap and has_kernel, gpu, apply_kernel_cores(placement))


def restore_gpu_experts(setup: HybridSetup, checkpoint: Path) -> bool:
    """Give a resumed run the hot-expert sets its checkpoint recorded; whether there were any.

    Raises:
        FinetuneError: the recorded sets do not fit this run (layers, ``--gpu-experts``).
    """
    if setup.gpu is None:
        return False
    import lora_checkpoint
    from moe_experts.hot_experts import GpuExpertsError

    try:
        state = lora_checkpoint.load(checkpoint, verify=False).training_state
    except (lora_checkpoint.CheckpointError, OSError) as exc:
        raise FinetuneError(f"--resume {checkpoint}: {exc}") from exc
    sets = None if state is None else state.data_position.get("gpu_experts")
    if not sets:
        return False
    try:
        setup.gpu.restore(sets)
    except GpuExpertsError as exc:
        raise FinetuneError(f"--resume {checkpoint}: {exc}") from exc
    return True
