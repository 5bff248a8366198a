"""The ``manifest.json`` schema, its strict parser and the format-migration registry."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lora_checkpoint.errors import ManifestError, UnknownFormatVersionError
from lora_core.contracts import ComponentVersion, ParameterOwnership, PeftTensorLayout

__all__ = [
    "FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "ParameterEntry",
    "RankShard",
    "TensorEntry",
    "TensorKind",
    "TrainingStateInfo",
    "parse_manifest",
    "register_migration",
    "registered_migrations",
    "unregister_migration",
]

# The on-disk format this package writes; readers refuse others unless a migration exists.
FORMAT_VERSION = 1

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=False)
_SHA256_PATTERN = r"^[0-9a-f]{64}$"


class TensorKind(enum.StrEnum):
    """Why a tensor is in the checkpoint."""

    PARAMETER = "parameter"  # the authoritative copy of an adapter parameter
    PEFT_EXPORT = "peft_export"  # a PEFT-layout copy of a parameter, for PeftModel loading
    TRAINING_STATE = "training_state"  # optimizer state or RNG state


def _plain_file_name(value: str) -> str:
    # Names in the manifest are joined to the checkpoint directory: anything that could
    # point elsewhere (separators, "..", absolute paths) is refused by the schema itself.
    if not value or "/" in value or "\\" in value or value in {".", ".."} or "\x00" in value:
        raise ValueError(f"file must be a plain file name inside the checkpoint, got {value!r}")
    return value


class TensorEntry(BaseModel):
    """One tensor stored in one safetensors file of the checkpoint."""

    model_config = _STRICT

    name: str = Field(min_length=1)  # parameter fqn (or training-state key)
    kind: TensorKind
    file: str
    key: str = Field(min_length=1)  # key inside the safetensors file
    shape: tuple[int, ...]
    dtype: str = Field(min_length=1)  # torch dtype name, e.g. "float32"
    sha256: str = Field(pattern=_SHA256_PATTERN)  # of the raw C-order bytes
    rank: int | None = Field(default=None, ge=0)  # set for per-rank files
    layout: PeftTensorLayout | None = None  # set for PEFT_EXPORT entries

    _check_file = field_validator("file")(_plain_file_name)

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(s < 0 for s in v):
            raise ValueError(f"shape entries must be >= 0, got {list(v)}")
        return v


class FileEntry(BaseModel):
    """One file of the checkpoint with its size and sha256."""

    model_config = _STRICT

    file: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=_SHA256_PATTERN)
    rank: int | None = Field(default=None, ge=0)  # the rank that wrote it, for per-rank files

    _check_file = field_validator("file")(_plain_file_name)


class ParameterEntry(BaseModel):
    """One adapter parameter: its ownership and where its authoritative copy is."""

    model_config = _STRICT

    name: str = Field(min_length=1)
    ownership: ParameterOwnership
    shape: tuple[int, ...]
    dtype: str = Field(min_length=1)
    peft_key: str | None = None
    peft_layout: PeftTensorLayout | None = None


class RankShard(BaseModel):
    """The files one rank wrote."""

    model_config = _STRICT

    rank: int = Field(ge=0)
    files: tuple[str, ...]


class TrainingStateInfo(BaseModel):
    """Summary of the optional training state (the values live in per-rank files)."""

    model_config = _STRICT

    step: int = Field(ge=0)


class Manifest(BaseModel):
    """Everything needed to verify and interpret a checkpoint directory."""

    model_config = _STRICT

    format_version: int
    name: str = Field(min_length=1)  # the checkpoint directory's name
    created_at: datetime
    components: tuple[ComponentVersion, ...]
    lora_config: dict[str, Any] | None = None  # LoraConfig.model_dump(mode="json")
    base_model_name_or_path: str | None = None
    peft_compatible: bool  # adapter_config.json + adapter_model.safetensors were written
    world_size: int = Field(ge=1)
    parameters: tuple[ParameterEntry, ...]
    tensors: tuple[TensorEntry, ...]
    files: tuple[FileEntry, ...]
    shards: tuple[RankShard, ...]
    training_state: TrainingStateInfo | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version must be {FORMAT_VERSION}")
        files = [f.file for f in self.files]
        if len(set(files)) != len(files):
            raise ValueError("files lists a file twice")
        if "manifest.json" in files:
            raise ValueError("files must not list manifest.json itself")
        known = set(files)
        seen: set[tuple[str, str]] = set()
        for t in self.tensors:
            if t.file not in known:
                raise ValueError(f"tensor {t.name!r} is in file {t.file!r}, which files omits")
            if (t.file, t.key) in seen:
                raise ValueError(f"key {t.key!r} appears twice in file {t.file!r}")
            seen.add((t.file, t.key))
        names = [p.name for p in self.parameters]
        if len(set(names)) != len(names):
            raise ValueError("parameters lists a name twice")
        for s in self.shards:
            if s.rank >= self.world_size:
                raise ValueError(f"shard rank {s.rank} >= world_size {self.world_size}")
            missing = set(s.files) - known
            if missing:
                raise ValueError(f"shard of rank {s.rank} names unknown files {sorted(missing)}")
        return self

    def to_json(self) -> str:
        """Return the manifest as indented JSON text."""
        return self.model_dump_json(indent=2) + "\n"

    def file_entry(self, file: str) -> FileEntry:
        """Return the entry of ``file``.

        Raises:
            ManifestError: if the manifest does not list it.
        """
        for f in self.files:
            if f.file == file:
                return f
        raise ManifestError(
            f"manifest lists no file {file!r}; it has {[f.file for f in self.files]}"
        )


Migration = Callable[[dict[str, Any]], dict[str, Any]]
_MIGRATIONS: dict[int, tuple[int, Migration]] = {}


def register_migration(from_version: int, to_version: int, fn: Migration) -> Migration:
    """Register ``fn`` to turn a raw manifest dict of ``from_version`` into ``to_version``.

    Raises:
        ValueError: if a migration from ``from_version`` already exists or would not advance.
    """
    if from_version in _MIGRATIONS:
        raise ValueError(f"a migration from format_version {from_version} is already registered")
    if to_version == from_version:
        raise ValueError(f"a migration must change the version, got {from_version} -> {to_version}")
    _MIGRATIONS[from_version] = (to_version, fn)
    return fn


def unregister_migration(from_version: int) -> None:
    """Remove the migration from ``from_version`` (no-op if none)."""
    _MIGRATIONS.pop(from_version, None)


def registered_migrations() -> dict[int, int]:
    """Return ``{from_version: to_version}`` for every registered migration."""
    return {k: v for k, (v, _) in _MIGRATIONS.items()}


def _migrate(raw: dict[str, Any], file: str) -> dict[str, Any]:
    version = raw.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ManifestError(f"{file}: format_version must be an integer, got {version!r}")
    visited: set[int] = set()
    while version != FORMAT_VERSION:
        if version not in _MIGRATIONS:
            raise UnknownFormatVersionError(
                f"{file}: format_version {version} is not supported; this lora-checkpoint reads "
                f"version {FORMAT_VERSION} and has migrations from {sorted(_MIGRATIONS)}; "
                "upgrade lora-checkpoint or register a migration"
            )
        if version in visited:
            raise UnknownFormatVersionError(f"{file}: migration cycle at format_version {version}")
        visited.add(version)
        target, fn = _MIGRATIONS[version]
        try:
            raw = fn(dict(raw))
        except Exception as exc:  # a migration is user code: report, never crash the reader
            raise ManifestError(
                f"{file}: migration {version} -> {target} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(raw, dict) or raw.get("format_version") != target:
            raise ManifestError(
                f"{file}: migration {version} -> {target} must return a dict with "
                f"format_version {target}"
            )
        version = target
    return raw


def parse_manifest(data: bytes | str, file: str = "manifest.json") -> Manifest:
    """Parse manifest JSON strictly, migrating older formats when a migration is registered.

    Args:
        data: the JSON text.
        file: the path to name in errors.

    Returns:
        The validated manifest.

    Raises:
        UnknownFormatVersionError: for a format version without a migration path.
        ManifestError: for anything else that is not a valid manifest.
    """
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    raw = _migrate(raw, file)
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"{file} is not a valid manifest: {exc}") from exc
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. ContractError from a component
        raise ManifestError(f"{file} is not a valid manifest: {exc}") from exc
