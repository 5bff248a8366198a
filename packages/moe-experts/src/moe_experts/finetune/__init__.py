"""The main job: an end-to-end LoRA fine-tune of a MoE model on CPU (see ``cli``).

One job per module: ``config`` (settings table, YAML), ``checks`` (pre-model checks),
``formats``/``data``/``chat``/``tokenizer`` (data formats, masking, batching), ``models``
(loading), ``run`` (``run_finetune``), ``loop`` (steps, checkpoints), ``objective`` (what a
step minimises, per ``--method``), ``loss``, ``preference``/``preference_data``/
``preference_setup`` (DPO and ORPO: objectives, pairs, kept reference log-probs),
``evaluation``, ``schedule``, ``reporting``, ``distributed``, ``interrupts``, ``generate``,
``export``, ``adapters`` and ``cli``. Names are imported on first use, so the CLI starts
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_experts._lazy import lazy_module_attributes

if TYPE_CHECKING:
    from moe_experts.finetune.config import FinetuneArgs
    from moe_experts.finetune.data import (
        ByteTokenizer,
        DataError,
        Example,
        PackedBatches,
        load_examples,
        load_samples,
        load_texts,
    )
    from moe_experts.finetune.errors import (
        FinetuneError,
        PeerLostError,
        TrainingDivergedError,
        TrainingInterrupted,
    )
    from moe_experts.finetune.export import EXPORT_FORMATS, export
    from moe_experts.finetune.formats import DATA_FORMATS, DataFormat, Sample
    from moe_experts.finetune.generate import generate
    from moe_experts.finetune.loop import FinetuneSummary
    from moe_experts.finetune.models import BUILTIN_MODELS, load_model
    from moe_experts.finetune.run import run_finetune

# public name -> the module that defines it
_WHERE = {
    "BUILTIN_MODELS": "models",
    "ByteTokenizer": "data",
    "DATA_FORMATS": "formats",
    "DataError": "data",
    "DataFormat": "formats",
    "EXPORT_FORMATS": "export",
    "Example": "data",
    "FinetuneArgs": "config",
    "FinetuneError": "errors",
    "FinetuneSummary": "loop",
    "PackedBatches": "data",
    "PeerLostError": "errors",
    "Sample": "formats",
    "TrainingDivergedError": "errors",
    "TrainingInterrupted": "errors",
    "export": "export",
    "generate": "generate",
    "load_examples": "data",
    "load_model": "models",
    "load_samples": "data",
    "load_texts": "data",
    "run_finetune": "run",
}

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
    "PeerLostError",
    "Sample",
    "TrainingDivergedError",
    "TrainingInterrupted",
    "export",
    "generate",
    "load_examples",
    "load_model",
    "load_samples",
    "load_texts",
    "run_finetune",
]


__getattr__, __dir__ = lazy_module_attributes(__name__, globals(), _WHERE, __all__)
