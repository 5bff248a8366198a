"""The real ``moe-experts finetune`` CLI (``python pref_cli_worker.py GRADS.safetensors ARGS``),
with the gradient of every LoRA tensor recorded at the optimizer step.

The recorder is a subclass of the AdamW the CLI builds: it saves each parameter's gradient (as
the step sees it, after accumulation, rank synchronisation and clipping), keyed by the PEFT
adapter key and in PEFT's layout, then steps as usual. Rank 0 writes the file.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from safetensors.torch import save_file

import moe_experts
from lora_core.contracts import PeftTensorLayout
from moe_experts import peft_mapping
from moe_experts.finetune import cli

_captured: dict[str, Any] = {}
_adapt = moe_experts.adapt_model


def _recording_adapt(*args: Any, **kwargs: Any) -> Any:
    result = _adapt(*args, **kwargs)
    _captured["result"] = result
    return result


def _peft_layout(t: torch.Tensor, layout: PeftTensorLayout) -> torch.Tensor:
    if layout is PeftTensorLayout.EXPERT_STACKED_A:
        return peft_mapping.stack_lora_a(t)
    if layout is PeftTensorLayout.EXPERT_STACKED_B:
        return peft_mapping.stack_lora_b(t)
    return t


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that saves every gradient before its step."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Record the gradients (rank 0), then take the ordinary step."""
        from torch.distributed.tensor import DTensor

        result = _captured["result"]
        params = [p for group in self.param_groups for p in group["params"]]
        names = list(result.parameter_names)
        assert len(names) == len(params), (len(names), len(params))
        grads = {}
        for name, p in zip(names, params, strict=True):
            # FSDP-sharded dense LoRA: every rank joins the gather of the full gradient.
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            export = result.peft_exports[name]
            grads[export.key] = _peft_layout(g.detach().float(), export.layout).contiguous()
        if int(os.environ.get("RANK", "0")) == 0:
            save_file(grads, sys.argv[1])
        return super().step(closure)


if __name__ == "__main__":
    moe_experts.adapt_model = _recording_adapt
    torch.optim.AdamW = RecordingAdamW  # type: ignore[misc]
    sys.exit(cli.finetune_main(sys.argv[2:]))
