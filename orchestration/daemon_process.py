"""The private queue daemon's process (``orchestration.queue_daemon``): its lock and its start.

No Dagster import here: `shardprep run` starts the daemon first thing, before its own imports, config
and planning, so the daemon's imports overlap them instead of following them (the chain benchmark: the
first run was enqueued 5.3-5.7 s after the command started, the daemon's first backfill pass coming 2.7 s
after the CLI had launched its backfill; 4.2-4.8 s then). Whether an external dagster-daemon already
serves the instance needs Dagster, so the daemon itself looks and leaves if one does.

The daemon's code server is a fork of the daemon (``queue_daemon.fork_code_server``), made once the daemon
has imported the code location and before it starts a thread: Dagster's daemon would start one only once
it had imported Dagster and opened the instance, and then the code server imported Dagster and the code
location all over again. Started beside the daemon as a process of its own, that was three interpreters
importing Dagster at once on 2 cores, and the code server, the last to be ready, held up the first run
(bench/E2E.md).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys

LOCK_NAME = ".shardprep-queue-daemon.lock"
CODE_LOCATION = "shardprep_dagster.definitions"  # workspace.yaml's module_name
LOCATION_NAME = "shardprep"

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


def code_location_dir() -> str:
    """The code location's working directory (where its module lies), as Dagster is given it."""
    origin = importlib.util.find_spec(CODE_LOCATION).origin  # found, not imported (that builds the graph)
    return os.path.dirname(os.path.abspath(origin))


def start_early(home: str) -> None:
    """Start the daemon unless one of ours already serves ``home`` (a dagster-daemon that does makes it
    leave at once; one that is gone but left its lock free is replaced, as ``launch.ensure_daemon`` does)."""
    if not running_here(home) and last_daemon_id(home) is not None:
        spawn(home)
