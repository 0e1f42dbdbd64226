"""Waits for a thread's result that a Ctrl-C (SIGINT, SIGTERM turned into an exception) still interrupts.

The kernel hands a process-directed signal to any thread that does not block it: when it lands on a worker
thread (a download blocked in a socket read), CPython only flags it, and the main thread runs the Python
handler the next time it executes bytecode. A main thread blocked in ``Future.result()`` without a
timeout would then notice the KeyboardInterrupt only when that future completes: up to 3 x the download
timeout with slow servers. Waiting in short slices bounds that delay.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

SLICE_SECONDS = 0.25


def result(future: Future) -> Any:
    """``future.result()``, waking every SLICE_SECONDS so a pending signal's handler runs."""
    while True:
        try:
            return future.result(timeout=SLICE_SECONDS)
        except TimeoutError:
            if future.done():  # the call itself raised a TimeoutError: that is its result
                return future.result()
