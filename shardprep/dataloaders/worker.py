"""How our DataLoader workers start: the parent's objects frozen out of their garbage collector, and
glibc's malloc told to keep freed memory for reuse (``shardprep.allocator``; both loaders pass
``start_worker`` as ``worker_init_fn``)."""

import gc

from shardprep.allocator import keep_freed_memory


def start_worker(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn`` of our loaders: ``keep_freed_memory``, and the objects the worker
    inherited from its parent are frozen out of its garbage collector.

    A forked worker would otherwise collect, and finalize, the parent's not-yet-collected garbage: e.g.
    an earlier loader's iterator in a reference cycle, whose ``__del__`` then shuts down the parent's
    old workers from the child. On CPython 3.11.7 such a finalizer run was seen to break the worker's
    next ``np.load`` (gh-106905, "AST constructor recursion depth mismatch"). Frozen, the parent's
    objects are also left out of the worker's collections (fewer copy-on-write page touches)."""
    gc.freeze()
    keep_freed_memory()
