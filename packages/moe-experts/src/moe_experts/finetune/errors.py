"""The error types the fine-tune CLI turns into a message and an exit code (no torch import)."""

from __future__ import annotations

__all__ = ["FinetuneError", "PeerLostError", "TrainingDivergedError", "TrainingInterrupted"]


class FinetuneError(RuntimeError):
    """A user-facing problem: bad config, missing file, unsupported model, corrupt checkpoint."""


class TrainingDivergedError(FinetuneError):
    """The loss or gradient norm stopped being finite (or the gradient vanished): lower --lr."""


class PeerLostError(FinetuneError):
    """Another torchrun rank died or closed its connection; the message names which."""


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run after a checkpoint at ``step`` (exit 128 + ``signum``)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        """Record which signal stopped the run, at which step, and the checkpoint saved then."""
        super().__init__(f"interrupted by signal {signum} at step {step}")
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
