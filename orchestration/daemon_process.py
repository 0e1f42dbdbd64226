"""The private queue daemon's process (``orchestration.queue_daemon``): its lock and its start.

No Dagster import here: `shardprep run` starts the daemon first thing, before its own imports, config
and planning, so the daemon's imports and code server (~3 s) overlap them instead of following them
(the chain benchmark: the first run was enqueued 5.3-5.7 s after the command started, the daemon's first
backfill pass coming 2.7 s after the CLI had launched its backfill; 4.2-4.8 s now). Whether an external dagster-daemon
already serves the instance needs Dagster, so the daemon itself looks and leaves if one does.

The daemon's code server is started here too, beside the daemon rather than by it: Dagster's daemon
starts one only once it has imported Dagster and opened the instance, so the code location's load came
after both (on the slower benchmark machine the code server started 3.8 s after the daemon, loaded for
3.5 s, and the first run waited for it). The daemon is given its socket, waits until it answers, keeps it
alive (its heartbeat) and stops it when it exits; a daemon that dies leaves it to stop by itself once
``CODE_SERVER_HEARTBEAT_TIMEOUT`` passes without a heartbeat, as Dagster's own would.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import secrets
import subprocess
import sys
import tempfile
from typing import NamedTuple

LOCK_NAME = ".shardprep-queue-daemon.lock"
CODE_LOCATION = "shardprep_dagster.definitions"  # workspace.yaml's module_name
LOCATION_NAME = "shardprep"
CODE_SERVER_ENV = "SHARDPREP_CODE_SERVER"  # "<pid>:<socket path>" of the code server started beside the daemon
CODE_SERVER_HEARTBEAT_TIMEOUT = 20  # seconds; Dagster's for the code servers its daemons start

_spawned: dict[str, subprocess.Popen] = {}  # instance root -> the private daemon this process started
_code_servers: dict[str, "CodeServer"] = {}  # instance root -> the code server started beside it


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


class CodeServer(NamedTuple):
    pid: int
    socket: str


def spawn(home: str) -> subprocess.Popen:
    log = open(os.path.join(home, "shardprep_daemon.log"), "ab")
    env = {**os.environ, "DAGSTER_HOME": home}
    server = _code_servers[home] = start_code_server(env, log)
    _spawned[home] = subprocess.Popen(
        [sys.executable, "-m", "shardprep_dagster.orchestration.queue_daemon"], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, env={**env, CODE_SERVER_ENV: f"{server.pid}:{server.socket}"},
        start_new_session=True)  # outlives this process: it finishes the runs it launched
    return _spawned[home]


def start_code_server(env: dict[str, str], log) -> CodeServer:
    """``dagster api grpc`` serving the code location on a fresh unix socket, as Dagster's daemon would
    start it (module, working directory, heartbeat), in a session of its own like the daemon's; through
    ``orchestration.code_server``, which makes a fresh instance first."""
    path = os.path.join(tempfile.gettempdir(), f"shardprep-code-{secrets.token_hex(6)}.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardprep_dagster.orchestration.code_server", "api", "grpc", "--lazy-load-user-code", "--socket", path,
         "--heartbeat", "--heartbeat-timeout", str(CODE_SERVER_HEARTBEAT_TIMEOUT), "--log-level", "warning",
         "--location-name", LOCATION_NAME, "-m", CODE_LOCATION,
         "-d", code_location_dir()],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return CodeServer(proc.pid, path)


def code_location_dir() -> str:
    """The code location's working directory (where its module lies), as Dagster is given it."""
    origin = importlib.util.find_spec(CODE_LOCATION).origin  # found, not imported (that builds the graph)
    return os.path.dirname(os.path.abspath(origin))


def given_code_server() -> CodeServer | None:
    """In the daemon: the code server started beside it (``spawn``), if any."""
    pid, _, path = os.environ.get(CODE_SERVER_ENV, "").partition(":")
    return CodeServer(int(pid), path) if pid.isdigit() and path else None


def start_early(home: str) -> None:
    """Start the daemon unless one of ours already serves ``home`` (a dagster-daemon that does makes it
    leave at once; one that is gone but left its lock free is replaced, as ``launch.ensure_daemon`` does)."""
    if not running_here(home) and last_daemon_id(home) is not None:
        spawn(home)
