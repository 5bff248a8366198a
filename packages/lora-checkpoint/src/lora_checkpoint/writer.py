"""Atomic, verified checkpoint writing.

Layout: ``directory`` is a checkpoint ROOT. Each :func:`save` creates ``<root>/<name>``
(``name`` defaults to ``step-XXXXXXXX``), writing first into ``<root>/.tmp-<name>-<uuid>``,
fsyncing every file and the directory, publishing with one ``rename``, and then pointing
``<root>/latest`` (a small text file holding the name, replaced atomically) at it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from lora_checkpoint import _dist, _fs
from lora_checkpoint._checks import as_checkpoint_error, precheck_inputs, training_state_files_of
from lora_checkpoint._digest import WRITE_ALGORITHM, digest_of
from lora_checkpoint._names import check_checkpoint_name
from lora_checkpoint._safetensors_io import (
    FileRecord,
    as_cpu_contiguous,
    dtype_name,
    write_safetensors,
)
from lora_checkpoint._version import __version__
from lora_checkpoint.errors import CheckpointError, CheckpointExistsError, ManifestError
from lora_checkpoint.manifest import (
    FORMAT_VERSION,
    FileEntry,
    Manifest,
    ParameterEntry,
    RankShard,
    TensorEntry,
    TensorKind,
    TrainingStateInfo,
    parse_manifest,
)
from lora_checkpoint.training_state import TrainingState
from lora_core.contracts import (
    AdaptationResult,
    ComponentVersion,
    ParameterOwnership,
    PeftTensorLayout,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_MODEL",
    "FUSED_EXPERT_LORA",
    "MANIFEST",
    "list_checkpoints",
    "rank_local_file",
    "save",
    "to_peft_layout",
    "training_state_files",
]

MANIFEST = "manifest.json"
# Files written (and hashed) at the same time by one rank.
FILE_WORKERS = max(1, min(4, os.cpu_count() or 1))
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MODEL = "adapter_model.safetensors"
FUSED_EXPERT_LORA = "fused_expert_lora.safetensors"


def rank_local_file(rank: int) -> str:
    """Return the file name holding ``rank``'s rank-local tensors."""
    return f"rank_local-rank{rank:05d}.safetensors"


def training_state_files(rank: int) -> tuple[str, str]:
    """Return ``(tensor file, json file)`` names of ``rank``'s training state."""
    return (f"training_state-rank{rank:05d}.safetensors", f"training_state-rank{rank:05d}.json")


def to_peft_layout(tensor: torch.Tensor, layout: PeftTensorLayout, name: str) -> torch.Tensor:
    """Convert one of our tensors into the layout PEFT stores.

    Args:
        tensor: IDENTITY: any shape; EXPERT_STACKED_A: ``[E, r, in]``; EXPERT_STACKED_B:
            ``[E, out, r]``.
        layout: the PEFT export layout.
        name: the parameter name, for errors.

    Returns:
        IDENTITY: the tensor; A: ``[E*r, in]`` (row ``e*r+j`` = ``A[e, j]``); B: ``[out, r*E]``
        (column ``j*E+e`` = ``B[e, :, j]``: PEFT stacks B rank-major).

    Raises:
        ShapeMismatchError: if a stacked layout gets a tensor that is not 3-D.
    """
    from lora_checkpoint.errors import ShapeMismatchError

    if layout is PeftTensorLayout.IDENTITY:
        return tensor
    if tensor.dim() != 3:
        raise ShapeMismatchError(
            f"parameter {name!r} has PEFT layout {layout.value} which needs a 3-D tensor "
            f"([E, r, in] or [E, out, r]), got shape {list(tensor.shape)}"
        )
    e, a, b = tensor.shape
    if layout is PeftTensorLayout.EXPERT_STACKED_A:
        return tensor.reshape(e * a, b)
    return tensor.permute(1, 2, 0).reshape(a, b * e)


def _adapter_config(
    result: AdaptationResult, base_model_name_or_path: str | None, task_type: str | None
) -> dict[str, Any]:
    cfg = result.lora_config
    if cfg is None or cfg.rank is None:
        raise CheckpointError("adapter_config.json needs result.lora_config (rank and alpha)")
    rank = int(cfg.rank)
    alpha: float | int = rank if cfg.alpha is None else float(cfg.alpha)
    if float(alpha).is_integer():
        alpha = int(alpha)  # PEFT writes an int; keep the file identical where we can
    # The fields and defaults PEFT 0.21 writes for a plain LoRA adapter; PEFT ignores
    # (with a warning) keys it does not know, so older readers load this too.
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": float(cfg.dropout),
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(result.peft_target_modules) or None,
        "target_parameters": list(result.peft_target_parameters) or None,
        "task_type": task_type,
        "use_dora": False,
        "use_rslora": False,
    }


def _checkpoint_name(name: str | None, step: int | None) -> str:
    if name is None:
        if step is None:
            raise CheckpointError(
                "save needs a checkpoint name: pass step=, name=, or a training_state"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        name = f"step-{step:08d}"
    return check_checkpoint_name(name)


def _entries(
    record: FileRecord,
    file: str,
    kinds: Mapping[str, tuple[str, TensorKind, PeftTensorLayout | None]],
    rank: int | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    fentry = FileEntry(file=file, size=record.size, digest=record.digest, rank=rank)
    tentries = []
    for t in record.tensors:
        name, kind, layout = kinds[t.key]
        tentries.append(
            TensorEntry(
                name=name,
                kind=kind,
                file=file,
                key=t.key,
                shape=t.shape,
                dtype=t.dtype,
                digest=t.digest,
                rank=rank,
                layout=layout,
            ).model_dump(mode="json")
        )
    return fentry.model_dump(mode="json"), tentries


def _write_rank_files(
    tmp: Path,
    result: AdaptationResult,
    rank: int,
    training_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None,
    shared: dict[str, torch.Tensor],
    local: dict[str, torch.Tensor],
    base_model_name_or_path: str | None,
    task_type: str | None,
) -> dict[str, Any]:
    files: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    # (file, tensors, kinds, rank) of every safetensors file; written concurrently below so
    # one file's write syscalls overlap another's hashing.
    jobs: list[tuple[str, dict[str, torch.Tensor], Any, int | None]] = []

    def add(
        tensors_: dict[str, torch.Tensor], file: str, kinds: Any, file_rank: int | None
    ) -> None:
        jobs.append((file, tensors_, kinds, file_rank))

    if rank == 0:
        peft: dict[str, torch.Tensor] = {}
        peft_kinds: dict[str, tuple[str, TensorKind, PeftTensorLayout | None]] = {}
        own: dict[str, torch.Tensor] = {}
        own_kinds: dict[str, tuple[str, TensorKind, PeftTensorLayout | None]] = {}
        for n, t in shared.items():
            export = result.peft_exports.get(n)
            if export is not None:
                if export.key in peft:
                    raise CheckpointError(
                        f"parameters {peft_kinds[export.key][0]!r} and {n!r} export to the same "
                        f"PEFT key {export.key!r}; fix result.peft_exports"
                    )
                peft[export.key] = to_peft_layout(t, export.layout, n)
                if export.layout is PeftTensorLayout.IDENTITY:
                    peft_kinds[export.key] = (n, TensorKind.PARAMETER, None)
                    continue
                peft_kinds[export.key] = (n, TensorKind.PEFT_EXPORT, export.layout)
            own[n] = t
            own_kinds[n] = (n, TensorKind.PARAMETER, None)
        if peft:
            add(peft, ADAPTER_MODEL, peft_kinds, None)
            if result.lora_config is not None:
                text = (
                    json.dumps(
                        _adapter_config(result, base_model_name_or_path, task_type),
                        indent=2,
                        sort_keys=True,
                    )
                    + "\n"
                )
                data = text.encode()
                _fs.write_bytes_durable(tmp / ADAPTER_CONFIG, data)
                digest = digest_of(WRITE_ALGORITHM, data)
                files.append(
                    FileEntry(file=ADAPTER_CONFIG, size=len(data), digest=digest).model_dump(
                        mode="json"
                    )
                )
        if own:
            add(own, FUSED_EXPERT_LORA, own_kinds, None)
    if local:
        file = rank_local_file(rank)
        add(local, file, {n: (n, TensorKind.PARAMETER, None) for n in local}, rank)
    if training_state is not None:
        st_file, js_file = training_state_files(rank)
        ts_tensors, doc = training_state
        add(
            ts_tensors, st_file, {k: (k, TensorKind.TRAINING_STATE, None) for k in ts_tensors}, rank
        )
        data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        _fs.write_bytes_durable(tmp / js_file, data)
        files.append(
            FileEntry(
                file=js_file, size=len(data), digest=digest_of(WRITE_ALGORITHM, data), rank=rank
            ).model_dump(mode="json")
        )
    with ThreadPoolExecutor(max(1, min(len(jobs), FILE_WORKERS))) as pool:
        futures = [
            pool.submit(write_safetensors, tmp / file, ts, {"format": "pt"})
            for file, ts, _, _ in jobs
        ]
        records = [f.result() for f in futures]  # the first failure (in file order) raises
    for (file, _, kinds, file_rank), rec in zip(jobs, records, strict=True):
        f, ts = _entries(rec, file, kinds, file_rank)
        files.append(f)
        tensors.extend(ts)
    return {"files": files, "tensors": tensors}


def _collect(
    result: AdaptationResult, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    shared: dict[str, torch.Tensor] = {}
    local: dict[str, torch.Tensor] = {}
    rank_local = set(result.rank_local_names)
    for n, p in result.named_optimizer_parameters:
        if n in rank_local or result.ownership[n] is ParameterOwnership.RANK_LOCAL:
            t = p.to_local() if _dist.is_dtensor(p) else p
            local[n] = as_cpu_contiguous(t)
            continue
        # Every rank joins full_tensor() (a collective for sharded DTensors), in one order.
        t = p.full_tensor() if _dist.is_dtensor(p) else p
        if rank == 0:
            shared[n] = as_cpu_contiguous(t)
    return shared, local


def _components(result: AdaptationResult) -> tuple[ComponentVersion, ...]:
    mine = ComponentVersion("lora-checkpoint", __version__)
    comps = list(dict.fromkeys((*result.components, result.producer)))
    comps = [c for c in comps if c.name != mine.name]
    return (*comps, mine)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Manifest]:
    """Return the manifests of the published checkpoints under a root, oldest first.

    Unreadable directories (not checkpoints) are skipped.
    """
    root = Path(directory)
    found: list[Manifest] = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        # A symlinked entry is not a checkpoint of this root (and never pruned through).
        if child.name.startswith(".") or child.is_symlink() or not (child / MANIFEST).is_file():
            continue
        try:
            data = _fs.read_bounded(child / MANIFEST, 256 * 1024 * 1024)
            found.append(parse_manifest(data, str(child / MANIFEST)))
        except (ManifestError, OSError, CheckpointError):
            continue
    return sorted(found, key=lambda m: (m.created_at, m.name))


def save(
    directory: str | os.PathLike[str],
    result: AdaptationResult,
    *,
    training_state: TrainingState | None = None,
    step: int | None = None,
    name: str | None = None,
    keep_last: int | None = None,
    base_model_name_or_path: str | None = None,
    task_type: str | None = None,
    allow_non_finite: bool = False,
    lock_timeout: float = _fs.DEFAULT_LOCK_TIMEOUT,
) -> Manifest:
    """Write a checkpoint of ``result``'s parameters under the root ``directory``.

    Args:
        directory: the checkpoint root; the checkpoint goes to ``<directory>/<name>``.
        result: the adapter parameters (names, ownership, PEFT exports, LoRA config).
        training_state: optional optimizer/RNG/step/data-position state (this rank's).
        step: names the checkpoint ``step-XXXXXXXX`` (default: ``training_state.step``).
        name: an explicit checkpoint directory name instead: at most 200 bytes, no
            whitespace or control characters, no ``/``, not starting with ``.``.
        keep_last: after publishing, delete all but the newest ``keep_last`` checkpoints.
        base_model_name_or_path: recorded in ``adapter_config.json`` and the manifest.
        task_type: PEFT ``task_type`` for ``adapter_config.json`` (None unless given).
        allow_non_finite: save parameters and optimizer state holding NaN/Inf anyway.
        lock_timeout: seconds to wait for another writer (or reader) of the same root to
            release ``<directory>/.lock``; 0 fails at once if it is taken.

    Returns:
        The manifest that was published (on every rank).

    Raises:
        CheckpointExistsError: ``<directory>/<name>`` already exists.
        NonFiniteTensorError: a tensor holds NaN/Inf (names them), unless allowed.
        CheckpointLockedError: another process held the root's lock for ``lock_timeout``.
        CheckpointIOError: the file system refused a write (disk full, read-only...).
        CheckpointError: invalid arguments, or any rank failed to write (nothing is
            published, and no temp directory is left behind).
    """
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise CheckpointError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    if (
        isinstance(lock_timeout, bool)
        or not isinstance(lock_timeout, (int, float))
        or not (0 <= lock_timeout < float("inf"))
    ):
        raise CheckpointError(f"lock_timeout must be a finite number >= 0, got {lock_timeout!r}")
    if step is None and training_state is not None:
        step = training_state.step
    ckpt_name = _checkpoint_name(name, step)
    root = Path(directory)
    rank, world = _dist.rank_and_world()

    # Every rank joins the collectives of _collect in one order, before anything is written.
    shared, local = _collect(result, rank)
    precheck: dict[str, Any] = {}
    try:
        state, labels = training_state_files_of(training_state)
        precheck_inputs(result, shared, local, state, labels, allow_non_finite)
    except Exception as exc:
        err = as_checkpoint_error(exc, root / ckpt_name)
        if not _dist.dist_active():
            raise err from exc
        precheck = {"error": f"rank {rank}: {type(err).__name__}: {err}"}
    if _dist.dist_active():
        refused = [o["error"] for o in _dist.gather(precheck) if "error" in o]
        if refused:
            raise CheckpointError("checkpoint not written; " + "; ".join(refused))

    claim = -1  # rank 0's flock on its temp directory: other writers' cleanup keeps it
    tmp: Path | None = None
    try:
        setup: dict[str, Any] = {}
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                with _fs.root_lock(root, exclusive=True, timeout=lock_timeout):
                    if os.path.lexists(root / ckpt_name):
                        raise CheckpointExistsError(
                            f"checkpoint {str(root / ckpt_name)!r} already exists; pass another "
                            "name/step or delete it"
                        )
                    _fs.remove_stale(root)
                    tmp = root / f"{_fs.TMP_PREFIX}{ckpt_name}-{uuid.uuid4().hex}"
                    tmp.mkdir()
                    claim = _fs.claim_dir(tmp)
                _fs.crash_point("temp-created", ckpt_name)
                setup = {"tmp": str(tmp)}
            except Exception as exc:
                err = as_checkpoint_error(exc, root)
                if not _dist.dist_active():
                    raise err from exc
                setup = {"error": f"{type(err).__name__}: {err}"}
        setup = _dist.broadcast(setup)
        if "error" in setup:
            raise CheckpointError(f"rank 0 could not prepare the checkpoint: {setup['error']}")
        tmp = Path(setup["tmp"])

        outcome: dict[str, Any]
        try:
            outcome = _write_rank_files(
                tmp, result, rank, state, shared, local, base_model_name_or_path, task_type
            )
            outcome["has_training_state"] = training_state is not None
            _fs.crash_point("files-written", ckpt_name)
        except Exception as exc:
            err = as_checkpoint_error(exc, tmp)
            if not _dist.dist_active():
                raise err from exc
            outcome = {"error": f"rank {rank}: {type(err).__name__}: {err}"}
        outcomes = _dist.gather(outcome)  # also the barrier: every rank has fsynced its files

        published: dict[str, Any] = {}
        if rank == 0:
            try:
                manifest = _publish(
                    root,
                    tmp,
                    ckpt_name,
                    outcomes,
                    result,
                    world,
                    training_state,
                    base_model_name_or_path,
                    keep_last,
                    lock_timeout,
                )
                tmp = None  # published: nothing to clean up
                published = {"manifest": manifest.to_json()}
            except Exception as exc:
                err = as_checkpoint_error(exc, root / ckpt_name)
                if not _dist.dist_active():
                    raise err from exc
                published = {"error": f"{type(err).__name__}: {err}"}
        published = _dist.broadcast(published)
        if "error" in published:
            raise CheckpointError(published["error"])
        return parse_manifest(published["manifest"])
    finally:
        if rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # our own temp directory only
        if claim >= 0:
            with suppress(OSError):
                os.close(claim)


def _publish(
    root: Path,
    tmp: Path,
    ckpt_name: str,
    outcomes: list[dict[str, Any]],
    result: AdaptationResult,
    world: int,
    training_state: TrainingState | None,
    base_model_name_or_path: str | None,
    keep_last: int | None,
    lock_timeout: float,
) -> Manifest:
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise CheckpointError("checkpoint not published; " + "; ".join(errors))
    if len({o["has_training_state"] for o in outcomes}) > 1:
        raise CheckpointError("training_state must be given on every rank or on none")
    manifest = _build_manifest(
        result, ckpt_name, world, outcomes, training_state, base_model_name_or_path
    )
    _fs.write_bytes_durable(tmp / MANIFEST, manifest.to_json().encode())
    _fs.fsync_dir(tmp)
    _fs.crash_point("manifest-written", ckpt_name)
    # Publish and prune under the root's lock: no other writer renames, prunes or cleans up
    # meanwhile, and readers holding it shared never see a checkpoint vanish mid-read.
    with _fs.root_lock(root, exclusive=True, timeout=lock_timeout):
        if os.path.lexists(root / ckpt_name):
            raise CheckpointExistsError(
                f"checkpoint {str(root / ckpt_name)!r} was created by another writer while this "
                "one was writing; pass another name/step"
            )
        os.rename(tmp, root / ckpt_name)
        _fs.crash_point("renamed", ckpt_name)
        _fs.fsync_dir(root)
        # A crash from here until `latest` is replaced leaves it naming the previous
        # checkpoint: readers that must not lose a step (resume) take the newest that verifies.
        _fs.crash_point("published", ckpt_name)
        _fs.replace_atomic(root / _fs.LATEST, (ckpt_name + "\n").encode(), crash_name=ckpt_name)
        _fs.crash_point("latest-written", ckpt_name)
        if keep_last is not None:
            _prune(root, keep_last, ckpt_name)
        _fs.crash_point("pruned", ckpt_name)
    return manifest


def _build_manifest(
    result: AdaptationResult,
    name: str,
    world: int,
    outcomes: list[dict[str, Any]],
    training_state: TrainingState | None,
    base_model_name_or_path: str | None,
) -> Manifest:
    files = [f for o in outcomes for f in o["files"]]
    tensors = [t for o in outcomes for t in o["tensors"]]
    shards = []
    for r, o in enumerate(outcomes):
        mine = [f["file"] for f in o["files"] if f.get("rank") == r]
        if mine:
            shards.append(RankShard(rank=r, files=tuple(mine)))
    params = []
    for n, p in result.named_optimizer_parameters:
        export = result.peft_exports.get(n)
        shape = tuple(p.shape)  # a DTensor reports its global shape
        params.append(
            ParameterEntry(
                name=n,
                ownership=result.ownership[n],
                shape=shape,
                dtype=dtype_name(p.dtype),
                peft_key=None if export is None else export.key,
                peft_layout=None if export is None else export.layout,
            )
        )
    has_config = result.lora_config is not None
    return Manifest(
        format_version=FORMAT_VERSION,
        digest_algorithm=WRITE_ALGORITHM,
        name=name,
        created_at=datetime.now(UTC),
        components=_components(result),
        lora_config=(
            None if result.lora_config is None else result.lora_config.model_dump(mode="json")
        ),
        base_model_name_or_path=base_model_name_or_path,
        peft_compatible=has_config and any(f["file"] == ADAPTER_MODEL for f in files),
        world_size=world,
        parameters=tuple(params),
        tensors=tuple(TensorEntry.model_validate(t) for t in tensors),
        files=tuple(FileEntry.model_validate(f) for f in files),
        shards=tuple(shards),
        training_state=None
        if training_state is None
        else TrainingStateInfo(step=training_state.step),
    )


def _prune(root: Path, keep_last: int, newest: str) -> None:
    manifests = [m for m in list_checkpoints(root) if m.name != newest]
    doomed = manifests[: max(0, len(manifests) - (keep_last - 1))]
    for m in doomed:
        _fs.remove_tree(root / m.name, crash_name=newest)
