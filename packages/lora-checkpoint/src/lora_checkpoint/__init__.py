"""Atomic, verified, PEFT-compatible checkpoints for LoRA adapters.

``save(root, result)`` publishes ``<root>/step-XXXXXXXX`` atomically and points
``<root>/latest`` at it; ``load(root)`` reads it back strictly; ``restore(model, loaded)``
copies the tensors into the existing parameters in place.
"""

from lora_checkpoint._version import __version__
from lora_checkpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    DigestMismatchError,
    DtypeMismatchError,
    ManifestError,
    MissingFileError,
    MissingTensorError,
    ShapeMismatchError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnknownFormatVersionError,
    UnsafeFileError,
)
from lora_checkpoint.manifest import (
    FORMAT_VERSION,
    DigestAlgorithm,
    FileEntry,
    Manifest,
    ParameterEntry,
    RankShard,
    TensorEntry,
    TensorKind,
    TrainingStateInfo,
    parse_manifest,
    register_migration,
    registered_migrations,
    unregister_migration,
)
from lora_checkpoint.reader import LoadedCheckpoint, load, resolve_checkpoint, restore, verify
from lora_checkpoint.training_state import OptimizerState, RngState, TrainingState
from lora_checkpoint.writer import (
    ADAPTER_CONFIG,
    ADAPTER_MODEL,
    FUSED_EXPERT_LORA,
    MANIFEST,
    list_checkpoints,
    rank_local_file,
    save,
    to_peft_layout,
    training_state_files,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_MODEL",
    "FORMAT_VERSION",
    "FUSED_EXPERT_LORA",
    "MANIFEST",
    "CheckpointError",
    "CheckpointExistsError",
    "DigestAlgorithm",
    "DigestMismatchError",
    "DtypeMismatchError",
    "FileEntry",
    "LoadedCheckpoint",
    "Manifest",
    "ManifestError",
    "MissingFileError",
    "MissingTensorError",
    "OptimizerState",
    "ParameterEntry",
    "RankShard",
    "RngState",
    "ShapeMismatchError",
    "TensorEntry",
    "TensorKind",
    "TrainingState",
    "TrainingStateInfo",
    "TruncatedFileError",
    "UnexpectedTensorError",
    "UnknownFormatVersionError",
    "UnsafeFileError",
    "__version__",
    "list_checkpoints",
    "load",
    "parse_manifest",
    "rank_local_file",
    "register_migration",
    "registered_migrations",
    "resolve_checkpoint",
    "restore",
    "save",
    "to_peft_layout",
    "training_state_files",
    "unregister_migration",
    "verify",
]
