"""Checks ``save`` runs on its inputs before anything is written, and error translation."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lora_checkpoint import _fs
from lora_checkpoint._finite import find_non_finite, non_finite_error
from lora_checkpoint._names import check_tensor_names
from lora_checkpoint._safetensors_io import as_cpu_contiguous
from lora_checkpoint.errors import CheckpointError
from lora_checkpoint.training_state import TrainingState
from lora_core.contracts import AdaptationResult


def as_checkpoint_error(exc: BaseException, where: Path | str) -> CheckpointError:
    """Return ``exc`` as a ``CheckpointError`` naming ``where`` (raise it ``from`` exc)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return _fs.io_error(exc, exc.filename or where, "write the checkpoint")
    return CheckpointError(f"{where}: could not write the checkpoint: {type(exc).__name__}: {exc}")


def training_state_files_of(
    training_state: TrainingState | None,
) -> tuple[tuple[dict[str, torch.Tensor], dict[str, Any]] | None, dict[str, str]]:
    """Return this rank's training-state tensors and JSON document, and readable names of
    the tensors (``optimizer state 'p'['exp_avg']``) for error messages."""
    if training_state is None:
        return None, {}
    tensors, doc = training_state.to_files()
    tensors = {k: as_cpu_contiguous(v) for k, v in tensors.items()}
    labels: dict[str, str] = {}
    if doc["optimizer"] is not None:
        for n, entry in doc["optimizer"]["state"].items():
            for k, v in entry.items():
                if "tensor" in v:
                    labels[v["tensor"]] = f"optimizer state {n!r}[{k!r}]"
    return (tensors, doc), labels


def precheck_inputs(
    result: AdaptationResult,
    shared: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None,
    labels: Mapping[str, str],
    allow_non_finite: bool,
) -> None:
    """Refuse bad names and (unless allowed) NaN/Inf tensors before a temp dir exists.

    Raises:
        CheckpointError: an empty, reserved or control-character name.
        NonFiniteTensorError: a parameter or optimizer-state tensor holds NaN/Inf.
    """
    check_tensor_names((n for n, _ in result.named_optimizer_parameters), "parameter name")
    check_tensor_names((e.key for e in result.peft_exports.values()), "PEFT export key")
    if state is not None:
        check_tensor_names(state[0], "training-state key")
    if allow_non_finite:
        return
    found = find_non_finite([*shared.items(), *local.items()])
    if state is not None:
        found += find_non_finite((labels.get(k, k), t) for k, t in state[0].items())
    if found:
        raise non_finite_error(
            found,
            "save refused",
            "training has diverged; resume from an earlier checkpoint with a lower learning "
            "rate, or pass allow_non_finite=True to save anyway",
        )
