"""Whether an embedded (SQLite) instance's records may have changed since the last look, from its files.

`shardprep run` follows its backfills by counting runs and backfills and reading the newest event id (three
queries: 3-8 ms of CPU each time on the 2-core benchmark machines), and the queue daemon counts runs and
backfills to know when to wake Dagster's daemons (~6-13 ms). Done on a timer (every 0.2 s and every
second), that was ~6% and ~4% of a core for as long as shards downloaded (bench/E2E.md), on a machine
whose cores the downloads keep busy. Those counts live in the run storage's ``runs.db`` and the newest
event id in the event log's ``index.db`` (the per-run databases hold nothing they read), and every write to
either changes its file or, SQLite being in WAL mode there, its ``-wal`` file: their inode, mtime and size,
four stats, ~20 us. So the queries run when these change, and the look can come often (a run's end is seen
within a tick, not a poll period). A reader changes neither: it makes an empty ``-wal`` when it opens the
database and removes it when it closes (Dagster opens a connection per query), so a ``-wal`` without frames
counts as none.

A filesystem stamps mtimes at its clock's tick (a few ms): a second write within the tick of one already
seen would leave the files looking unchanged, so a file written within ``FRESH_NS`` of a look counts as
changed at the next look too. PostgreSQL, or any other storage: ``watch`` gives None, and the caller's
queries on a timer stay the test.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

FRESH_NS = 50_000_000  # far above any filesystem's timestamp tick, far below a human's notice


def sqlite_files(instance) -> dict[str, str] | None:
    """The database files holding an instance's runs, backfills and event index, when it keeps them in
    SQLite (Dagster's default storage under ``$DAGSTER_HOME``): {"runs": path, "index": path}; None otherwise."""
    from dagster._core.storage.event_log.sqlite.sqlite_event_log import INDEX_SHARD_NAME, SqliteEventLogStorage
    from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage

    runs, events = instance.run_storage, instance.event_log_storage
    if not isinstance(runs, SqliteRunStorage) or not isinstance(events, SqliteEventLogStorage):
        return None
    runs_db = urlparse(runs._conn_string).path  # noqa: SLF001 - where from_local put it (base_dir/runs.db)
    if not runs_db.endswith(".db"):  # an in-memory or otherwise unexpected run storage: no file to watch
        return None
    return {"runs": runs_db, "index": events.path_for_shard(INDEX_SHARD_NAME)}


WAL_HEADER = 32  # bytes of a -wal file before its first frame


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _look(db: str) -> tuple:
    """What a write to ``db`` changes: the file (a checkpoint writes it), or its -wal's frames."""
    wal = _stat(db + "-wal")
    return _stat(db), (wal if wal is not None and wal[2] > WAL_HEADER else None)


class StorageWatch:
    """``changed()``: True when one of ``files`` (or its ``-wal``) differs from the previous call's look, or
    had been written within ``FRESH_NS`` of it; the first call is True. ``due()``: whether its owner should
    query now, the changes seen since its last query kept until then."""

    def __init__(self, files: list[str]):
        self.files = files
        self._last: tuple | None = None
        self._fresh = True
        self._pending = True  # changed since the owner's last query (none yet)

    def changed(self) -> bool:
        now = time.time_ns()
        sig = tuple(_look(f) for f in self.files)
        out = self._fresh or sig != self._last
        self._last = sig
        self._fresh = any(s is not None and now - s[1] < FRESH_NS for look in sig for s in look)
        return out

    def due(self, since_query: float, min_interval: float, overdue: bool = False) -> bool:
        """Whether the owner should query now (then it is taken to): the files changed since its last query,
        ``since_query`` seconds ago, and at least ``min_interval`` s have passed (a burst of writes is read
        once, not at every look); or ``overdue``, the owner's own reason (its fallback timer, a wake-up)."""
        self._pending = self.changed() or self._pending
        if overdue or (self._pending and since_query >= min_interval):
            self._pending = False
            return True
        return False


def watch(instance, which: tuple[str, ...] = ("runs", "index")) -> StorageWatch | None:
    """A watch over ``which`` of the instance's SQLite files; None where its storage is not SQLite."""
    files = sqlite_files(instance)
    return None if files is None else StorageWatch([files[w] for w in which])
