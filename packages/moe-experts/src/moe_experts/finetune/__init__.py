"""The main job: an end-to-end LoRA fine-tune of a MoE model on CPU (see ``cli``)."""

from moe_experts.finetune.data import (
    ByteTokenizer,
    DataError,
    Example,
    PackedBatches,
    load_examples,
    load_samples,
    load_texts,
)
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.export import EXPORT_FORMATS, export
from moe_experts.finetune.formats import DATA_FORMATS, DataFormat, Sample
from moe_experts.finetune.generate import generate
from moe_experts.finetune.loop import FinetuneArgs, FinetuneSummary, run_finetune
from moe_experts.finetune.models import BUILTIN_MODELS, load_model

__all__ = [
    "BUILTIN_MODELS",
    "DATA_FORMATS",
    "EXPORT_FORMATS",
    "ByteTokenizer",
    "DataError",
    "DataFormat",
    "Example",
    "FinetuneArgs",
    "FinetuneError",
    "FinetuneSummary",
    "PackedBatches",
    "Sample",
    "export",
    "generate",
    "load_examples",
    "load_model",
    "load_samples",
    "load_texts",
    "run_finetune",
]
