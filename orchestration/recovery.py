"""Runs whose process is gone, found and closed: a killed `shardprep run`, run worker, code server or
daemon must not hold its runs "in progress", its backfill or its pool slots."""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from typing import Callable

import dagster as dg
from dagster._core.storage.dagster_run import FINISHED_STATUSES
from dagster._core.storage.tags import GRPC_INFO_TAG

from shardprep.storage import pid_alive
from shardprep_dagster.resources.dataset import HOST_TAG, PID_TAG


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark runs whose process is gone as failed (cancelled, if they were being cancelled) and give back
    their pool slots, which would otherwise block every later GPU or download step; Dagster's run
    monitoring would notice only after its start timeout (5 minutes), and not at all for in-process runs.

    A run is matched to its process from the moment it is launched: the pid it tagged itself with
    (``resources.dataset``; ``--in-process`` runs from creation), else the pid Dagster's run worker
    logged when it started, else -- launched but not started yet -- the code server asked to start it,
    and before even that, a daemon serving the instance."""
    dead = []
    # (NOT_STARTED: a run this process or another created to execute itself, killed before it started)
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTED,
                                        dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING])
    daemon_alive = functools.cache(lambda: _daemon_alive(instance))
    runs = instance.get_runs(filters=in_flight)
    for run_id in set(_first_seen_gone) - {run.run_id for run in runs}:  # closed since: by us or its code server
        del _first_seen_gone[run_id]
    for run in runs:
        if run.status == dg.DagsterRunStatus.NOT_STARTED and PID_TAG not in run.tags:
            continue  # someone else's (a launcher's, the UI's): not ours to judge before it starts
        why = _why_gone(instance, run, daemon_alive)
        if why is None:
            continue
        if run.status == dg.DagsterRunStatus.CANCELING:
            instance.report_run_canceled(run, f"{why}: cancelled")
        else:
            instance.report_run_failed(run, why)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        dead.append(run.run_id)
    # a run whose worker was killed is marked failed by its code server, but the slot its step held stays
    # claimed (Dagster frees such slots only after free_slots_after_run_end_seconds, in the daemon)
    holders = instance.event_log_storage.get_concurrency_run_ids()
    if holders:
        for run in instance.get_runs(filters=dg.RunsFilter(run_ids=list(holders), statuses=list(FINISHED_STATUSES))):
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
    return dead


LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0")
# A run worker's code server notices its death within its cleanup tick (0.5 s) and records how it died
# ("terminated by signal 9 (SIGKILL)"), which `shardprep run` reports; closing the run before it does loses
# that. So a live code server's dead worker is left to it this long after we first see the death.
CODE_SERVER_GRACE_SECONDS = 5.0
_first_seen_gone: dict[str, float] = {}  # run id -> time.monotonic() when this process first saw it gone


def _why_gone(instance: dg.DagsterInstance, run: dg.DagsterRun, daemon_alive: Callable[[], bool]) -> str | None:
    """Why ``run``'s process is known to be gone; None when it is alive or cannot be checked from here
    (another machine's)."""
    host = socket.gethostname()
    if PID_TAG in run.tags:
        pid = int(run.tags[PID_TAG] or 0)
        if run.tags.get(HOST_TAG) != host or not pid or pid == os.getpid() or pid_alive(pid):
            return None
        if GRPC_INFO_TAG in run.tags and _answers(json.loads(run.tags[GRPC_INFO_TAG])):
            seen = _first_seen_gone.setdefault(run.run_id, time.monotonic())
            if time.monotonic() - seen < CODE_SERVER_GRACE_SECONDS:
                return None
        return f"the shardprep process {pid} running it is gone"
    if GRPC_INFO_TAG not in run.tags:  # dequeued, not handed to a code server yet: the daemon launches it
        return None if daemon_alive() else "the daemon that was launching it is gone"
    server = json.loads(run.tags[GRPC_INFO_TAG])
    pid = _started_pid(instance, run) if "socket" in server or server.get("host") in (*LOCAL_HOSTS, host) else None
    if pid is not None:
        return None if pid_alive(pid) else f"its run worker (pid {pid}) is gone"
    return None if _answers(server) else "the code server that was starting it is gone"


def _started_pid(instance: dg.DagsterInstance, run: dg.DagsterRun) -> int | None:
    """The pid Dagster's run worker logs as it starts ("Started process for run (pid: ...)")."""
    from dagster._core.events import DagsterEventType

    records = instance.get_records_for_run(run.run_id, of_type=DagsterEventType.ENGINE_EVENT, limit=50).records
    for record in records:
        data = record.event_log_entry.dagster_event.engine_event_data
        pid = data.metadata.get("pid") if data is not None else None
        if pid is not None and (record.event_log_entry.message or "").startswith("Started process for run"):
            return int(pid.value)
    return None


def _answers(server: dict) -> bool:
    """Whether something still listens where the code server did (a unix socket or a TCP port)."""
    try:
        if "socket" in server:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(server["socket"])
        else:
            with socket.create_connection((server.get("host") or "localhost", int(server["port"])), timeout=2):
                pass
    except OSError:
        return False
    return True


def _daemon_alive(instance: dg.DagsterInstance) -> bool:
    from shardprep_dagster.orchestration.launch import daemon_serving

    if getattr(instance, "root_directory", None) is None:
        return True  # an ephemeral instance has no daemon: its runs are in-process ones, tagged
    return daemon_serving(instance) is not None
