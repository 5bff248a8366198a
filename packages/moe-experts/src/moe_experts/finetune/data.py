"""Reading ``--data`` files into token examples, and deterministic packed batches.

Batches are *packed with attention boundaries*: examples share rows of ``seq_len + 1`` tokens
(conversations whole, best-fit; see :class:`PackedBatches`), ``position_ids`` restart at 0
where an example starts, and :meth:`Batch.model_inputs` gives the model what its family needs
to keep them apart (block-diagonal masks; :mod:`moe_experts.isolation`), so no token sees
another example. A family that carries state across tokens other than attention gets one
example per row (``one_per_row``). Labels are ``-100`` (no loss, no gradient) on prompt
tokens of chat and instruction data, and where the next token belongs to another example.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from moe_experts.finetune.documents import json_too_deep
from moe_experts.finetune.errors import FinetuneError
from moe_experts.finetune.formats import (
    DATA_FORMATS,
    DataFormat,
    RecordError,
    Sample,
    detect_format,
)

__all__ = [
    "IGNORE_INDEX",
    "MAX_RECORD_DEPTH",
    "Batch",
    "ByteTokenizer",
    "DataError",
    "Example",
    "PackedBatches",
    "causal_lm_loss",
    "chat_demo_path",
    "default_corpus_path",
    "encode_text",
    "epoch_order",
    "load_examples",
    "load_samples",
    "load_texts",
    "tokenize_samples",
]

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
MAX_REPORTED = 20  # bad records listed before the rest are only counted
# json.loads recurses per level (RecursionError near 1000); every data format nests 3 or 4.
MAX_RECORD_DEPTH = 16
_TOO_DEEP = f"nested more than {MAX_RECORD_DEPTH} deep; no data format nests past 4"


class DataError(FinetuneError):
    """Bad records in a data file: ``problems`` holds one ``file:line: field: why`` per record."""

    def __init__(self, problems: Sequence[str], total: int | None = None) -> None:
        self.problems = list(problems)
        more = (total or len(self.problems)) - len(self.problems)
        self.lines = self.problems + ([f"... and {more} more bad records"] if more > 0 else [])
        super().__init__("\n".join(self.lines))


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, plus BOS, EOS and PAD; needs no vocabulary file."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """Return ``[BOS] + utf-8 bytes + [EOS]``."""
        return [self.bos_token_id, *text.encode("utf-8"), self.eos_token_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Invert :meth:`encode`, dropping the special tokens."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Example:
    """One tokenised document: ``train[i]`` says whether token ``i`` is a loss target."""

    ids: tuple[int, ...]
    train: tuple[bool, ...]
    # A conversation: the token offsets where a piece of it may start when it is longer than a
    # row (its exchange boundaries; may be empty). None: plain text, streamed across rows.
    cuts: tuple[int, ...] | None = None


def default_corpus_path() -> Path:
    """The small English corpus shipped inside the package."""
    return Path(str(resources.files("moe_experts.finetune").joinpath("corpus.txt")))


def chat_demo_path() -> Path:
    """The small chat dataset (OpenAI ``messages``) shipped inside the package."""
    return Path(str(resources.files("moe_experts.finetune").joinpath("chat_demo.jsonl")))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain document: the tokenizer's own special tokens, then EOS."""
    ids = list(tokenizer(text)["input_ids"])
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + ([eos] if eos is not None and (not ids or ids[-1] != eos) else [])


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, record)`` pairs; a ``.txt`` line is ``{"text": line}``."""
    suffix = path.suffix.lower()
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FinetuneError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise FinetuneError(f"{path}: cannot read it ({exc.strerror})") from exc
    if suffix == ".txt":
        for lineno, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                yield lineno, {"text": line.strip()}
    elif suffix == ".jsonl":
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            if json_too_deep(line, MAX_RECORD_DEPTH) is not None:
                yield lineno, RecordError("(record)", _TOO_DEEP)
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield (
                    lineno,
                    RecordError("(line)", f"not valid JSON ({exc.msg} at column {exc.colno})"),
                )
    elif suffix == ".json":
        yield from _json_array(path, raw)
    else:
        raise FinetuneError(f"{path}: expected a .txt, .jsonl or .json file, got {suffix!r}")


def _json_array(path: Path, raw: str) -> Iterator[tuple[int, Any]]:
    """The elements of a top-level JSON array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    i = len(raw) - len(raw.lstrip())
    if not raw[i : i + 1] == "[":
        raise FinetuneError(
            f"{path}: a .json data file must hold one array of records "
            "(use .jsonl for one record per line)"
        )
    deep = json_too_deep(raw, MAX_RECORD_DEPTH + 1)  # + 1: the array around the records
    if deep is not None:
        line = raw.count("\n", 0, deep) + 1
        raise FinetuneError(f"{path}:{line}: a record is {_TOO_DEEP}")
    i += 1
    while True:
        while i < len(raw) and raw[i] in " \t\r\n,":
            i += 1
        if i >= len(raw):
            raise FinetuneError(f"{path}: the JSON array is not closed with ]")
        if raw[i] == "]":
            return
        line = raw.count("\n", 0, i) + 1
        try:
            value, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError as exc:
            raise FinetuneError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
        yield line, value


def load_samples(path: Path, data_format: str | None = None) -> list[Sample]:
    """Read every record of a data file as a :class:`Sample`.

    The format is ``data_format`` (a key of :data:`DATA_FORMATS`) or detected from the
    file's first record.

    Raises:
        DataError: one line per bad record (``file:line: field: why``).
        FinetuneError: if the file is missing, unreadable, empty, or of an unknown format.
    """
    if data_format is not None and data_format not in DATA_FORMATS:
        raise FinetuneError(
            f"--data-format {data_format!r}: expected one of {', '.join(DATA_FORMATS)}"
        )
    if not path.is_file():
        raise FinetuneError(f"--data {path}: no such file")
    fmt: DataFormat | None = DATA_FORMATS[data_format] if data_format else None
    samples: list[Sample] = []
    problems: list[str] = []
    bad = 0
    for lineno, record in _records(path):
        try:
            if isinstance(record, RecordError):
                raise record
            if not isinstance(record, dict):
                raise RecordError(
                    "(record)", f"expected a JSON object, got {type(record).__name__}"
                )
            if fmt is None:
                fmt = detect_format(record)
                if fmt is None:
                    raise FinetuneError(
                        f"{path}:{lineno}: the record matches no data format (keys: "
                        f"{', '.join(sorted(record)) or 'none'}); expected one of: "
                        + "; ".join(f"{f.name}: {f.signature}" for f in DATA_FORMATS.values())
                    )
            samples.append(replace(fmt.parse(record), line=lineno))
        except RecordError as exc:
            bad += 1
            if len(problems) < MAX_REPORTED:
                shown = f"{fmt.name} " if fmt is not None and exc.field != "(line)" else ""
                problems.append(f"{path}:{lineno}: {shown}field {exc.field}: {exc.message}")
    if problems:
        raise DataError(problems, bad)
    if not samples:
        raise FinetuneError(f"--data {path}: the file holds no records")
    return samples


def load_texts(path: Path) -> list[str]:
    """Read plain-text documents (``.txt`` lines or ``{"text": ...}`` records).

    Raises:
        FinetuneError: if the file is missing, malformed, or holds conversations.
    """
    samples = load_samples(path)
    texts = [s.text for s in samples if s.text is not None]
    if len(texts) != len(samples):
        raise FinetuneError(f"--data {path}: holds conversations, not plain text")
    return texts


def load_examples(
    path: Path, tokenizer: Any, *, data_format: str | None = None, train_on_prompt: bool = False
) -> list[Example]:
    """Read and tokenise a data file: text fully trained, conversations on the replies only.

    Raises:
        DataError: one line per bad record.
        FinetuneError: for a missing or malformed file, or a tokenizer without chat template.
    """
    return tokenize_samples(
        path, load_samples(path, data_format), tokenizer, train_on_prompt=train_on_prompt
    )


def tokenize_samples(
    path: Path, samples: Sequence[Sample], tokenizer: Any, *, train_on_prompt: bool = False
) -> list[Example]:
    """Tokenise samples read from ``path`` (named in errors); see :func:`load_examples`."""
    from moe_experts.finetune.chat import render_turns

    examples = []
    problems = []
    for sample in samples:
        if sample.text is not None:
            ids = encode_text(tokenizer, sample.text)
            examples.append(Example(tuple(ids), (True,) * len(ids)))
            continue
        try:
            ids, train, cuts = render_turns(
                tokenizer, sample.messages or (), train_on_prompt=train_on_prompt
            )
        except RecordError as exc:
            problems.append(f"{path}:{sample.line}: field {exc.field}: {exc.message}")
            continue
        examples.append(Example(tuple(ids), tuple(train), tuple(cuts)))
    if problems:
        raise DataError(problems[:MAX_REPORTED], len(problems))
    return examples


def epoch_order(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The ``batch_size`` item indices of ``step``: each epoch a fresh permutation of ``n``.

    The permutation of epoch ``e`` is seeded ``seed + e``, so a resumed run (or another
    world size with the same global batch) sees the same order.
    """
    perms: dict[int, torch.Tensor] = {}
    idx = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        idx.append(int(perms[epoch][pos]))
    return idx


@dataclass(frozen=True)
class Batch:
    """Model inputs for one step: ``input_ids``, ``labels`` and ``position_ids``, all ``[B, L]``."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # IGNORE_INDEX where no loss is taken
    position_ids: torch.Tensor  # restart at 0 per example: the attention boundaries

    def select(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` (one rank's share of the global batch)."""
        return Batch(
            self.input_ids[start:stop], self.labels[start:stop], self.position_ids[start:stop]
        )

    def model_inputs(self, model: torch.nn.Module) -> dict[str, Any]:
        """Keyword arguments for ``model``'s forward that keep each row's examples apart.

        The way depends on the model's family (:func:`moe_experts.isolation.packed_model_inputs`):
        restarting ``position_ids``, or explicit block-diagonal masks as well.

        Raises:
            moe_experts.PackingError: the family needs one example per row and a row holds two.
        """
        from moe_experts.isolation import packed_model_inputs

        return packed_model_inputs(model, self.input_ids, self.position_ids)

    @property
    def num_targets(self) -> int:
        """How many tokens carry loss."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        """How many tokens the model reads (padding included)."""
        return self.input_ids.numel()


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_targets: float | None = None
) -> torch.Tensor:
    """Cross-entropy summed over the targets (``labels != -100``) and divided by their number.

    Args:
        logits: ``[B, L, V]``.
        labels: ``[B, L]``, already aligned (label ``t`` is token ``t+1``).
        num_targets: the divisor; default the targets in ``labels``. Data-parallel ranks pass
            ``global targets / world size`` so that the average of their gradients is the
            gradient of the global mean, whatever each rank's share of masked tokens.

    Returns:
        A scalar; 0 (still with a graph) when there is no target.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])
    total = torch.nn.functional.cross_entropy(
        flat, labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    if num_targets is None:
        num_targets = int((labels != IGNORE_INDEX).sum())
    return total / max(num_targets, 1)


@dataclass(frozen=True)
class PackedBatches:
    """Examples packed into rows of ``seq_len + 1`` tokens.

    With ``one_per_row`` every example (or piece of one) has a row of its own. Otherwise
    conversations (examples with turn boundaries or untrained prompt tokens) are kept whole:
    one longer than a row is first split at its exchange boundaries (a single turn longer than
    a row is cut at the row's length), then the pieces are placed by best-fit decreasing
    (:func:`packing.best_fit_decreasing`), each row's pieces in data order, and the rest of
    each row is padding. Every piece's ``positions`` start at 0, which is the attention and
    label boundary. Plain-text examples are concatenated after them and cut into full rows
    (the last partial row is dropped).

    Batch ``step`` is a pure function of (seed, step): rows are drawn from a permutation per
    epoch seeded by ``seed + epoch``, so a resumed run sees exactly the batches it would have.
    """

    rows: torch.Tensor  # [N, seq_len + 1] int64 token ids
    batch_size: int
    seed: int
    targets: torch.Tensor | None = None  # [N, seq_len + 1] bool: token is a loss target
    positions: torch.Tensor | None = None  # [N, seq_len + 1] int64 position in its example
    pad_tokens: int = 0  # padding tokens in ``rows`` (each alone at position 0: no attention)

    @property
    def padding_fraction(self) -> float:
        """The share of the tokens in ``rows`` that are padding."""
        return self.pad_tokens / max(self.rows.numel(), 1)

    @classmethod
    def from_examples(
        cls,
        examples: Sequence[Example],
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        one_per_row: bool = False,
    ) -> PackedBatches:
        """Pack tokenised examples; refuses data too small for one row or without any target.

        Args:
            examples: the tokenised data, in data order.
            seq_len: tokens a row feeds the model (rows hold ``seq_len + 1``).
            batch_size: rows per optimizer step.
            seed: seeds the order of rows per epoch.
            one_per_row: give every example (every piece of one longer than a row, plain text
                included) a row of its own, the rest padding: for a family that cannot keep
                examples apart within a row (``not arch.packing.shares_rows``).
        """
        from moe_experts.finetune.packing import best_fit_decreasing, split_at_turns

        width = seq_len + 1
        pieces: list[tuple[Example, int, int]] = []
        stream: list[Example] = []
        for ex in examples:
            if not ex.ids:
                continue
            if ex.cuts is None and all(ex.train) and not one_per_row:
                stream.append(ex)
                continue
            # A reply packed away from its prompt would be learned without its question, so a
            # conversation is only ever split between exchanges (or inside one too long a turn).
            pieces += [(ex, a, b) for a, b in split_at_turns(len(ex.ids), ex.cuts or (), width)]
        ids: list[int] = []
        train: list[bool] = []
        pos: list[int] = []
        sizes = [b - a for _, a, b in pieces]
        if one_per_row:
            bins = [[j] for j in range(len(pieces))]
        else:
            bins = best_fit_decreasing(sizes, width)
        for members in bins:
            for j in sorted(members):
                ex, a, b = pieces[j]
                ids.extend(ex.ids[a:b])
                train.extend(ex.train[a:b])
                pos.extend(range(b - a))
            # Padding starts an example at every token (position 0): no attention, no loss.
            gap = -len(ids) % width
            ids.extend([0] * gap)
            train.extend([False] * gap)
            pos.extend([0] * gap)
        pad_tokens = len(ids) - sum(b - a for _, a, b in pieces)
        for ex in stream:
            ids.extend(ex.ids)
            train.extend(ex.train)
            pos.extend(range(len(ex.ids)))
        n_rows = len(ids) // width
        if n_rows < 1:
            raise FinetuneError(
                f"the data has {len(ids)} tokens, fewer than one row of --seq-len "
                f"{seq_len} + 1; use more data or a smaller --seq-len"
            )

        def rows(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values[: n_rows * width], dtype=dtype).view(n_rows, width)

        targets, positions = rows(train, torch.bool), rows(pos, torch.long)
        if not (targets[:, 1:] & (positions[:, 1:] != 0)).any():
            raise FinetuneError(
                "the data has no tokens to train on (every token is prompt); "
                "check the data or pass --train-on-prompt"
            )
        return cls(rows(ids, torch.long), batch_size, seed, targets, positions, pad_tokens)

    @classmethod
    def build(
        cls,
        texts: Sequence[str],
        encode: Callable[[str], list[int]],
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
    ) -> PackedBatches:
        """Tokenise plain ``texts`` with ``encode`` and pack them (every token trained)."""
        examples = []
        for text in texts:
            ids = encode(text)
            examples.append(Example(tuple(ids), (True,) * len(ids)))
        return cls.from_examples(examples, seq_len=seq_len, batch_size=batch_size, seed=seed)

    def _indices(self, step: int) -> list[int]:
        return epoch_order(step, self.batch_size, self.rows.shape[0], self.seed)

    def batch(self, step: int) -> torch.Tensor:
        """The global token rows ``[batch_size, seq_len + 1]`` of optimizer step ``step``."""
        return self.rows[self._indices(step)]

    def model_batch(self, step: int) -> Batch:
        """The global :class:`Batch` ``[batch_size, seq_len]`` for optimizer step ``step``."""
        idx = self._indices(step)
        rows = self.rows[idx]
        if self.targets is not None:
            targets = self.targets[idx]
        else:
            targets = torch.ones_like(rows, dtype=torch.bool)
        if self.positions is not None:
            positions = self.positions[idx]
        else:
            positions = torch.arange(rows.shape[1]).expand_as(rows)
        # Label t is token t+1; no loss where t+1 is not a target or starts another example.
        keep = targets[:, 1:] & (positions[:, 1:] != 0)
        labels = torch.where(keep, rows[:, 1:], torch.full_like(rows[:, 1:], IGNORE_INDEX))
        return Batch(rows[:, :-1], labels, positions[:, :-1].contiguous())
