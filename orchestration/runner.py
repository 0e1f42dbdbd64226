"""`shardprep run`: register new source rows as shards, find every (asset, shard) that is missing or
outdated (``orchestration.plan``), have Dagster materialize them, and report.

Two ways to execute, one plan:

* queued (the default, ``orchestration.queued``): an asset backfill of exactly those pairs, run by
  Dagster's daemons through the instance's run queue: several shards in flight at once, bounded by the
  instance's run limit and its ``download`` and ``gpu`` pools, like every run the UI or automation starts;
* in process (``--in-process``, ``orchestration.in_process``): one shard after the other in this process
  (debugging, and output roots only this process can see, such as ``memory://``).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
from dataclasses import dataclass, field
from typing import Callable

import dagster as dg
from dagster._core.storage.dagster_run import FINISHED_STATUSES
from dagster._core.storage.tags import GRPC_INFO_TAG

from orchestration.instance import get_instance, instance_lock
from orchestration.plan import current_partitions, global_is_current, todo_by_shard
from resources.dataset import HOST_TAG, PID_TAG, config_url
from shardprep.config import DatasetConfig, load_config
from shardprep.ledger import Registration, register_sources
from shardprep.storage import pid_alive
from shardprep.versions import artifact_versions

SHARD_PARTITIONS = "shards"  # assets.partitions.shard_partitions.name


@dataclass
class RunSummary:
    shards: list[str]
    new_shards: list[str]
    runs: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # shard -> error
    materialized: dict[str, int] = field(default_factory=dict)  # asset -> partitions current
    appended_sources: list[str] = field(default_factory=list)  # registered earlier; new rows became new shards
    empty_sources: list[str] = field(default_factory=list)
    global_assets: list[str] = field(default_factory=list)  # unpartitioned: materialized is 0 or 1
    stopped_by: int | None = None  # the signal that stopped the run (SIGTERM, SIGINT)
    not_run: list[str] = field(default_factory=list)  # shards left for the next run after a stop
    backfills: list[str] = field(default_factory=list)  # queued: the backfills this run launched
    waited_on: list[str] = field(default_factory=list)  # queued: other processes' backfills this run waited for
    shards_settled: int = 0  # storage id of the newest shard materialization when the global step began

    @property
    def ok(self) -> bool:
        return not self.failed and self.stopped_by is None


@dataclass
class Plan:
    """What a run works on: the config, its registered shards, the asset order and what is to do."""

    config_path: str
    cfg: DatasetConfig
    registration: Registration
    defs: dg.Definitions
    versions: dict[str, str]
    shard_keys: list[dg.AssetKey]  # per-shard assets, dependency order
    global_keys: list[dg.AssetKey]  # unpartitioned assets, dependency order
    todo: dict[str, list[dg.AssetKey]]  # shard -> assets missing or outdated
    rebuild: bool = False

    @property
    def shards(self) -> list[str]:
        return self.registration.all_keys

    def todo_shards(self) -> list[str]:
        return [s for s in self.shards if self.rebuild or self.todo[s]]

    def assets_to_do(self, shard: str) -> list[dg.AssetKey]:
        return self.shard_keys if self.rebuild else self.todo[shard]

    def replan(self, instance: dg.DagsterInstance) -> None:
        self.todo = todo_by_shard(instance, self.shard_keys, self.versions, self.shards)


class Stop:
    """SIGTERM and SIGINT stop the run promptly: work in progress is interrupted or cancelled (Dagster
    fails or cancels it and frees its pool slots; atomic writes leave no partial output), and nothing
    further starts.

    While a run executes in this process, Dagster's own handlers turn both signals into an interrupted
    step, so ours never sees them there; the signal numbers are read instead from the wakeup fd that
    Python's C-level handler writes every signal to, whichever Python handler runs."""

    def __init__(self, raise_between: bool = True) -> None:
        self.signum: int | None = None
        self.raise_between = raise_between  # in-process: a signal between runs ends the loop at once

    def _handle(self, signum, frame) -> None:
        self.received()
        if self.signum is None:
            self.signum = signum
            if self.raise_between:
                raise KeyboardInterrupt

    def received(self) -> int | None:
        """The first stop signal received so far (None: none)."""
        try:
            data = os.read(self._read, 512)
        except BlockingIOError:
            data = b""
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT) and self.signum is None:
                self.signum = signum
        return self.signum

    @property
    def reason(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"

    def __enter__(self) -> Stop:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write)
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark runs whose process is gone as failed (cancelled, if they were being cancelled) and give back
    their pool slots, which would otherwise block every later GPU or download step; Dagster's run
    monitoring would notice only after its start timeout (5 minutes), and not at all for in-process runs.

    A run is matched to its process from the moment it is launched: the pid it tagged itself with
    (``resources.dataset``; ``--in-process`` runs from creation), else the pid Dagster's run worker
    logged when it started, else -- launched but not started yet -- the code server asked to start it,
    and before even that, a daemon serving the instance."""
    dead = []
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING,
                                        dg.DagsterRunStatus.CANCELING])
    daemon_alive = functools.cache(lambda: _daemon_alive(instance))
    for run in instance.get_runs(filters=in_flight):
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


def _why_gone(instance: dg.DagsterInstance, run: dg.DagsterRun, daemon_alive: Callable[[], bool]) -> str | None:
    """Why ``run``'s process is known to be gone; None when it is alive or cannot be checked from here
    (another machine's)."""
    host = socket.gethostname()
    if PID_TAG in run.tags:
        pid = int(run.tags[PID_TAG] or 0)
        if run.tags.get(HOST_TAG) != host or not pid or pid == os.getpid() or pid_alive(pid):
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
    from orchestration.launch import daemon_serving

    if getattr(instance, "root_directory", None) is None:
        return True  # an ephemeral instance has no daemon: its runs are in-process ones, tagged
    return daemon_serving(instance) is not None


def register_partitions(instance: dg.DagsterInstance, keys: list[str], chunk: int = 10_000) -> int:
    """Add the shards the instance does not know yet, in chunks (one call with 400,000 keys exceeds
    SQLite's variable limit); idempotent, so a crash in the middle and a re-run leave exactly ``keys``.
    Processes adding the same keys at once lose nothing: a chunk another one added first is re-read."""
    existing = set(instance.get_dynamic_partitions(SHARD_PARTITIONS))
    new = [k for k in keys if k not in existing]
    for i in range(0, len(new), chunk):
        part = new[i:i + chunk]
        try:
            instance.add_dynamic_partitions(SHARD_PARTITIONS, part)
        except Exception:  # noqa: BLE001 - a unique-key race with another process (Postgres, SQLite)
            known = set(instance.get_dynamic_partitions(SHARD_PARTITIONS))
            missing = [k for k in part if k not in known]
            if missing:
                instance.add_dynamic_partitions(SHARD_PARTITIONS, missing)
    return len(new)


def make_plan(config_path: str, instance: dg.DagsterInstance, rebuild: bool = False,
              cfg: DatasetConfig | None = None, registration: Registration | None = None) -> Plan:
    from definitions import build_defs

    cfg = cfg or load_config(config_path)
    reg = registration or register_sources(cfg, config_path=config_path)  # a bad source fails here
    with instance_lock(instance, "partitions"):
        register_partitions(instance, reg.all_keys)
    defs = build_defs(config_path)
    graph = defs.resolve_asset_graph()
    order = graph.toposorted_asset_keys
    shard_keys = [k for k in order if graph.get(k).partitions_def is not None and graph.get(k).is_materializable]
    global_keys = [k for k in order if graph.get(k).partitions_def is None and graph.get(k).is_materializable]
    versions = artifact_versions(cfg)
    plan = Plan(config_path, cfg, reg, defs, versions, shard_keys, global_keys, {}, rebuild)
    plan.replan(instance)
    return plan


def run_pipeline(config_path: str, *, rebuild: bool = False, progress: bool = True,
                 instance: dg.DagsterInstance | None = None, in_process: bool = False) -> RunSummary:
    """Register new source rows, then materialize every (asset, shard) that is missing or outdated and
    the unpartitioned assets after them (queued through Dagster's daemons, or ``in_process``)."""
    config_path = config_url(config_path)
    # a bad config or source is named before the instance is opened (nothing to recover for it)
    cfg = load_config(config_path)
    registration = register_sources(cfg, config_path=config_path)
    instance = instance or get_instance()
    recover_dead_runs(instance)
    plan = make_plan(config_path, instance, rebuild, cfg=cfg, registration=registration)
    summary = RunSummary(plan.shards, plan.registration.new_keys,
                         appended_sources=plan.registration.appended_sources,
                         empty_sources=plan.registration.empty_sources)
    if in_process:
        from orchestration.in_process import execute

        execute(plan, instance, summary, progress)
    else:
        from orchestration.queued import execute

        execute(plan, instance, summary, progress)
    return _finish(plan, instance, summary)


def _finish(plan: Plan, instance: dg.DagsterInstance, summary: RunSummary) -> RunSummary:
    """The summary as the instance has it after the run, whoever materialized what: every (asset, shard)
    not current at its version and every enabled unpartitioned asset not brought up to date after the
    shards is a failure (a stopped run's shards not run are left for the next run instead)."""
    current = {k: current_partitions(instance, k, plan.versions.get(k.path[-1])) for k in plan.shard_keys}
    missing: dict[str, list[str]] = {}
    for k in plan.shard_keys:
        for shard in set(plan.shards) - current[k]:
            missing.setdefault(shard, []).append(k.to_user_string())
    summary.materialized = {k.to_user_string(): len(current[k] & set(plan.shards)) for k in plan.shard_keys}
    others = f" (waited for backfill(s) {', '.join(summary.waited_on)} of another process)" if summary.waited_on else ""
    if summary.stopped_by is not None:
        summary.not_run = sorted(missing)
        # what the cancellation left undone is not a failure: it is left for the next run
        summary.failed = {s: e for s, e in summary.failed.items()
                          if s not in missing or not e.endswith(("not materialized", "cancelled"))}
        return summary
    for shard, assets in sorted(missing.items()):
        summary.failed.setdefault(shard, f"{', '.join(assets)}: not materialized at the current version{others}")
    for k in plan.global_keys:
        name = k.to_user_string()
        ok = global_is_current(instance, k, plan.versions.get(k.path[-1]), summary.shards_settled)
        summary.materialized[name] = int(ok)
        summary.global_assets.append(name)
        if not ok:
            summary.failed.setdefault("(global)", f"{name}: not brought up to date after the shards{others}")
    return summary
