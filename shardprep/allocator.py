"""Process-wide memory settings for the engines: glibc's malloc keeps freed memory for the next image
(``keep_freed_memory``), and Python's cyclic collector leaves alone the objects a worker made before
its work began (``freeze_startup_objects``) and stays out of heavy imports (``collector_paused``).

Each downloaded image (each loader sample) is decoded into a fresh array of up to tens of MB and freed
a few milliseconds later. With glibc's defaults such arrays are mapped and unmapped, and the top of each
thread arena is trimmed once 128 KiB are free, so the next image faults the same pages in again, each
zeroed by the kernel. Measured: two 10,000-row download shards side by side spent ~1.5 of ~37
CPU-seconds per process more in the kernel, 3-4% of their CPU time in all (A/B, bench/IMAGES.md); a
loader worker on a small VM ~30%. With the settings below allocations under 32 MiB come from the arenas,
which keep up to 256 MiB free at their top and grow by 64 MiB at a time; the price is a resident size
at its high-water mark (+~150 MiB per download process, measured).

Process-wide and once: the engines call ``keep_freed_memory`` before their first image, the loaders'
workers at their start. Left alone where the user has chosen (``MALLOC_*_`` environment variables or
``GLIBC_TUNABLES``) and where the C library is not glibc.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import importlib
import os
import threading
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

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


_frozen = False


def freeze_startup_objects() -> None:
    """Move every object that exists now into the collector's permanent generation, once per process.

    A run worker holds ~500k objects before its first step (Dagster, the code location, torch,
    transformers); each full collection walks all of them (~0.3 s), and a shard's work (a CLIP model
    built, 10,000 rows downloaded) set off several. With ``collector_paused`` around the model's load,
    a 10,000-row run worker of the chain benchmark spent ~0.4 s in the collector instead of ~2 s
    (bench/E2E.md). Frozen, they are never walked again. The cost: a reference
    cycle among them that later becomes garbage is never freed, so this is done once, at a worker's
    start, not after each unit of work."""
    global _frozen
    if not _frozen:
        _freeze()
        _frozen = True


_unfreeze_at_exit = False


def _freeze() -> None:
    """``gc.freeze()``, undone at exit: the interpreter's last collection then finalizes those objects too
    (extension types that count their instances at shutdown, nanobind's, would report them as leaked)."""
    global _unfreeze_at_exit
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True


_pause_lock = threading.Lock()
_pauses = 0  # callers inside collector_paused(), any thread
_was_enabled = False  # the collector's state when the first of them entered


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while the block runs (torch and transformers imported, a model built),
    and what the process holds when the block ends frozen (``gc.freeze``) before the collector resumes.

    An import storm creates hundreds of thousands of long-lived objects, which set off one full
    collection after another, each walking everything the process holds: loading torch, transformers
    and a CLIP model in a run worker took 4.3 CPU-seconds with the collector and 3.1 without (8 full
    collections against 2). Unfrozen, those objects would then be walked by the next collections of
    every generation (~0.3 s each, measured). Reference counting still frees everything not in a cycle;
    a cycle that was alive at the freeze and dies later is not freed (modules and models live as long
    as the process). Threads may overlap: the collector is restored, as the first caller found it,
    when the last one leaves."""
    global _pauses, _was_enabled
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0:
                _freeze()
                if _was_enabled:
                    gc.enable()


@functools.cache
def import_paused(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with the collector paused, once per process and module (torch
    where the first device lookup needs it). Once: the pause's end freezes what
    the process holds, which belongs to a worker's start, not to each shard that asks again."""
    with collector_paused():
        return importlib.import_module(name)
