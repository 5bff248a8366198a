"""Conversations through the tokenizer's own chat template, with a loss mask on the replies.

The whole conversation is rendered once with ``tokenizer.apply_chat_template`` (so the template
decides every marker, system prompt and generation header), then each assistant reply is
located in the rendered text. Trained characters are the reply itself and the template's
end-of-turn marker after it, so the model learns to stop. An empty ``<think></think>`` block
that a thinking-model template inserts before a reply is not part of the reply and gets no
loss; a non-empty one (real reasoning in the data) does.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from typing import Any

from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import RecordError

__all__ = ["ChatTemplateError", "assistant_spans", "render_conversation", "render_turns"]

_SENTINEL = "MOE_EXPERTS_REPLY_SENTINEL"
_THINK = re.compile(r"<think>(.*?)</think>\s*$", re.DOTALL)


class ChatTemplateError(FinetuneError):
    """The model's tokenizer cannot render conversations."""


def _render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the tokenizer of the model ({type(tokenizer).__name__}) has no chat template, so "
            "chat, alpaca and sharegpt data cannot be rendered; use a model whose tokenizer has "
            'one, or convert the data to {"text": ...} records'
        )
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    except Exception as exc:  # jinja raises template-defined errors of many types
        raise RecordError("messages", f"the model's chat template rejected it: {exc}") from exc
    return text if isinstance(text, str) else str(text)


def _end_of_turn(tokenizer: Any) -> str:
    """The marker the template writes after an assistant reply (``<|im_end|>``, ``</s>``)."""
    rendered = _render(
        tokenizer,
        [{"role": "user", "content": "ping"}, {"role": "assistant", "content": _SENTINEL}],
    )
    return rendered[rendered.rfind(_SENTINEL) + len(_SENTINEL) :].strip()


def assistant_spans(
    tokenizer: Any, messages: Sequence[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return the text with the ``[start, end)`` character spans to train.

    Raises:
        RecordError: if an assistant reply does not appear verbatim in the rendered text.
        ChatTemplateError: if the tokenizer has no chat template.
    """
    rendered = _render(tokenizer, messages)
    eot = _end_of_turn(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        content = msg["content"]
        # A reply with its reasoning inline: thinking templates re-render the part after it.
        visible = content.split("</think>")[-1].strip()
        if not visible:
            continue
        pos = rendered.find(visible, cursor)
        if pos < 0:
            if msg["role"] != "assistant":
                continue  # a template may rewrite a system or tool message; nothing to train
            raise RecordError(
                f"messages[{i}].content",
                "the model's chat template does not render this reply verbatim, so its tokens "
                "cannot be located for response-only loss; pass --train-on-prompt",
            )
        end = pos + len(visible)
        if msg["role"] == "assistant":
            start = pos
            think = _THINK.search(rendered, cursor, pos)
            if think is not None and think.group(1).strip():
                start = think.start()  # real reasoning from the data is part of the reply
            rest = rendered[end:]
            skipped = len(rest) - len(rest.lstrip())
            if eot and rest.lstrip().startswith(eot):
                end += skipped + len(eot)
            spans.append((start, end))
        cursor = end
    return rendered, spans


def render_conversation(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, train_on_prompt: bool = False
) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation and, per token, whether it is a training target.

    Returns:
        ``(ids, train)``, two lists of equal length; ``train[i]`` is True for tokens of
        assistant replies (every token with ``train_on_prompt``).
    """
    ids, train, _ = render_turns(tokenizer, messages, train_on_prompt=train_on_prompt)
    return ids, train


def render_turns(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, train_on_prompt: bool = False
) -> tuple[list[int], list[bool], list[int]]:
    """:func:`render_conversation` plus the token offsets where a new exchange starts.

    An exchange boundary is the token right after an assistant reply and its end-of-turn
    marker: a piece of the conversation cut there starts with the next prompt, never with a
    reply whose question is in another piece.

    Returns:
        ``(ids, train, cuts)``; ``cuts`` are offsets in ``(0, len(ids))``, ascending.
    """
    rendered, spans = assistant_spans(tokenizer, messages)
    # Not after the last reply: what follows it (a newline) is no exchange of its own.
    ends = sorted({b for _, b in spans if b > 0 and rendered[b:].strip()})
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = enc["offset_mapping"]
        train = [any(a <= s < b for a, b in spans) for s, _ in offsets]
        starts = [s for s, _ in offsets]
        cuts = [bisect.bisect_left(starts, e) for e in ends]
    else:
        ids, train, cuts = [], [], []
        pieces = sorted({0, len(rendered), *(x for span in spans for x in span)})
        for a, b in itertools.pairwise(pieces):
            if a in ends:
                cuts.append(len(ids))
            piece = tokenizer(rendered[a:b], add_special_tokens=False)["input_ids"]
            inside = any(s <= a and b <= e for s, e in spans)
            ids += piece
            train += [inside] * len(piece)
    if train_on_prompt:
        train = [True] * len(ids)
    return ids, train, sorted({c for c in cuts if 0 < c < len(ids)})
