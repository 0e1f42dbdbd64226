"""glibc malloc settings for the engines that decode and free one buffer after another: keep freed
memory for the next one instead of handing it back to the kernel.

Each downloaded image (each loader sample) is decoded into a fresh array of up to tens of MB and freed
a few milliseconds later. With glibc's defaults such arrays are mapped and unmapped, and the top of each
thread arena is trimmed once 128 KiB are free, so the next image faults the same pages in again, each
zeroed by the kernel. Measured: two 10,000-row download shards side by side spent ~1.7 of ~36
CPU-seconds per process more in the kernel, ~5% of their CPU time in all (bench/IMAGES.md); a loader
worker on a small VM ~30%. With the settings below allocations under 32 MiB come from the arenas,
which keep up to 256 MiB free at their top and grow by 64 MiB at a time; the price is a resident size
at its high-water mark (+~150 MiB per download process, measured).

Process-wide and once: the engines call ``keep_freed_memory`` before their first image, the loaders'
workers at their start. Left alone where the user has chosen (``MALLOC_*_`` environment variables or
``GLIBC_TUNABLES``) and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os

# mallopt parameters (glibc's malloc.h); 32 MiB is glibc's maximum mmap threshold on 64-bit
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 256 << 20), (M_TOP_PAD, 64 << 20))
_USER_CHOICE = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied: bool | None = None  # None: not tried yet in this process


def keep_freed_memory() -> bool:
    """Apply ``SETTINGS`` once per process; True when they are in force (this call or an earlier one).
    A forked child inherits them (and this module's answer)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if any(name in os.environ for name in _USER_CHOICE) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all([mallopt(param, value) == 1 for param, value in SETTINGS])  # a list: every one is tried
