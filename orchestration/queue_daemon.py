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
import os
import sys
import threading
import time

import dagster as dg

from shardprep_dagster.orchestration.instance import dagster_home, get_instance

LOCK_NAME = ".shardprep-queue-daemon.lock"
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
HEARTBEAT_SECONDS = 20  # a private daemon's heartbeats (launch.HEARTBEAT_FRESH_SECONDS: 60 s counts as alive)
CODE_LOCATION = "shardprep_dagster.definitions"  # workspace.yaml's module_name
# How often the backfill daemon iterates: every second while runs or backfills are in flight (a small
# run's next stage is not held up, dagster#11649), every IDLE_POLL_SECONDS otherwise, or at once when a
# client wakes it (``wake``); the idle check runs as often.
IDLE_POLL_SECONDS = 5


def lock_path() -> str:
    return str(dagster_home() / LOCK_NAME)


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


def work_in_flight(instance: dg.DagsterInstance) -> bool:
    from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus

    if instance.get_runs_count(filters=dg.RunsFilter(statuses=IN_FLIGHT)):
        return True
    active = BulkActionsFilter(statuses=[BulkActionStatus.REQUESTED, BulkActionStatus.CANCELING])
    return bool(instance.get_backfills(filters=active, limit=1))


def _backfill_daemon(settings, busy):
    """Dagster's BackfillDaemon iterating every second while ``busy`` (an Event: work in flight) instead
    of every 30 s: stage transitions of a small run are not held up by the daemon's sleep
    (dagster#11649); every IDLE_POLL_SECONDS while nothing is in flight."""
    from dagster._daemon.backfill import execute_backfill_iteration
    from dagster._daemon.daemon import BackfillDaemon, SpanMarker

    class EverySecond(BackfillDaemon):
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
                yield SpanMarker.END_SPAN
                busy.wait(IDLE_POLL_SECONDS)  # returns at once while busy; else when work appears
                shutdown_event.wait(1)
                yield None

    return EverySecond(settings=settings)


def _run_queue_daemon(busy):
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
                busy.wait(IDLE_POLL_SECONDS)
                shutdown_event.wait(1)
                yield None

    return Paced(interval_seconds=1)


def code_location_target():
    """The code location by module name, as every process of the distribution loads it."""
    import importlib.util

    from dagster._core.workspace.load_target import ModuleTarget

    origin = importlib.util.find_spec(CODE_LOCATION).origin  # found, not imported (that builds the graph)
    return ModuleTarget(module_name=CODE_LOCATION, attribute=None, location_name="shardprep",
                        working_directory=os.path.dirname(os.path.abspath(origin)))


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
    from dagster._daemon.controller import daemon_controller_from_instance
    from dagster._daemon.daemon import MonitoringDaemon
    from dagster._grpc import client as grpc_client

    fh = open(lock_path(), "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another process of this instance is the run-queue daemon
    one_planned_event_per_asset()
    instance = get_instance()
    # the ping that keeps the code server alive (it stops after 20 s without one): every 5 s, not every
    # second (a quarter of this process's idle CPU); a private constant of the pinned Dagster
    grpc_client.CLIENT_HEARTBEAT_INTERVAL = 5

    busy = threading.Event()  # set while runs or backfills are in flight (the loop below decides)
    busy.set()  # it was started for work

    def daemons(inst: dg.DagsterInstance):
        out = [_run_queue_daemon(busy), _backfill_daemon(inst.get_backfill_settings(), busy)]
        if inst.run_monitoring_enabled:  # a run worker that died is marked failed, its pool slots freed
            out.append(MonitoringDaemon(interval_seconds=inst.run_monitoring_poll_interval_seconds))
        return out

    with daemon_controller_from_instance(instance, code_location_target(), gen_daemons=daemons,
                                         heartbeat_interval_seconds=HEARTBEAT_SECONDS,
                                         log_level="warning") as controller:
        fh.seek(0)
        fh.truncate()
        fh.write(controller._daemon_uuid)  # noqa: SLF001 - the id its heartbeats carry
        fh.flush()
        idle_since = last_check = time.monotonic()
        woken_at = _mtime(wake_path())
        while True:
            controller.check_daemon_threads()
            now, poked = time.monotonic(), _mtime(wake_path())
            if busy.is_set() or poked != woken_at or now - last_check >= IDLE_POLL_SECONDS:
                woken_at, last_check = poked, now
                if work_in_flight(instance):
                    busy.set()
                    idle_since = now
                elif now - idle_since > idle_seconds:
                    return 0
                else:
                    busy.clear()
            time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardprep_dagster.orchestration.queue_daemon", description=__doc__)
    parser.add_argument("--idle-seconds", type=float, default=20.0,
                        help="exit once no run has been queued or in progress this long")
    args = parser.parse_args(argv)
    return serve(args.idle_seconds)


if __name__ == "__main__":
    sys.exit(main())
