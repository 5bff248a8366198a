"""Guards against silently untrained experts: a per-block coverage report and a gradient check.

Users' most common MoE-LoRA complaint is an expert bank or router that silently gets no LoRA
or no gradient. :func:`coverage_report` says, per MoE block, what an
:class:`~lora_core.contracts.AdaptationResult` trains, and how packed examples are kept apart
in the family; :func:`check_gradients` runs after the first backward and refuses parameters
whose gradient is missing, non-finite or all zeros.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lora_core.contracts import AdaptationResult
from moe_experts.architectures import find_architecture, iter_moe_blocks
from moe_experts.errors import GradientCheckError
from moe_experts.isolation import DEMO_PADDING_COST, Packing
from moe_experts.kernel_experts import KernelExperts, unwrap_peft

__all__ = [
    "BlockCoverage",
    "MoECoverage",
    "check_gradients",
    "coverage_report",
    "coverage_summary",
]

# kt-kernel LoRA buffer prefix -> the transformers projection it adapts.
_BUFFER_PROJECTION = {
    "gate_up": "gate_up_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


@dataclass(frozen=True)
class BlockCoverage:
    """What one MoE block trains.

    Attributes:
        block: fully-qualified block name, e.g. ``"model.layers.3.mlp"``.
        routed_experts: projections of the routed experts with LoRA (``("gate_up_proj",
            "down_proj")``); empty when the experts are untrained.
        on_kernel: whether the routed experts run on kt-kernel (wrapped).
        shared_experts: shared-expert submodules with LoRA, relative to the block.
        has_shared_experts: whether the family has shared experts in this block.
        router: whether the router has LoRA.
        shared_expert_gate: whether the shared-expert gate has LoRA; ``None`` when the family
            has no such gate.
        lora_experts: number of extra "LoRA experts" added to the block (0 if none).
    """

    block: str
    routed_experts: tuple[str, ...]
    on_kernel: bool
    shared_experts: tuple[str, ...]
    has_shared_experts: bool
    router: bool
    shared_expert_gate: bool | None
    lora_experts: int = 0


@dataclass(frozen=True)
class MoECoverage:
    """Per-block coverage of one model (see :func:`coverage_report`).

    Attributes:
        family: the registry key of the model's family.
        blocks: one entry per MoE block, in module order.
        packing: how the fine-tune CLI keeps packed examples apart in this family.
        packing_reason: why the family needs that way.
    """

    family: str
    blocks: tuple[BlockCoverage, ...]
    packing: Packing = Packing.POSITIONS
    packing_reason: str = ""

    @property
    def packing_line(self) -> str:
        """The packing method, why, and what a fallback to one example per row costs."""
        line = f"packing: {self.packing.description}: {self.packing_reason}"
        if not self.packing.shares_rows:
            line += f"; on the chat demo that is {DEMO_PADDING_COST}"
        return line

    @property
    def untrained_experts(self) -> tuple[str, ...]:
        """Blocks whose routed experts have no LoRA."""
        return tuple(b.block for b in self.blocks if not b.routed_experts)


def _module_of(param_name: str) -> str:
    """``a.b.lora_A.weight`` / ``a.b.lora_A.default.weight`` -> ``a.b``."""
    return param_name.split(".lora_", 1)[0]


def _routed(kernel: KernelExperts | None, prefix: str, names: Iterable[str]) -> tuple[str, ...]:
    names = [n for n in names if n.startswith(prefix) and ".lora_experts." not in n]
    if not names:
        return ()
    if kernel is not None and kernel.adopted_peft:
        return tuple(sorted(kernel.peft_parameter_names))
    found = set()
    for n in names:
        leaf = n.rsplit(".", 1)[-1]
        if "_lora_" in leaf:
            found.add(_BUFFER_PROJECTION.get(leaf.split("_lora_", 1)[0], leaf))
        else:  # a PEFT ParamWrapper that was never wrapped: its parameter name is in the path
            found.add(n[len(prefix) :].split(".", 1)[0])
    return tuple(sorted(found))


def coverage_report(model: nn.Module, result: AdaptationResult) -> MoECoverage:
    """Say, per MoE block of ``model``, which parts ``result`` trains.

    Args:
        model: the adapted model (wrapped or not).
        result: the merged :class:`~lora_core.contracts.AdaptationResult` given to the
            optimizer.

    Returns:
        A :class:`MoECoverage` with one :class:`BlockCoverage` per MoE block, in module order.

    Raises:
        UnsupportedModelError: ``model`` is not a supported MoE family.
    """
    arch = find_architecture(model)
    names = set(result.parameter_names)
    blocks = []
    for site in iter_moe_blocks(model, arch):
        _, base = unwrap_peft(getattr(site.block, arch.experts_attr))
        kernel = base if isinstance(base, KernelExperts) else None
        routed = _routed(kernel, site.experts_name + ".", names)
        shared = sorted(
            {
                _module_of(n)[len(site.name) + 1 :]
                for n in names
                for attr in arch.shared_expert_attrs
                if n.startswith(f"{site.name}.{attr}.")
            }
        )
        router = any(n.startswith(f"{site.name}.{arch.router_attr}.") for n in names)
        gate = arch.shared_expert_gate_attr
        gate_trained = (
            None if gate is None else any(n.startswith(f"{site.name}.{gate}.") for n in names)
        )
        extra = kernel.lora_experts if kernel is not None else None
        blocks.append(
            BlockCoverage(
                block=site.name,
                routed_experts=routed,
                on_kernel=kernel is not None,
                shared_experts=tuple(shared),
                has_shared_experts=any(
                    getattr(site.block, a, None) is not None for a in arch.shared_expert_attrs
                ),
                router=router,
                shared_expert_gate=gate_trained,
                lora_experts=extra.num_experts if extra is not None else 0,
            )
        )
    return MoECoverage(
        family=arch.family,
        blocks=tuple(blocks),
        packing=arch.packing,
        packing_reason=arch.packing_reason,
    )


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def coverage_summary(model: nn.Module, result: AdaptationResult, *, max_rows: int = 16) -> str:
    """A one-screen table of :func:`coverage_report`, consecutive identical blocks folded.

    Args:
        model: the adapted model.
        result: the merged :class:`~lora_core.contracts.AdaptationResult`.
        max_rows: fold to at most this many table rows.

    Returns:
        Multi-line text ending with a line naming blocks whose routed experts are untrained.
    """
    report = coverage_report(model, result)
    rows: list[tuple[list[str], tuple[str, ...]]] = []
    for b in report.blocks:
        shared = ",".join(b.shared_experts) or ("NO" if b.has_shared_experts else "-")
        cells = (
            "+".join(p.removesuffix("_proj") for p in b.routed_experts) or "NONE",
            "yes" if b.on_kernel else "NO",
            shared,
            _yes(b.router),
            _yes(b.shared_expert_gate),
            str(b.lora_experts),
        )
        if rows and rows[-1][1] == cells:
            rows[-1][0].append(b.block)
        else:
            rows.append(([b.block], cells))
    header = (
        "blocks",
        "routed LoRA",
        "kernel",
        "shared experts",
        "router",
        "shared gate",
        "LoRA experts",
    )
    table = [header] + [
        ((f"{names[0]} (+{len(names) - 1})" if len(names) > 1 else names[0]), *cells)
        for names, cells in rows[:max_rows]
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [f"MoE coverage ({report.family}, {len(report.blocks)} blocks):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more row groups")
    lines.append(f"  {report.packing_line}")
    missing = report.untrained_experts
    lines.append(
        f"  WARNING routed experts without LoRA: {', '.join(missing)}"
        if missing
        else "  every block's routed experts are trained"
    )
    return "\n".join(lines)


# The two factors of one adapter hang off one owning module: lora-core's ``owner.lora_A.weight``,
# PEFT's ``owner.lora_A.<adapter>.weight`` and ``owner.lora_embedding_A.<adapter>`` (PEFT starts
# an embedding's A at zero and its B random, the reverse of a linear layer).
_FACTOR_PAIRS = {
    "lora_A": "lora_B",
    "lora_B": "lora_A",
    "lora_embedding_A": "lora_embedding_B",
    "lora_embedding_B": "lora_embedding_A",
}


def _partner(name: str, values: Mapping[str, torch.Tensor]) -> str | None:
    """The trainable tensor that multiplies ``name`` in its adapter, if there is one.

    Paired by the owning module: the factor is the attribute two or three components from the
    end (after it only PEFT's adapter name and the leaf), so an adapter that is itself called
    ``lora_A``, several adapters, or a module path that mentions ``lora_A`` pair correctly; a
    candidate counts only if it is among the trainable tensors.
    """
    parts = name.split(".")
    for depth in (3, 2):
        if len(parts) > depth and parts[-depth] in _FACTOR_PAIRS:
            other = ".".join([*parts[:-depth], _FACTOR_PAIRS[parts[-depth]], *parts[1 - depth :]])
            if other in values:
                return other
    for mine, theirs in (("_lora_a", "_lora_b"), ("_lora_b", "_lora_a")):  # kernel buffers
        if name.endswith(mine) and name[: -len(mine)] + theirs in values:
            return name[: -len(mine)] + theirs
    if name.endswith((".le_gate", ".le_up")):
        return name.rsplit(".", 1)[0] + ".le_down"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor gradient under FSDP
    return to_local() if callable(to_local) else t


def check_gradients(
    source: AdaptationResult | nn.Module, *, warn_only: bool = False
) -> tuple[str, ...]:
    """After a backward, check that every trainable parameter got a finite, non-zero gradient.

    An all-zero gradient is accepted only where it is structural: a non-zero LoRA factor whose
    partner in the same adapter of the same module is still exactly zero gets zero gradient by
    construction (``A`` while ``B`` is zero, as at initialisation; PEFT's embedding ``B`` while
    its ``A`` is zero; a LoRA expert's ``le_gate``/``le_up`` while ``le_down`` is zero).

    Args:
        source: the :class:`~lora_core.contracts.AdaptationResult` given to the optimizer, or
            a model (its parameters with ``requires_grad``).
        warn_only: emit a ``RuntimeWarning`` instead of raising.

    Returns:
        ``"<name>: <problem>"`` for every failing parameter (empty when all are fine).

    Raises:
        GradientCheckError: some parameter failed and ``warn_only`` is false; lists them.
    """
    if isinstance(source, AdaptationResult):
        named = list(source.named_optimizer_parameters)
    else:
        named = [(n, p) for n, p in source.named_parameters() if p.requires_grad]
    values = dict(named)
    problems = []
    for name, p in named:
        if p.grad is None:
            problems.append(f"{name}: no gradient (not reached by the loss)")
            continue
        g = _local(p.grad).detach()
        if not bool(torch.isfinite(g).all()):
            problems.append(f"{name}: non-finite gradient")
        elif not bool(g.any()):
            partner = _partner(name, values)
            other = values.get(partner) if partner is not None else None
            # Structural only while the partner is zero and this factor is not: with both at
            # zero neither can ever move.
            if (
                other is None
                or bool(_local(other).detach().any())
                or not bool(_local(p).detach().any())
            ):
                problems.append(f"{name}: gradient is all zeros")
    if problems:
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        msg = (
            f"{len(problems)} of {len(named)} trainable parameters are not being trained:\n"
            f"  {shown}{more}\nCheck target_modules/target_parameters/exclude_modules and that "
            "every adapted block is on the forward path"
        )
        if not warn_only:
            raise GradientCheckError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return tuple(problems)
