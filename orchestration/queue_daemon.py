"""Dagster's backfill and run-queue daemons for an instance that has none running: `shardprep run`
starts this when no `dagster-daemon` (e.g. `make ui`'s) serves the instance. Its backfills are then
turned into runs by Dagster's BackfillDaemon (dependencies, BackfillPolicy batches), queued, and
launched by the QueuedRunCoordinatorDaemon with the instance's run launcher, bounded by the instance's
run and pool limits -- the machinery the UI uses. Sensors, schedules and automation do not run here.

    python -m shardprep_dagster.orchestration.queue_daemon [--idle-seconds 20]

One per instance (an exclusive lock in ``$DAGSTER_HOME``). It exits once the instance has had no
backfill or run in progress for ``--idle-seconds``, so the last shard's run is never cut off by the
process that launched it exiting. Its daemon id is written into the lock file, so a client that finds
the lock free knows that heartbeats with that id are a dead daemon's.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from typing import NamedTuple

import dagster as dg
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus

from shardprep.allocator import collector_paused
from shardprep.storage import pid_alive
from shardprep_dagster.orchestration import code_server, daemon_process, storage_watch
from shardprep_dagster.orchestration.instance import dagster_home, get_instance, import_storage

FINISHED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
ACTIVE_BACKFILLS = [BulkActionStatus.REQUESTED, BulkActionStatus.CANCELING]
HEARTBEAT_SECONDS = 20  # a private daemon's heartbeats (HEARTBEAT_FRESH_SECONDS: 60 s counts as alive)
HEARTBEAT_FRESH_SECONDS = 60  # a daemon's heartbeat (every 30 s by default) younger than this: it is alive
CODE_LOCATION = daemon_process.CODE_LOCATION
CODE_SERVER_START_TIMEOUT = 180  # seconds for the code server to answer (Dagster's default for its own)
CODE_SERVER_HEARTBEAT_TIMEOUT = 20  # seconds; Dagster's for the code servers its daemons start
CODE_SERVER_NAME = "shardprep-code"  # the forked code server's process name (ps, top)
# When Dagster's run-queue and backfill daemons iterate: within a second of a change of the runs' or
# backfills' state (a run queued or finished, a backfill added: the small runs' next stage is not held up,
# dagster#11649), else every BUSY_POLL_SECONDS while work is in flight (a safety net: what a backfill
# waits for changes that state; each asset-backfill pass costs ~0.3-0.6 s of CPU on a 2-core machine, and
# every 15 s they were most of this daemon's ~5% of a core during a 10,000-row shard's download); the state (5 counts, ~6 ms of CPU)
# is read every STATE_POLL_SECONDS then, every IDLE_POLL_SECONDS when nothing is in flight, and within
# WAKE_POLL_SECONDS when a client wakes the daemon (a file's time: a stat). The run-queue daemon also
# looks right after each backfill pass, which may have queued runs: it looked up to a second later, at
# the next read of the state (a chain's first runs: enqueued -> launched 0.5-0.8 s).
BUSY_POLL_SECONDS = 60
IDLE_POLL_SECONDS = 5
STATE_POLL_SECONDS = 1.0
WAKE_POLL_SECONDS = 0.1
# On an embedded instance the state is read when the run storage's files change (``storage_watch``: the
# state is five counts of its runs and backfills), looked at every WAKE_POLL_SECONDS, at most every
# STATE_MIN_SECONDS, and at least every IDLE_POLL_SECONDS: a run's end is seen within a tenth of a second
# instead of a second (the next queued run launched that much sooner), and a shard's download is not
# interrupted every second by reads that find nothing new.
STATE_MIN_SECONDS = 0.25


def lock_path() -> str:
    return daemon_process.lock_path(str(dagster_home()))


def external_daemon(instance: dg.DagsterInstance, dead_id: str) -> bool:
    """A dagster-daemon (not ours: ``dead_id`` is the last private daemon's id) serves the instance."""
    heartbeat = instance.get_daemon_heartbeats().get("BACKFILL")
    return heartbeat is not None and heartbeat.daemon_id != dead_id and \
        time.time() - heartbeat.timestamp < HEARTBEAT_FRESH_SECONDS


def wake_path() -> str:
    return lock_path() + ".wake"


def wake() -> None:
    """Tell an idle daemon of this instance that work was just added (it looks at once, not within
    IDLE_POLL_SECONDS): one file's time, read with a stat a second, instead of two queries a second."""
    with open(wake_path(), "a"):
        os.utime(wake_path())


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0


class _State(NamedTuple):
    in_flight: int
    queued: int
    finished: int
    backfills_active: int
    backfills_canceling: int
    backfills_ever: int


def _state(instance: dg.DagsterInstance) -> _State:
    """Counts of runs and backfills whose change means the daemons have something to do (a run to launch,
    a finished run's downstream to request, a backfill to start). ``queued`` on its own because the
    backfill daemon creates a run (NOT_STARTED, in flight) and enqueues it only after logging its planned
    events, ~1 s later: a look in between poked the run-queue daemon too early, and the enqueue, leaving
    the in-flight count as it was, waited BUSY_POLL_SECONDS (a 2 x 10,000-row chain's first runs started
    15 s after they were queued). ``backfills_ever`` because one added as another completes leaves the
    active count as it was: `shardprep run` launches its unpartitioned assets' backfill just as its
    shards' one ends, which waited as long. ``backfills_canceling`` because a cancellation (REQUESTED ->
    CANCELING) leaves the active count as it was too: the runs it is to terminate ran on to the end of their
    step (a 20-image shard's download went on 10 s after `shardprep run`'s SIGTERM)."""
    return _State(in_flight=instance.get_runs_count(filters=dg.RunsFilter(statuses=IN_FLIGHT)),
                  queued=instance.get_runs_count(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED])),
                  finished=instance.get_runs_count(filters=dg.RunsFilter(statuses=FINISHED)),
                  backfills_active=instance.get_backfills_count(filters=BulkActionsFilter(statuses=ACTIVE_BACKFILLS)),
                  backfills_canceling=instance.get_backfills_count(
                      filters=BulkActionsFilter(statuses=[BulkActionStatus.CANCELING])),
                  backfills_ever=instance.get_backfills_count())


def _until(poke: threading.Event, shutdown_event: threading.Event):
    """A daemon loop's wait for its next iteration: until ``poke`` is set (then cleared), yielding every
    second so the controller sees the thread alive."""
    while not shutdown_event.is_set() and not poke.wait(1):
        yield None
    poke.clear()


def _backfill_daemon(settings, poke: threading.Event, then: threading.Event):
    """Dagster's BackfillDaemon iterating when ``poke``d (see BUSY_POLL_SECONDS) instead of every 30 s;
    ``then`` is set after each pass (the run-queue daemon's poke: the pass may have queued runs)."""
    from dagster._daemon.backfill import execute_backfill_iteration
    from dagster._daemon.daemon import BackfillDaemon, SpanMarker

    class Poked(BackfillDaemon):
        def core_loop(self, workspace_process_context, shutdown_event):
            futures: dict = {}
            while not shutdown_event.is_set():
                yield SpanMarker.START_SPAN
                try:
                    yield from execute_backfill_iteration(workspace_process_context, self._logger,
                                                          threadpool_executor=self._threadpool_executor,
                                                          backfill_futures=futures)
                except Exception:  # noqa: BLE001 - logged by Dagster's own capture, as its loop does
                    from dagster._daemon.utils import DaemonErrorCapture

                    yield DaemonErrorCapture.process_exception(exc_info=sys.exc_info(), logger=self._logger,
                                                               log_message="BackfillDaemon caught an error")
                then.set()
                yield SpanMarker.END_SPAN
                yield from _until(poke, shutdown_event)

    return Poked(settings=settings)


def _run_queue_daemon(poke: threading.Event):
    """Dagster's QueuedRunCoordinatorDaemon, paced as the backfill daemon above."""
    from dagster._daemon.daemon import SpanMarker
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
    from dagster._daemon.utils import DaemonErrorCapture

    class Paced(QueuedRunCoordinatorDaemon):
        def core_loop(self, workspace_process_context, shutdown_event):
            while not shutdown_event.is_set():
                yield SpanMarker.START_SPAN
                try:
                    yield from self.run_iteration(workspace_process_context)
                except Exception:  # noqa: BLE001 - logged as IntervalDaemon's loop does
                    yield DaemonErrorCapture.process_exception(exc_info=sys.exc_info(), logger=self._logger,
                                                               log_message="QueuedRunCoordinatorDaemon caught an error")
                yield SpanMarker.END_SPAN
                yield from _until(poke, shutdown_event)

    return Paced(interval_seconds=1)


def _poke_on_submit(instance: dg.DagsterInstance, poke: threading.Event) -> None:
    """The run-queue daemon looks as soon as a run is queued in this process (the backfill daemon's pass
    queues its runs part way through, then goes on for ~0.5 s on 2 cores: a chain's first runs were launched
    0.5-0.6 s after they were queued, at the end of the pass)."""
    coordinator = instance.run_coordinator
    submit = coordinator.submit_run

    def submit_run(context):
        run = submit(context)
        poke.set()
        return run

    coordinator.submit_run = submit_run


def _monitoring_daemon(interval: float, busy: threading.Event):
    """Dagster's MonitoringDaemon (a run worker that died is marked failed, its pool slots freed) every
    ``interval`` s while runs are in flight (``busy``); idle, it waits for them."""
    from dagster._daemon.daemon import MonitoringDaemon

    class WhileBusy(MonitoringDaemon):
        def run_iteration(self, workspace_process_context):
            while not busy.wait(1):
                yield None  # the controller sees the thread alive
            yield from super().run_iteration(workspace_process_context)

    return WhileBusy(interval_seconds=interval)


def code_location_target():
    """The code location by module name, as every process of the distribution loads it."""
    from dagster._core.workspace.load_target import ModuleTarget

    return ModuleTarget(module_name=CODE_LOCATION, attribute=None, location_name=daemon_process.LOCATION_NAME,
                        working_directory=daemon_process.code_location_dir())


class CodeServer(NamedTuple):
    pid: int
    socket: str


def fork_code_server(lock_fd: int) -> CodeServer | None:
    """``dagster api grpc`` serving the code location on a fresh unix socket, as Dagster's daemon would start
    it (module, working directory, heartbeat), forked from this process once it has imported the code
    location (``daemon_process``); None where that cannot be done safely (a thread is running: a fork would
    inherit whatever lock it holds), and the daemon lets Dagster start its own. ``lock_fd``: the daemon's
    lock, closed in the code server, which must not hold it after the daemon has gone."""
    from shardprep_dagster.orchestration import run_workers

    with collector_paused():  # the code location: what the code server would import, once for both
        importlib.import_module(CODE_LOCATION)
    import_storage()  # and what both import to open the instance (the code server's run workers too)
    if not run_workers.single_threaded():
        return None
    path = os.path.join(tempfile.gettempdir(), f"shardprep-code-{secrets.token_hex(6)}.sock")
    argv = ["dagster", "api", "grpc", "--lazy-load-user-code", "--socket", path, "--heartbeat",
            "--heartbeat-timeout", str(CODE_SERVER_HEARTBEAT_TIMEOUT), "--log-level", "warning",
            "--location-name", daemon_process.LOCATION_NAME, "-m", CODE_LOCATION, "-d", daemon_process.code_location_dir()]

    def serve() -> None:  # (its traceback, if any, goes to the daemon's log)
        os.close(lock_fd)
        run_workers.name_process(CODE_SERVER_NAME)
        sys.argv = argv
        code_server.main()

    pid = run_workers.fork_child(serve)
    print(f"shardprep: code server {pid} ({CODE_SERVER_NAME}) on {path}", flush=True)  # (the daemon's log)
    return CodeServer(pid, path)


def _client(server: CodeServer):
    from dagster._grpc.client import DagsterGrpcClient

    return DagsterGrpcClient(socket=server.socket, host="localhost")


def _server_target(server: CodeServer):
    from dagster._core.workspace.load_target import GrpcServerTarget

    return GrpcServerTarget(host="localhost", port=None, socket=server.socket,
                            location_name=daemon_process.LOCATION_NAME)


def _answers(server: CodeServer) -> bool:
    """Wait for the code server forked from this daemon to answer (it binds its socket once it has opened
    the instance and loaded the code location). False if it died first, or did not answer in time: the
    daemon then starts Dagster's own, as it would have without one."""
    from dagster._core.errors import DagsterUserCodeUnreachableError

    client = _client(server)
    deadline = time.monotonic() + CODE_SERVER_START_TIMEOUT
    while time.monotonic() < deadline and pid_alive(server.pid):
        try:
            client.ping("")
            return True
        except DagsterUserCodeUnreachableError:
            time.sleep(0.05)
    return False


def _keep_alive(server: CodeServer) -> None:
    """The heartbeat the code server expects (it stops itself after CODE_SERVER_HEARTBEAT_TIMEOUT without one)."""
    from dagster._grpc import client as grpc_client

    client = _client(server)
    while True:
        try:
            client.heartbeat("shardprep")
        except Exception:  # noqa: BLE001 - gone or busy: the next beat tries again
            pass
        time.sleep(grpc_client.CLIENT_HEARTBEAT_INTERVAL)


def _stop(server: CodeServer) -> None:
    """Ask the code server to stop once its runs' processes have ended (as Dagster stops its own); one that
    does not answer (still loading: this daemon left at once) is terminated."""
    try:
        _client(server).shutdown_server(timeout=5)
    except Exception:  # noqa: BLE001 - not answering
        if pid_alive(server.pid):
            os.kill(server.pid, signal.SIGTERM)
    try:
        os.unlink(server.socket)
    except OSError:
        pass


# Dagster's own switch (dagster/_core/storage/event_log/base.py): a run logs one "materialization
# planned" event per asset with its partition range, instead of one per (asset, partition). A run over a
# range of 64 blocks of 8 assets otherwise logs 512 events at ~9 ms: the 1% backfill of a 580,000-shard
# dataset took ~7 min to submit, and takes 40 s with it (bench/PARTITIONS.md). What it costs: the UI's
# partition bar no longer shows these runs' partitions as in progress or failed (materialized ones are
# shown as ever); `shardprep status`, the progress bar and each block's per-shard table say it instead.
PLANNED_EVENTS_ENV = "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"


def one_planned_event_per_asset() -> None:
    """Runs created in this process log one planned event per asset (unless the user said otherwise)."""
    os.environ.setdefault(PLANNED_EVENTS_ENV, "1")


def serve(idle_seconds: float) -> int:
    fh = open(lock_path(), "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another process of this instance is the run-queue daemon
    server = fork_code_server(fh.fileno())
    try:
        return _serve(idle_seconds, server, fh)
    finally:
        if server is not None:
            _stop(server)


def _serve(idle_seconds: float, server: CodeServer | None, fh) -> int:
    from dagster._daemon.controller import daemon_controller_from_instance
    from dagster._grpc import client as grpc_client

    fh.seek(0)
    dead_id = fh.read().strip()
    one_planned_event_per_asset()
    instance = get_instance()
    if external_daemon(instance, dead_id):
        return 0  # a dagster-daemon serves the instance (`shardprep run` starts this one before it can tell)
    # the ping that keeps the code server alive (it stops after 20 s without one): every 5 s, not every
    # second (a quarter of this process's idle CPU); a private constant of the pinned Dagster
    grpc_client.CLIENT_HEARTBEAT_INTERVAL = 5

    pokes = [threading.Event(), threading.Event()]  # the run-queue and backfill daemons' next iteration
    busy = threading.Event()  # runs or backfills in flight

    def daemons(inst: dg.DagsterInstance):
        # one backfill evaluated at a time, unless the instance says otherwise: Dagster's pool of threads
        # evaluates them together, but in one process they take turns on the GIL and the event log's lock,
        # so each of `shardprep run`'s backfills queued its run at the end of both evaluations; one at a
        # time, the first run is queued halfway (its first step ~0.1 s sooner, bench/E2E.md)
        backfill_settings = {"num_workers": 1, **inst.get_backfill_settings()}
        out = [_run_queue_daemon(pokes[0]), _backfill_daemon(backfill_settings, pokes[1], pokes[0])]
        if inst.run_monitoring_enabled:
            out.append(_monitoring_daemon(inst.run_monitoring_poll_interval_seconds, busy))
        return out

    _poke_on_submit(instance, pokes[0])
    target = code_location_target()
    if server is not None and _answers(server):
        target = _server_target(server)
        threading.Thread(target=_keep_alive, args=(server,), name="code-server-heartbeat", daemon=True).start()
    with daemon_controller_from_instance(instance, target, gen_daemons=daemons,
                                         heartbeat_interval_seconds=HEARTBEAT_SECONDS,
                                         log_level="warning") as controller:
        fh.seek(0)
        fh.truncate()
        fh.write(controller._daemon_uuid)  # noqa: SLF001 - the id its heartbeats carry
        fh.flush()
        idle_since = last_check = last_poke = time.monotonic()
        woken_at, seen = _mtime(wake_path()), None
        watched = storage_watch.watch(instance, ("runs",))
        busy.set()  # it was started for work
        while True:
            controller.check_daemon_threads()
            now, poked = time.monotonic(), _mtime(wake_path())
            since, woken = now - last_check, poked != woken_at
            if watched is None:
                due = woken or since >= (STATE_POLL_SECONDS if busy.is_set() else IDLE_POLL_SECONDS)
            else:
                due = watched.due(since, STATE_MIN_SECONDS, overdue=woken or since >= IDLE_POLL_SECONDS)
            if due:
                woken_at, last_check = poked, now
                state = _state(instance)
                if state.in_flight or state.backfills_active:
                    busy.set()
                else:
                    busy.clear()
                if state != seen or (busy.is_set() and now - last_poke >= BUSY_POLL_SECONDS):
                    seen, last_poke = state, now
                    for poke in pokes:
                        poke.set()
                if busy.is_set():
                    idle_since = now
                elif now - idle_since > idle_seconds:
                    return 0
            time.sleep(WAKE_POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardprep_dagster.orchestration.queue_daemon", description=__doc__)
    parser.add_argument("--idle-seconds", type=float, default=20.0,
                        help="exit once no run has been queued or in progress this long")
    parser.add_argument("--after-go", action="store_true",
                        help="serve only once 'go' is read from stdin; leave if it closes first (`shardprep run` "
                             "starts the daemon before it has checked the config)")
    args = parser.parse_args(argv)
    if args.after_go and not daemon_process.wait_for_go():
        return 0
    return serve(args.idle_seconds)


if __name__ == "__main__":
    sys.exit(main())
