"""The private queue daemon's process (``orchestration.queue_daemon``): its lock and its start.

No Dagster import here: `shardprep run` starts the daemon first thing, before its own imports, config
and planning, so the daemon's imports overlap them instead of following them (the chain benchmark: the
first run was enqueued 5.3-5.7 s after the command started, the daemon's first backfill pass coming 2.7 s
after the CLI had launched its backfill; 4.2-4.8 s then). Whether an external dagster-daemon already
serves the instance needs Dagster, so the daemon itself looks and leaves if one does. The config is checked
beside the daemon's imports too: the daemon waits for the CLI's go before it touches the instance, and
leaves without one (``spawn``'s ``wait_for_go``), so a bad config makes no instance.

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
GO = b"go\n"  # what `shardprep run` tells a daemon it started before checking the config (``wait_for_go``)

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


def log_path(home: str) -> str:
    return os.path.join(home, "shardprep_daemon.log")


def spawn(home: str, wait_for_go: bool = False) -> subprocess.Popen:
    """The daemon of ``home``, in a session of its own: it outlives this process and finishes the runs it
    launched. ``wait_for_go``: started before the config is checked, when ``home`` may not exist yet; it
    imports, then waits for ``release`` (``wait_for_go`` below) before it touches ``home``."""
    command = [sys.executable, "-m", "shardprep_dagster.orchestration.queue_daemon"]
    env = {**os.environ, "DAGSTER_HOME": home}
    if wait_for_go:
        # no output before the go: this process's stdout may be a pipe its caller reads to the end
        _spawned[home] = subprocess.Popen([*command, "--after-go"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    else:
        with open(log_path(home), "ab") as log:
            _spawned[home] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True)
    return _spawned[home]


def release(daemon: subprocess.Popen | None, go: bool) -> None:
    """Let a daemon spawned ``wait_for_go`` serve its instance (``go``), or leave without touching it."""
    if daemon is None or daemon.stdin is None or daemon.stdin.closed:
        return
    try:
        if go:
            daemon.stdin.write(GO)
        daemon.stdin.close()
    except OSError:  # it has gone already (launch.ensure_daemon starts another)
        pass


def wait_for_go() -> bool:
    """In a daemon spawned ``wait_for_go``: True once its starter says go (its output then goes to the
    instance's daemon log, which exists by then), False when the starter closed the pipe without it."""
    line = sys.stdin.buffer.readline()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the pipe is not the code server's or the runs' to inherit
    os.close(devnull)
    if line != GO:
        return False
    log = os.open(log_path(os.environ["DAGSTER_HOME"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return True


def code_location_dir() -> str:
    """The code location's working directory (where its module lies), as Dagster is given it."""
    origin = importlib.util.find_spec(CODE_LOCATION).origin  # found, not imported (that builds the graph)
    return os.path.dirname(os.path.abspath(origin))


def start_early(home: str, wait_for_go: bool = False) -> subprocess.Popen | None:
    """Start the daemon unless one of ours already serves ``home`` (a dagster-daemon that does makes it
    leave at once; one that is gone but left its lock free is replaced, as ``launch.ensure_daemon`` does).
    A ``home`` not made yet has no daemon (``wait_for_go`` only: see ``spawn``). The daemon started, if any."""
    if running_here(home):
        return None
    if (wait_for_go and not os.path.isdir(home)) or last_daemon_id(home) is not None:
        return spawn(home, wait_for_go)
    return None
