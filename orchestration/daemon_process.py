"""The private queue daemon's process (``orchestration.queue_daemon``): its lock and its start.

No Dagster import here: `shardprep run` starts the daemon first thing, before its own imports, config
and planning, so the daemon's imports and code server (~3 s) overlap them instead of following them
(the chain benchmark: the first run was enqueued 5.3-5.7 s after the command started, the daemon's first
backfill pass coming 2.7 s after the CLI had launched its backfill; 4.2-4.8 s now). Whether an external dagster-daemon
already serves the instance needs Dagster, so the daemon itself looks and leaves if one does.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

LOCK_NAME = ".shardprep-queue-daemon.lock"

_spawned: dict[str, subprocess.Popen] = {}  # instance root -> the private daemon this process started


def lock_path(home: str) -> str:
    return os.path.join(home, LOCK_NAME)


def running_here(home: str) -> bool:
    """A daemon this process started is alive (it may still be importing, before its lock)."""
    spawned = _spawned.get(home)
    return spawned is not None and spawned.poll() is None


def last_daemon_id(home: str) -> str | None:
    """None while a private daemon holds the lock (it serves the instance); else the id the last one wrote
    ("" if none ever ran): its heartbeats are a dead daemon's."""
    with open(lock_path(home), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        fh.seek(0)
        dead_id = fh.read().strip()
        fcntl.flock(fh, fcntl.LOCK_UN)
    return dead_id


def spawn(home: str) -> subprocess.Popen:
    log = open(os.path.join(home, "shardprep_daemon.log"), "ab")
    _spawned[home] = subprocess.Popen(
        [sys.executable, "-m", "shardprep_dagster.orchestration.queue_daemon"], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, env={**os.environ, "DAGSTER_HOME": home},
        start_new_session=True)  # outlives this process: it finishes the runs it launched
    return _spawned[home]


def start_early(home: str) -> None:
    """Start the daemon unless one of ours already serves ``home`` (a dagster-daemon that does makes it
    leave at once; one that is gone but left its lock free is replaced, as ``launch.ensure_daemon`` does)."""
    if not running_here(home) and last_daemon_id(home) is not None:
        spawn(home)
