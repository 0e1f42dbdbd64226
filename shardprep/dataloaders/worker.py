"""How our DataLoader workers start: the parent's objects frozen out of their garbage collector, and
glibc's malloc told to keep freed memory for reuse (both loaders pass ``start_worker`` as
``worker_init_fn``)."""

import gc

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: let glibc's malloc keep freed memory for reuse in the worker.

    Every sample allocates and frees the same few buffers (decoded image, its tensor copies, ~1 MB
    each). By default glibc serves such sizes with fresh ``mmap``s, or trims them off its heap on
    free, so every sample pays hundreds of page faults (measured: ~30% of a worker's CPU time on
    a small VM). Raising the mmap and trim thresholds makes the buffers come back from the heap.
    A worker's memory then stays at its high-water mark (a few batches). Not glibc: nothing."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum for this setting
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)


def start_worker(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn`` of our loaders: ``keep_freed_memory``, and the objects the worker
    inherited from its parent are frozen out of its garbage collector.

    A forked worker would otherwise collect, and finalize, the parent's not-yet-collected garbage: e.g.
    an earlier loader's iterator in a reference cycle, whose ``__del__`` then shuts down the parent's
    old workers from the child. On CPython 3.11.7 such a finalizer run was seen to break the worker's
    next ``np.load`` (gh-106905, "AST constructor recursion depth mismatch"). Frozen, the parent's
    objects are also left out of the worker's collections (fewer copy-on-write page touches)."""
    gc.freeze()
    keep_freed_memory(worker_id)
