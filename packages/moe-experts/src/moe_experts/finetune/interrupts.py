"""SIGINT/SIGTERM become a stop request the loop honours at the next step boundary (no torch)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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

    @contextmanager
    def exit_at_once(self, doing: str) -> Iterator[None]:
        """While inside, SIGINT/SIGTERM end the process at once with one ``error:`` line.

        For a blocking call that has nothing to save and that Python cannot interrupt:
        joining the process group waits in C++ for every peer, and a Python signal handler
        runs only once that returns (after its timeout, or never: torchrun, whose SIGTERM
        follows a peer's death, SIGKILLs 30 s later). The C-level handler still writes the
        signal's number to the wakeup descriptor; a thread waiting on it prints the error and
        ends the process with 128 + the signal's number. A no-op outside the main thread, or
        when the handlers are not installed.

        Args:
            doing: what the process was waiting for, for the message ("joining ...").
        """
        if not self._previous or threading.current_thread() is not threading.main_thread():
            yield
            return
        read, write = socket.socketpair()
        write.setblocking(False)
        previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)

        def watch() -> None:
            while byte := read.recv(1):
                signum = byte[0]
                if signum == 0:  # the context is over
                    return
                if signum in self.SIGNALS:
                    name = signal.Signals(signum).name
                    print(
                        f"error: stopped by {name} while {doing}; nothing was saved (under "
                        "torchrun this follows another rank's exit: its output says why)",
                        file=sys.stderr,
                        flush=True,
                    )
                    sys.stdout.flush()
                    os._exit(128 + signum)

        watcher = threading.Thread(target=watch, name="moe-experts-signal-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)
            write.setblocking(True)
            write.send(b"\0")
            watcher.join()
            read.close()
            write.close()
