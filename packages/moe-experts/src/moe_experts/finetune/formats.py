"""The data formats ``--data`` understands: one class per format, registered in one table.

A format turns one decoded record (a JSON object, or one line of a ``.txt`` file) into a
:class:`Sample`: plain text, a conversation in OpenAI ``role``/``content`` messages that the
model's own chat template renders, or a preference pair (``--method dpo|orpo``). Adding a
format is one class and one entry in :data:`DATA_FORMATS`; detection, errors and tokenisation
are shared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = [
    "DATA_FORMATS",
    "PREFERENCE_FORMATS",
    "AlpacaFormat",
    "DataFormat",
    "ImplicitPromptPreferenceFormat",
    "MessagesFormat",
    "PreferenceFormat",
    "PreferencePair",
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


Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class PreferencePair:
    """A prompt with a chosen and a rejected response: all strings, or all message lists.

    Conversational pairs (message lists) are rendered by the model's chat template: the prompt
    with the generation prompt, and prompt + each response in full.
    """

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages

    @property
    def conversational(self) -> bool:
        """Whether the pair is made of messages (rendered by the chat template)."""
        return not isinstance(self.prompt, str)


@dataclass(frozen=True)
class Sample:
    """One record: ``text`` (all tokens trained), ``messages`` (a conversation) or ``pair``."""

    text: str | None = None
    messages: Messages | None = None
    line: int = field(default=0, compare=False)  # where the record starts in its file
    pair: PreferencePair | None = None  # a preference record (--method dpo|orpo)


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


def _message_list(raw: Any, field: str) -> Messages:
    """Validated ``{role, content}`` messages of the list at JSON path ``field``."""
    if not isinstance(raw, list) or not raw:
        raise RecordError(field, "expected a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise RecordError(where, f"expected an object, got {type(msg).__name__}")
        role = _string(msg, "role", f"{where}.role")
        if role not in ROLES:
            raise RecordError(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
        out.append({"role": role, "content": _string(msg, "content", f"{where}.content")})
    return tuple(out)


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
        return _conversation(list(_message_list(record.get("messages"), "messages")), "messages")


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


def _response(value: Any, field: str, *, conversational: bool) -> str | Messages:
    if value is None:
        raise RecordError(field, "is missing: a preference record needs both sides")
    if not conversational:
        if not isinstance(value, str):
            raise RecordError(
                field, f"expected a string like the prompt's, got {type(value).__name__}"
            )
        if not value.strip():
            raise RecordError(field, "is empty: there is no response to compare")
        return value
    messages = _message_list(value, field)
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise RecordError(
            f"{field}[{len(messages) - 1}]",
            "is empty or not an assistant turn: there is no response to compare",
        )
    return messages


class PreferenceFormat:
    """``{"prompt", "chosen", "rejected"}``: strings, or message lists (TRL's explicit prompt)."""

    name: ClassVar[str] = "preference"
    signature: ClassVar[str] = (
        '"prompt", "chosen", "rejected" (strings, or lists of {"role", "content"})'
    )

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A record with a ``prompt`` and a ``chosen`` or ``rejected`` key."""
        return "prompt" in record and ("chosen" in record or "rejected" in record)

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """The pair; both responses must be there, non-empty, of the prompt's kind."""
        raw = record.get("prompt")
        if isinstance(raw, str):
            if not raw.strip():
                raise RecordError("prompt", "is empty")
            prompt: str | Messages = raw
        else:
            prompt = _message_list(raw, "prompt")
        chat = not isinstance(prompt, str)
        pair = PreferencePair(
            prompt,
            _response(record.get("chosen"), "chosen", conversational=chat),
            _response(record.get("rejected"), "rejected", conversational=chat),
        )
        return Sample(pair=pair)


class ImplicitPromptPreferenceFormat:
    """``{"chosen": [messages], "rejected": [messages]}``; shared first turns: the prompt."""

    name: ClassVar[str] = "preference_implicit"
    signature: ClassVar[str] = (
        '"chosen", "rejected" (lists of {"role", "content"} that share their first turns)'
    )

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A record with ``chosen`` or ``rejected`` and no ``prompt``."""
        return "prompt" not in record and ("chosen" in record or "rejected" in record)

    def parse(self, record: Mapping[str, Any]) -> Sample:
        """Split both conversations after their longest common prefix of messages."""
        sides = {}
        for side in ("chosen", "rejected"):
            value = record.get(side)
            if value is None:
                raise RecordError(side, "is missing: a preference record needs both sides")
            sides[side] = _message_list(value, side)
        chosen, rejected = sides["chosen"], sides["rejected"]
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise RecordError(
                "chosen[0]", "chosen and rejected share no leading turn, so there is no prompt"
            )
        for side, messages in sides.items():
            if shared == len(messages):
                raise RecordError(side, "has no turn after the shared prompt: no response")
            last = messages[-1]
            if last["role"] != "assistant" or not last["content"].strip():
                raise RecordError(
                    f"{side}[{len(messages) - 1}]",
                    "is empty or not an assistant turn: there is no response to compare",
                )
        return Sample(pair=PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:]))


# Detection tries the formats in this order; the first that matches a file's first record wins.
DATA_FORMATS: dict[str, DataFormat] = {
    f.name: f
    for f in (
        MessagesFormat(),
        ShareGPTFormat(),
        AlpacaFormat(),
        PreferenceFormat(),
        ImplicitPromptPreferenceFormat(),
        TextFormat(),
    )
}

# The formats of preference records: --method dpo|orpo reads these and no others.
PREFERENCE_FORMATS = ("preference", "preference_implicit")


def detect_format(record: Mapping[str, Any]) -> DataFormat | None:
    """The first registered format that matches ``record``, or None."""
    return next((f for f in DATA_FORMATS.values() if f.matches(record)), None)
