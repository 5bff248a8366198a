"""Reading user documents without recursing on them: bounded YAML and JSON nesting (no torch).

PyYAML's composer and :func:`json.loads` recurse once per level of nesting, so a document a
few thousand brackets deep raises :class:`RecursionError` (or worse) before anything can name
the problem. Here the nesting is measured first by loops that do not recurse: YAML through
its event stream (the scanner and parser keep explicit stacks), JSON with one pass of a
regular expression over the raw text. The YAML pass also refuses what ``yaml.safe_load``
accepts silently: a key given twice in one mapping (the last one won) and aliases that expand
to more values than any run config holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_experts.finetune.errors import FinetuneError

__all__ = [
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "json_too_deep",
    "load_config_yaml",
]

MAX_CONFIG_DEPTH = 16  # a run config is sections of settings, a few of them lists
MAX_CONFIG_VALUES = 100_000  # values after expanding every alias (a "billion laughs" bound)

# A whole JSON string (escapes included) or one bracket: strings are skipped at C speed, so a
# bracket inside a string is never counted. An unterminated string runs to the end of the text.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]+|\\.)*"?|[\[\]{}]', re.DOTALL)


def json_too_deep(text: str, limit: int) -> int | None:
    """The offset in ``text`` where JSON nesting first exceeds ``limit``, or None if it never does.

    Counts ``[`` and ``{`` outside strings with a loop, never recursion, so it is safe on
    text that :func:`json.loads` could not parse without a :class:`RecursionError`.
    """
    if text.count("[") + text.count("{") <= limit:
        return None  # cannot be deeper than the brackets it holds
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return match.start()
        elif token in "]}":
            depth = max(0, depth - 1)
    return None


def _line(event: Any) -> int:
    """The 1-based line an event starts on (0 when PyYAML gives no mark)."""
    mark = getattr(event, "start_mark", None)
    return 0 if mark is None else int(mark.line) + 1


@dataclass
class _Node:
    """A collection being read: its values so far and, for a mapping, the keys it has seen."""

    mapping: bool
    anchor: str | None
    values: int = 0
    keys: dict[str, int] = field(default_factory=dict)  # key -> line it was first given on
    expect_key: bool = True


def _check_events(text: str, where: str) -> None:
    """Walk the YAML event stream once: depth, expanded values and duplicate keys.

    Raises:
        FinetuneError: naming ``where`` and the line.
        yaml.YAMLError: the text is not YAML (the caller names it).
    """
    import yaml

    stack: list[_Node] = []
    sizes: dict[str, int] = {}  # anchor -> values its node expands to
    total = 0

    def add(count: int, event: Any) -> None:
        """Count ``count`` more values read (an alias: every value its anchor expands to)."""
        nonlocal total
        total += count
        if total > MAX_CONFIG_VALUES:
            raise FinetuneError(
                f"{where}: line {_line(event)}: the aliases expand to more than "
                f"{MAX_CONFIG_VALUES:,} values; a run config needs no aliases that big"
            )

    def key_or_value(event: Any) -> None:
        """Record ``event`` as its mapping's next key (refusing a repeat) or value."""
        if not stack or not stack[-1].mapping:
            return
        node = stack[-1]
        if node.expect_key and isinstance(event, yaml.ScalarEvent):
            line = _line(event)
            first = node.keys.setdefault(event.value, line)
            if first != line:
                raise FinetuneError(
                    f"{where}: line {line}: duplicate key {event.value!r} (first at line "
                    f"{first}); YAML keeps only the last one, so remove one of them"
                )
        node.expect_key = not node.expect_key

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            key_or_value(event)
            if len(stack) >= MAX_CONFIG_DEPTH:
                raise FinetuneError(
                    f"{where}: line {_line(event)}: nested more than "
                    f"{MAX_CONFIG_DEPTH} deep; a run config holds sections of settings, "
                    "some of them lists of names"
                )
            stack.append(_Node(isinstance(event, yaml.MappingStartEvent), event.anchor))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            node = stack.pop()
            size = node.values + 1  # its values and itself
            if node.anchor is not None:
                sizes[node.anchor] = size
            add(1, event)  # its values were counted as they came
            if stack:
                stack[-1].values += size
        elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
            key_or_value(event)
            size = 1 if isinstance(event, yaml.ScalarEvent) else sizes.get(event.anchor or "", 1)
            if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
                sizes[event.anchor] = 1
            add(size, event)
            if stack:
                stack[-1].values += size


def load_config_yaml(path: Path, flag: str = "--config") -> Any:
    """Parse a YAML file as ``yaml.safe_load`` would, after refusing what it would mishandle.

    Raises:
        FinetuneError: naming ``FLAG PATH`` (and the line): missing, not UTF-8, not YAML,
            nested deeper than :data:`MAX_CONFIG_DEPTH`, over :data:`MAX_CONFIG_VALUES`
            values through aliases, or a key given twice in one mapping.
    """
    import yaml

    where = f"{flag} {path}"
    if not path.is_file():
        raise FinetuneError(f"{where}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FinetuneError(f"{where}: not valid UTF-8 ({exc.reason})") from exc
    except OSError as exc:
        raise FinetuneError(f"{where}: cannot read it ({exc.strerror})") from exc
    try:
        _check_events(text, where)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FinetuneError(f"{where}: invalid YAML: {exc}") from exc
