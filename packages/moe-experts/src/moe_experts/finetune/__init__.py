"""The main job: an end-to-end LoRA fine-tune of a MoE model on CPU (see ``cli``)."""

from moe_experts.finetune.data import ByteTokenizer, PackedBatches, load_texts
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.loop import FinetuneArgs, FinetuneSummary, run_finetune
from moe_experts.finetune.models import BUILTIN_MODELS, load_model

__all__ = [
    "BUILTIN_MODELS",
    "ByteTokenizer",
    "FinetuneArgs",
    "FinetuneError",
    "FinetuneSummary",
    "PackedBatches",
    "load_model",
    "load_texts",
    "run_finetune",
]
