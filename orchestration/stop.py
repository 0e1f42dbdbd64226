"""Stopping a run on SIGTERM or SIGINT (Ctrl-C) without losing work: see ``Stop``."""

from __future__ import annotations

import os
import signal
import time


class Stop:
    """SIGTERM and SIGINT stop the run promptly: work in progress is interrupted or cancelled (Dagster
    fails or cancels it and frees its pool slots; atomic writes leave no partial output), and nothing
    further starts.

    While a run executes in this process, Dagster's own handlers turn both signals into an interrupted
    step, so ours never sees them there; the signal numbers are read instead from the wakeup fd that
    Python's C-level handler writes every signal to, whichever Python handler runs."""

    def __init__(self, raise_between: bool = True) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() when the signal was first seen
        self.raise_between = raise_between  # in-process: a signal between runs ends the loop at once

    def _handle(self, signum, frame) -> None:
        self.received()
        if self.signum is None:
            self._stopped(signum)
            if self.raise_between:
                raise KeyboardInterrupt

    def _stopped(self, signum: int) -> None:
        self.signum, self.at = signum, time.monotonic()

    def received(self) -> int | None:
        """The first stop signal received so far (None: none)."""
        try:
            data = os.read(self._read, 512)
        except BlockingIOError:
            data = b""
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT) and self.signum is None:
                self._stopped(signum)
        return self.signum

    @property
    def reason(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"

    def __enter__(self) -> Stop:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write)
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
