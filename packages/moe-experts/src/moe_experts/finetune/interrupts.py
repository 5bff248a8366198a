"""SIGINT/SIGTERM become a stop request the loop honours at the next step boundary (no torch)."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["StopRequest"]


class StopRequest:
    """While entered, the first SIGINT/SIGTERM is recorded instead of killing the process.

    The loop polls :attr:`signum` after each optimizer step, saves a checkpoint and stops.
    A second signal raises ``KeyboardInterrupt`` at once (the user insists).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        """Start with no request and no handlers installed."""
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopRequest:
        """Install the handlers (only possible in the main thread; elsewhere a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
