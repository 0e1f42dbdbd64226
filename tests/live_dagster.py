"""A real Dagster webserver + daemon (``dagster dev -w workspace.yaml``) for tests, on 127.0.0.1.

``start_live_dagster(home, config_path)`` copies the repo's dagster.yaml into a fresh DAGSTER_HOME,
sets the shardprep pool limits, starts ``dagster dev`` in its own session (setsid) on a free port,
and waits until the code location is LOADED and the daemons are healthy. Every wait is bounded and a
timeout fails with the webserver/daemon log tail. ``stop()`` kills the whole process group (run
workers included: Dagster starts them in the same group); a watchdog leading the group does the same
if the test process dies without tearing down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

CHECKOUT = Path(__file__).resolve().parent.parent
LOCATION = "shardprep"
# daemons the shardprep tests rely on: sensors, declarative automation, backfills, the run queue
NEEDED_DAEMONS = ("SENSOR", "ASSET", "BACKFILL", "QUEUED_RUN_COORDINATOR")

T = TypeVar("T")


class LiveDagsterError(AssertionError):
    """The live Dagster did not do what a test waited for (message carries the log tail)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveDagster:
    url: str
    home: Path
    log_path: Path
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def fail(self, message: str) -> LiveDagsterError:
        return LiveDagsterError(f"{message}\n--- dagster dev log tail ({self.log_path}) ---\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def graphql(self, query: str, variables: dict[str, Any] | None = None, timeout: float = 60) -> dict:
        """POST a query to /graphql; returns ``data``. GraphQL errors raise with the messages."""
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise self.fail(f"GraphQL HTTP {e.code}: {e.read()[:2000]!r}") from None
        if payload.get("errors"):
            raise self.fail(f"GraphQL errors: {json.dumps(payload['errors'])[:3000]}")
        return payload["data"]

    def wait_for(self, what: str, probe: Callable[[], T], timeout: float, interval: float = 1.0) -> T:
        """Call ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            if not self.alive():
                raise self.fail(f"dagster dev exited (code {self.proc.returncode}) while waiting for {what}")
            try:
                value = probe()
                if value:
                    return value
                last_error = None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last_error = e  # the server is still starting (or busy): try again
            if time.monotonic() >= deadline:
                extra = f" (last error: {last_error!r})" if last_error else ""
                raise self.fail(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
            time.sleep(interval)

    def stop(self) -> None:
        stop_process_group(self.proc)


def stop_process_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """SIGTERM the process's whole group, then SIGKILL whatever is left (dagster dev's children can
    inherit signal masks that make them ignore SIGTERM)."""
    pgid = proc.pid  # the group leader: started with start_new_session
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_members(pgid):
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            else:
                time.sleep(0.2)
        if not group_members(pgid):
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def prepare_home(home: Path, pool_limits: dict[str, int] | None = None) -> Path:
    """A DAGSTER_HOME with the repo's dagster.yaml and shardprep's pool limits (gpu, download), as
    ``orchestration.instance.apply_pool_limits`` sets them; ``pool_limits`` overrides some."""
    import dagster as dg

    sys.path.insert(0, str(CHECKOUT))
    from orchestration.instance import apply_pool_limits

    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(CHECKOUT / "dagster.yaml", home / "dagster.yaml")
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        apply_pool_limits(instance)
        for pool, slots in (pool_limits or {}).items():
            instance.event_log_storage.set_concurrency_slots(pool, slots)
    finally:
        instance.dispose()
    return home


# Runs as the group leader: starts dagster dev, and kills the whole group when the test process is gone
# (killed by a timeout or a signal, so its fixtures never tore anything down) or dagster dev exited.
WATCHDOG = """
import os, signal, subprocess, sys, time
parent, child = int(sys.argv[1]), subprocess.Popen(sys.argv[2:])
while child.poll() is None and os.getppid() == parent:
    time.sleep(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.killpg(0, signal.SIGTERM)
time.sleep(3)
os.killpg(0, signal.SIGKILL)
"""

LOCATION_STATUS = """
query { workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message stack } } } } } }"""

DAEMON_HEALTH = """
query { instance { daemonHealth { allDaemonStatuses { daemonType required healthy } } } }"""


def start_live_dagster(home: Path, config_path: str, env: dict[str, str] | None = None,
                       timeout: float = 180) -> LiveDagster:
    """``dagster dev -w workspace.yaml`` over ``home`` with SHARDPREP_CONFIG=config_path (``home`` gets
    the repo's dagster.yaml and pool limits here unless ``prepare_home`` already gave it one)."""
    if not (home / "dagster.yaml").exists():
        prepare_home(home)
    port = free_port()
    run_env = {**os.environ, "DAGSTER_HOME": str(home), "SHARDPREP_CONFIG": str(config_path),
               "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = home / "dagster_dev.log"
    dagster = Path(sys.executable).parent / "dagster"
    cmd = [str(dagster), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]
    with open(log_path, "wb") as log:
        # setsid (own session and group), under a watchdog that kills the group if the test process dies
        proc = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), *cmd], cwd=CHECKOUT,
                                env=run_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    live = LiveDagster(url=f"http://127.0.0.1:{port}", home=home, log_path=log_path, proc=proc, env=run_env)
    try:
        deadline = time.monotonic() + timeout
        live.wait_for("the webserver's /server_info", lambda: _server_info(live), timeout)
        live.wait_for(f"code location {LOCATION!r} LOADED", lambda: _location_loaded(live),
                      max(5.0, deadline - time.monotonic()))
        live.wait_for(f"healthy daemons {NEEDED_DAEMONS}", lambda: _daemons_healthy(live),
                      max(5.0, deadline - time.monotonic()))
    except BaseException:
        live.stop()
        raise
    return live


def _server_info(live: LiveDagster) -> dict:
    with urllib.request.urlopen(f"{live.url}/server_info", timeout=10) as resp:
        return json.loads(resp.read())


def _location_loaded(live: LiveDagster) -> bool:
    data = live.graphql(LOCATION_STATUS)["workspaceOrError"]
    if data["__typename"] != "Workspace":
        return False
    for entry in data["locationEntries"]:
        if entry["name"] != LOCATION:
            continue
        err = entry["locationOrLoadError"]
        if err and err["__typename"] == "PythonError":  # fail at once: waiting will not fix it
            raise live.fail(f"code location {LOCATION!r} failed to load: {err['message']}\n{''.join(err['stack'])}")
        return entry["loadStatus"] == "LOADED" and err is not None
    return False


def _daemons_healthy(live: LiveDagster) -> bool:
    statuses = live.graphql(DAEMON_HEALTH)["instance"]["daemonHealth"]["allDaemonStatuses"]
    healthy = {s["daemonType"] for s in statuses if s["healthy"]}
    return all(d in healthy for d in NEEDED_DAEMONS)
