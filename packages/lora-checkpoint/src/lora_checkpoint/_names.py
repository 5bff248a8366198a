"""Rules for checkpoint names and tensor/parameter names, checked before anything is written."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

from lora_checkpoint._fs import LATEST, LOCK_FILE
from lora_checkpoint.errors import CheckpointError

# Longest checkpoint name in UTF-8 bytes: leaves room under the usual 255-byte NAME_MAX for
# the temp directory's ".tmp-<name>-<32 hex>" and the trash directory's prefix and suffix.
MAX_NAME_BYTES = 200
# safetensors keeps its metadata under this key; a tensor of that name would be lost.
_RESERVED_KEYS = frozenset({"__metadata__"})


def _bad_char(text: str) -> str | None:
    for ch in text:
        # Cc: control characters (NUL, newline, DEL...); Cf: invisible format characters.
        if ch.isspace() or unicodedata.category(ch) in {"Cc", "Cf"}:
            return ch
    return None


def checkpoint_name_problem(name: object) -> str | None:
    """Return why ``name`` cannot be a checkpoint directory name, or None if it can."""
    if not isinstance(name, str) or not name:
        return "it must be a non-empty string"
    if "/" in name or "\\" in name or name.startswith(".") or name in {LATEST, LOCK_FILE}:
        return f"it must be a plain directory name, not starting with '.', and not {LATEST!r}"
    bad = _bad_char(name)
    if bad is not None:
        return f"it contains the whitespace or control character {bad!r}"
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        return f"it is {size} bytes long in UTF-8, more than {MAX_NAME_BYTES}"
    return None


def check_checkpoint_name(name: object) -> str:
    """Return ``name`` if it is a valid checkpoint name.

    Raises:
        CheckpointError: names the problem (whitespace, control characters, over 200 bytes,
            a path separator, a leading '.', or ``latest``).
    """
    problem = checkpoint_name_problem(name)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint name {name!r} is refused: {problem}; use letters, digits, '-', '_' "
            f"and '.' (at most {MAX_NAME_BYTES} bytes), e.g. 'step-00000010'"
        )
    return str(name)


def check_tensor_names(names: Iterable[object], what: str) -> None:
    """Refuse empty, non-string, reserved or control-character names before writing.

    Args:
        names: parameter names, PEFT keys or training-state keys.
        what: what they are, for the message (e.g. ``"parameter name"``).

    Raises:
        CheckpointError: naming the first bad name.
    """
    for name in names:
        if not isinstance(name, str) or not name:
            raise CheckpointError(
                f"{what} {name!r} is refused: it must be a non-empty string; give every "
                "parameter a module path name such as 'layers.0.q_proj.lora_A.weight'"
            )
        if name in _RESERVED_KEYS:
            raise CheckpointError(
                f"{what} {name!r} is refused: safetensors reserves it for metadata; rename it"
            )
        if "\x00" in name or any(unicodedata.category(c) == "Cc" for c in name):
            raise CheckpointError(
                f"{what} {name!r} is refused: it contains a control character; rename it"
            )
