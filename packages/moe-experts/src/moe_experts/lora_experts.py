"""Extra trainable "LoRA experts": small SwiGLU MLPs whose mean joins each MoE block's output.

KTransformers' SFT path offers them beside expert LoRA: ``N`` dense experts of width ``J``
(``le_gate``/``le_up`` ``[N, J, H]``, ``le_down`` ``[N, H, J]``) that every token uses. They
live inside :class:`~moe_experts.KernelExperts` (child ``lora_experts``), so their output is
added to the routed experts' output and the MoE block's own code stays untouched. ``le_down``
starts at zero, so a fresh model computes exactly what it did before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_core import init_lora_tensor

__all__ = ["LoraExperts"]


class LoraExperts(nn.Module):
    """``y = mean_n le_down[n] @ (silu(le_gate[n] @ x) * (le_up[n] @ x))`` over ``N`` experts.

    Attributes:
        num_experts: N.
        hidden_size: H.
        intermediate_size: J, the width of each LoRA expert.
        le_gate: ``[N, J, H]``; initialised like a LoRA ``A`` (uniform, ``1/sqrt(H)`` bounds).
        le_up: ``[N, J, H]``; initialised like a LoRA ``A``.
        le_down: ``[N, H, J]``; zeros, like a LoRA ``B``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        name: str,
        seed: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Create the tensors from ``lora_core.init_lora_tensor`` under ``name``.

        Args:
            num_experts: N >= 1.
            hidden_size: H.
            intermediate_size: J >= 1.
            name: fully-qualified module name, e.g. ``"model.layers.0.mlp.experts.lora_experts"``;
                each tensor's values are a pure function of (seed, name).
            seed: ``LoraConfig.init_seed``.
            dtype: parameter dtype.
        """
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        n, h, j = num_experts, hidden_size, intermediate_size
        self.le_gate = nn.Parameter(
            init_lora_tensor(f"{name}.le_gate.lora_A", (n, j, h), dtype, seed=seed)
        )
        self.le_up = nn.Parameter(
            init_lora_tensor(f"{name}.le_up.lora_A", (n, j, h), dtype, seed=seed)
        )
        self.le_down = nn.Parameter(
            init_lora_tensor(f"{name}.le_down.lora_B", (n, h, j), dtype, seed=seed)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``, the mean of the N experts' outputs, in ``x.dtype``."""
        xs = x.to(self.le_gate.dtype)
        gate = torch.einsum("th,njh->ntj", xs, self.le_gate)
        up = torch.einsum("th,njh->ntj", xs, self.le_up)
        y = torch.einsum("ntj,nhj->th", F.silu(gate) * up, self.le_down) / self.num_experts
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Sizes."""
        return f"num_experts={self.num_experts}, H={self.hidden_size}, J={self.intermediate_size}"
