"""Text corpora, the byte-level tokenizer of the built-in model, and deterministic batching."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from moe_experts.finetune.errors import FinetuneError

__all__ = ["ByteTokenizer", "PackedBatches", "default_corpus_path", "load_texts"]


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


def default_corpus_path() -> Path:
    """The small English corpus shipped inside the package."""
    return Path(str(resources.files("moe_experts.finetune").joinpath("corpus.txt")))


def load_texts(path: Path) -> list[str]:
    """Read documents from a ``.txt`` (one per non-empty line) or ``.jsonl`` (``{"text": ...}``).

    Raises:
        FinetuneError: if the file is missing, has another suffix, or a JSON line is malformed.
    """
    if not path.is_file():
        raise FinetuneError(f"--data {path}: no such file")
    suffix = path.suffix.lower()
    raw = path.read_text(encoding="utf-8")
    if suffix == ".txt":
        texts = [line.strip() for line in raw.splitlines() if line.strip()]
    elif suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FinetuneError(f"--data {path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise FinetuneError(
                    f'--data {path}:{lineno}: expected an object with a "text" string, '
                    f"got {line[:80]!r}"
                )
            texts.append(record["text"])
    else:
        raise FinetuneError(f"--data {path}: expected a .txt or .jsonl file, got {suffix!r}")
    if not texts:
        raise FinetuneError(f"--data {path}: the file holds no text")
    return texts


@dataclass(frozen=True)
class PackedBatches:
    """Documents tokenised, concatenated and cut into rows of ``seq_len + 1`` tokens.

    Batch ``step`` is a pure function of (seed, step): rows are drawn from a permutation per
    epoch seeded by ``seed + epoch``, so a resumed run sees exactly the batches it would have.
    """

    rows: torch.Tensor  # [N, seq_len + 1] int64
    batch_size: int
    seed: int

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
        """Tokenise ``texts`` and pack them; refuses a corpus too small for one row."""
        stream: list[int] = []
        for text in texts:
            stream.extend(encode(text))
        n_rows = len(stream) // (seq_len + 1)
        if n_rows < 1:
            raise FinetuneError(
                f"the corpus has {len(stream)} tokens, fewer than one row of --seq-len "
                f"{seq_len} + 1; use a larger corpus or a smaller --seq-len"
            )
        rows = torch.tensor(stream[: n_rows * (seq_len + 1)], dtype=torch.long)
        return cls(rows.view(n_rows, seq_len + 1), batch_size, seed)

    def batch(self, step: int) -> torch.Tensor:
        """Return the global batch ``[batch_size, seq_len + 1]`` for optimizer step ``step``."""
        n = self.rows.shape[0]
        perms: dict[int, torch.Tensor] = {}
        idx = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, pos = divmod(i, n)
            if epoch not in perms:
                perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(
                    self.seed + epoch))
            idx.append(int(perms[epoch][pos]))
        return self.rows[idx]
