"""The data formats ``--data`` understands: one class per format, registered in one table.

A format turns one decoded record (a JSON object, or one line of a ``.txt`` file) into a
:class:`Sample`: plain text, or a conversation in OpenAI ``role``/``content`` messages that the
model's own chat template renders. Adding a format is one class and one entry in
:data:`DATA_FORMATS`; detection, errors and tokenisation are shared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = [
    "DATA_FORMATS",
    "AlpacaFormat",
    "DataFormat",
    "MessagesFormat",
    "RecordError",
    "Sample",
    "ShareGPTFormat",
    "TextFormat",
    "detect_format",
]

ROLES = ("system", "user", "assistant", "tool")


class RecordError(ValueError):
    """One bad record: ``field`` is the JSON path of the offending value (``messages[2].role``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Sample:
    """One training document: ``text`` (all tokens trained) or ``messages`` (a conversation)."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    line: int = field(default=0, compare=False)  # where the record starts in its file


@runtime_checkable
class DataFormat(Protocol):
    """A data format: how to recognise a record and turn it into a :class:`Sample`."""

    name: ClassVar[str]
    # The keys a record of this format has, shown when a file matches no format.
    signature: ClassVar[str]

    def matches(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` looks like this format (used on a file's first record)."""
        ...

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """Return the sample; raises :class:`RecordError` naming the bad field."""
        ...


def _string(record: Mapping[str, Any], key: str, field: str, *, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RecordError(field, f"expected a string, got {type(value).__name__}")
    return value


def _conversation(messages: list[dict[str, str]], field: str) -> Sample:
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise RecordError(field, "the conversation has no non-empty assistant turn to train on")
    return Sample(messages=tuple(messages))


class TextFormat:
    """``{"text": "..."}`` (and every line of a ``.txt`` file): a document trained on in full."""

    name: ClassVar[str] = "text"
    signature: ClassVar[str] = '"text"'

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A record with a ``text`` key."""
        return "text" in record

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """The text itself; it must be a non-empty string."""
        text = _string(record, "text", "text")
        if not text.strip():
            raise RecordError("text", "is empty")
        return Sample(text=text)


class MessagesFormat:
    """OpenAI chat: ``{"messages": [{"role": "user", "content": "..."}, ...]}``."""

    name: ClassVar[str] = "messages"
    signature: ClassVar[str] = '"messages" (list of {"role", "content"})'

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A record with a ``messages`` key."""
        return "messages" in record

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """Validated messages; roles are system/user/assistant/tool, contents strings."""
        raw = record.get("messages")
        if not isinstance(raw, list) or not raw:
            raise RecordError("messages", "expected a non-empty list of {role, content} objects")
        out = []
        for i, msg in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(msg, dict):
                raise RecordError(where, f"expected an object, got {type(msg).__name__}")
            role = _string(msg, "role", f"{where}.role")
            if role not in ROLES:
                raise RecordError(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
            out.append({"role": role, "content": _string(msg, "content", f"{where}.content")})
        return _conversation(out, "messages")


class AlpacaFormat:
    """Alpaca: ``{"instruction", "input" (optional), "output"}``, as one user/assistant turn."""

    name: ClassVar[str] = "alpaca"
    signature: ClassVar[str] = '"instruction", "input" (optional), "output"'

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A record with an ``instruction`` key."""
        return "instruction" in record

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """The instruction (and input, after a blank line) as the user turn, output as reply."""
        instruction = _string(record, "instruction", "instruction")
        extra = _string(record, "input", "input", required=False)
        output = _string(record, "output", "output")
        if not instruction.strip():
            raise RecordError("instruction", "is empty")
        if not output.strip():
            raise RecordError("output", "is empty: there is no response to train on")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
        system = _string(record, "system", "system", required=False)
        if system.strip():
            messages.insert(0, {"role": "system", "content": system})
        return Sample(messages=tuple(messages))


class ShareGPTFormat:
    """ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``."""

    name: ClassVar[str] = "sharegpt"
    signature: ClassVar[str] = '"conversations" (list of {"from", "value"})'
    ROLE_OF: ClassVar[dict[str, str]] = {
        "system": "system",
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "model": "assistant",
        "tool": "tool",
        "function_call": "assistant",
        "observation": "tool",
    }

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A record with a ``conversations`` key."""
        return "conversations" in record

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """Turns mapped to OpenAI roles (human -> user, gpt -> assistant)."""
        raw = record.get("conversations")
        if not isinstance(raw, list) or not raw:
            raise RecordError("conversations", "expected a non-empty list of {from, value} objects")
        out = []
        for i, turn in enumerate(raw):
            where = f"conversations[{i}]"
            if not isinstance(turn, dict):
                raise RecordError(where, f"expected an object, got {type(turn).__name__}")
            speaker = _string(turn, "from", f"{where}.from")
            if speaker not in self.ROLE_OF:
                raise RecordError(
                    f"{where}.from", f"{speaker!r} is not one of {', '.join(self.ROLE_OF)}"
                )
            out.append(
                {"role": self.ROLE_OF[speaker], "content": _string(turn, "value", f"{where}.value")}
            )
        return _conversation(out, "conversations")


# Detection tries the formats in this order; the first that matches a file's first record wins.
DATA_FORMATS: dict[str, DataFormat] = {
    f.name: f for f in (MessagesFormat(), ShareGPTFormat(), AlpacaFormat(), TextFormat())
}


def detect_format(record: Mapping[str, Any]) -> DataFormat | None:
    """The first registered format that matches ``record``, or None."""
    return next((f for f in DATA_FORMATS.values() if f.matches(record)), None)
