"""The ``manifest.json`` schema, its strict parser and the format-migration registry."""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lora_checkpoint._digest import DigestAlgorithm
from lora_checkpoint._jsonio import loads_bounded
from lora_checkpoint.errors import ManifestError, UnknownFormatVersionError
from lora_core.contracts import ComponentVersion, ParameterOwnership, PeftTensorLayout

__all__ = [
    "FORMAT_VERSION",
    "DigestAlgorithm",
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
# 1: SHA-256 digests in ``sha256`` fields (read through the built-in migration to 2).
# 2: the manifest names its ``digest_algorithm`` (BLAKE3 when written) and the entries hold
#    ``digest`` fields.
FORMAT_VERSION = 2

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=False)
# 256-bit digests (BLAKE3 and SHA-256 alike) as lowercase hex.
_DIGEST_PATTERN = r"^[0-9a-f]{64}$"


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
    digest: str = Field(pattern=_DIGEST_PATTERN)  # of the raw C-order bytes
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
    """One file of the checkpoint with its size and digest."""

    model_config = _STRICT

    file: str
    size: int = Field(ge=0)
    digest: str = Field(pattern=_DIGEST_PATTERN)  # of the file's bytes, as b3sum/sha256sum
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
    # Which hash every ``digest`` of this manifest is; explicit, so a reader never guesses.
    digest_algorithm: DigestAlgorithm
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

    @field_validator("digest_algorithm", mode="before")
    @classmethod
    def _known_algorithm(cls, v: Any) -> Any:
        known = [a.value for a in DigestAlgorithm]
        if isinstance(v, DigestAlgorithm) or v in known:
            return v
        raise ValueError(
            f"digest_algorithm {v!r} is not one this lora-checkpoint can verify ({known}); "
            "upgrade lora-checkpoint to read this checkpoint"
        )

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


def _rename_digests(entries: Any) -> Any:
    # Renames only what is well formed; anything else is left for validation to report by
    # its field name, exactly as for a manifest of the current format.
    if not isinstance(entries, list):
        return entries
    return [
        {("digest" if k == "sha256" else k): v for k, v in e.items()}
        if isinstance(e, dict) and "digest" not in e
        else e
        for e in entries
    ]


def _v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    # Format 1 hashed everything with SHA-256 and said so only in its field names.
    if "digest_algorithm" in raw:
        raise ValueError("a format_version 1 manifest has no digest_algorithm field")
    return {
        **raw,
        "format_version": 2,
        "digest_algorithm": DigestAlgorithm.SHA256.value,
        "tensors": _rename_digests(raw.get("tensors")),
        "files": _rename_digests(raw.get("files")),
    }


# Migrations of formats this package once wrote; always applied, never replaced or removed.
_BUILTIN_MIGRATIONS: dict[int, tuple[int, Migration]] = {1: (2, _v1_to_v2)}
# Migrations users registered (for formats written by forks or tools of their own).
_MIGRATIONS: dict[int, tuple[int, Migration]] = {}


def register_migration(from_version: int, to_version: int, fn: Migration) -> Migration:
    """Register ``fn`` to turn a raw manifest dict of ``from_version`` into ``to_version``.

    Raises:
        ValueError: if a migration from ``from_version`` already exists (built-in ones, see
            :func:`registered_migrations`, included), would not advance, or would start at
            the current ``FORMAT_VERSION``.
    """
    if from_version in _BUILTIN_MIGRATIONS:
        raise ValueError(
            f"format_version {from_version} is migrated by lora-checkpoint itself (to "
            f"{_BUILTIN_MIGRATIONS[from_version][0]}); that migration cannot be replaced"
        )
    if from_version in _MIGRATIONS:
        raise ValueError(f"a migration from format_version {from_version} is already registered")
    if to_version == from_version:
        raise ValueError(f"a migration must change the version, got {from_version} -> {to_version}")
    if from_version == FORMAT_VERSION:
        raise ValueError(
            f"format_version {FORMAT_VERSION} is the current format and is read as it is; "
            "nothing migrates from it"
        )
    _MIGRATIONS[from_version] = (to_version, fn)
    return fn


def unregister_migration(from_version: int) -> None:
    """Remove the registered migration from ``from_version`` (no-op if none).

    Raises:
        ValueError: for a built-in migration, which stays so old checkpoints stay readable.
    """
    if from_version in _BUILTIN_MIGRATIONS:
        raise ValueError(
            f"the migration from format_version {from_version} is built into lora-checkpoint "
            "and cannot be removed"
        )
    _MIGRATIONS.pop(from_version, None)


def registered_migrations() -> dict[int, int]:
    """Return ``{from_version: to_version}`` of every migration, built-in ones (1 -> 2) too."""
    return {k: v for k, (v, _) in (_BUILTIN_MIGRATIONS | _MIGRATIONS).items()}


def _migrate(raw: dict[str, Any], file: str) -> dict[str, Any]:
    version = raw.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ManifestError(f"{file}: format_version must be an integer, got {version!r}")
    migrations = _BUILTIN_MIGRATIONS | _MIGRATIONS
    visited: set[int] = set()
    while version != FORMAT_VERSION:
        if version not in migrations:
            raise UnknownFormatVersionError(
                f"{file}: format_version {version} is not supported; this lora-checkpoint reads "
                f"version {FORMAT_VERSION} and has migrations from {sorted(migrations)}; "
                "upgrade lora-checkpoint or register a migration"
            )
        if version in visited:
            raise UnknownFormatVersionError(f"{file}: migration cycle at format_version {version}")
        visited.add(version)
        target, fn = migrations[version]
        try:
            raw = fn(dict(raw))
        except Exception as exc:  # user code, or a malformed old manifest: report, never crash
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
    """Parse manifest JSON strictly, migrating older formats (format 1 is built in).

    Args:
        data: the JSON text.
        file: the path to name in errors.

    Returns:
        The validated manifest.

    Raises:
        UnknownFormatVersionError: for a format version without a migration path.
        ManifestError: for anything else that is not a valid manifest.
    """
    raw = loads_bounded(data, file, "manifest", ManifestError)
    if not isinstance(raw, dict):
        raise ManifestError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    read_as = raw.get("format_version")
    raw = _migrate(raw, file)
    # Field names in errors are the current format's: say so when the file is older.
    was = "" if read_as == FORMAT_VERSION else f" (format_version {read_as}, migrated)"
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"{file} is not a valid manifest{was}: {exc}") from exc
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. ContractError from a component
        raise ManifestError(f"{file} is not a valid manifest{was}: {exc}") from exc
