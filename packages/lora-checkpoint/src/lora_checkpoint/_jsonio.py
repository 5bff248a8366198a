"""JSON parsing with a depth bound, so no file can drive a reader into ``RecursionError``."""

from __future__ import annotations

import json
from typing import Any

from lora_checkpoint.errors import CheckpointError

# Deepest nesting accepted in any JSON file of a checkpoint; what we write nests at most
# about 10 levels (plus the user's data position). Deeper input is refused before pydantic,
# json.dumps or our own walkers recurse into it.
MAX_JSON_DEPTH = 100


def json_depth(value: Any) -> int:
    """Return the nesting depth of parsed JSON (iteratively: never recurses)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def loads_bounded(
    data: bytes | str,
    file: str,
    what: str,
    error: type[CheckpointError] = CheckpointError,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Parse JSON, refusing invalid text and nesting deeper than ``max_depth``.

    Args:
        data: the JSON text.
        file: the path to name in errors.
        what: what the file holds, for the message (e.g. ``"safetensors header"``).
        error: the ``CheckpointError`` subclass to raise.
        max_depth: the deepest nesting accepted.

    Raises:
        CheckpointError: (``error``) the text is not JSON or nests too deeply.
    """
    try:
        raw = json.loads(data)
    except RecursionError as exc:
        raise error(
            f"{file}: {what} nests JSON too deeply to parse (more than {max_depth} levels); "
            "it is corrupted or was not written by lora-checkpoint"
        ) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{file}: {what} is not valid JSON: {exc}") from exc
    if json_depth(raw) > max_depth:
        raise error(
            f"{file}: {what} nests JSON more than {max_depth} levels deep; it is corrupted "
            "or was not written by lora-checkpoint"
        )
    return raw
