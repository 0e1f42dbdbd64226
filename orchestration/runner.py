"""`shardprep run`: register shards for every source file, then materialize every missing
(asset, shard) through Dagster, recorded in the instance at $DAGSTER_HOME."""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass, field

import dagster as dg

from orchestration.instance import get_instance
from orchestration.plan import current_partitions, latest_version, outdated_globals, todo_by_shard
from shardprep.config import load_config
from shardprep.ledger import register_sources
from shardprep.storage import pid_alive
from shardprep.versions import artifact_versions

SHARD_PARTITIONS = "shards"  # assets.partitions.shard_partitions.name

QUIET_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
PID_TAG, HOST_TAG = "shardprep/pid", "shardprep/host"


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark runs of `shardprep run` processes that died (killed, machine crash) as failed and give back
    their pool slots, which would otherwise block every later GPU or download step."""
    host = socket.gethostname()
    dead = []
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING],
                              tags={HOST_TAG: host})
    for run in instance.get_runs(filters=in_flight):
        pid = int(run.tags.get(PID_TAG, "0"))
        if pid and pid != os.getpid() and not pid_alive(pid):
            instance.report_run_failed(run, f"the shardprep process {pid} running it is gone")
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            dead.append(run.run_id)
    return dead


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

    @property
    def ok(self) -> bool:
        return not self.failed and self.stopped_by is None


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            err = event.step_failure_data.error
            return f"{event.step_key}: {err.message.strip().splitlines()[0]}"
    return "run failed"


class _Stop:
    """SIGTERM and SIGINT stop the run promptly: the step in progress is interrupted (Dagster fails it
    and frees its pool slots; atomic writes leave no partial output), its run is marked cancelled,
    and no further shard starts.

    While a run executes, Dagster's own handlers turn both signals into an interrupted step, so ours
    never sees them there; the signal numbers are read instead from the wakeup fd that Python's C-level
    handler writes every signal to, whichever Python handler runs."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum, frame) -> None:
        self.received()
        if self.signum is None:
            self.signum = signum
            raise KeyboardInterrupt  # between runs: stop the loop

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

    def __enter__(self) -> _Stop:
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


def _register_partitions(instance: dg.DagsterInstance, keys: list[str], chunk: int = 10_000) -> None:
    """Add new shard partitions in chunks: one call with 400,000 keys exceeds SQLite's variable limit."""
    existing = set(instance.get_dynamic_partitions(SHARD_PARTITIONS))
    new = [k for k in keys if k not in existing]
    for i in range(0, len(new), chunk):
        instance.add_dynamic_partitions(SHARD_PARTITIONS, new[i:i + chunk])


def run_pipeline(config_path: str, *, rebuild: bool = False, progress: bool = True,
                 instance: dg.DagsterInstance | None = None) -> RunSummary:
    """Register new source rows, then materialize every (asset, shard) that is missing or outdated
    (``orchestration.plan``), one run per shard, then the unpartitioned assets in one run."""
    from definitions import build_defs

    config_path = os.path.abspath(config_path)
    cfg = load_config(config_path)
    reg = register_sources(cfg, config_path=config_path)  # a bad source fails here, before anything runs
    instance = instance or get_instance()
    recover_dead_runs(instance)
    _register_partitions(instance, reg.all_keys)

    defs = build_defs(config_path)
    versions = artifact_versions(cfg)
    job = defs.resolve_job_def("shards_job")
    graph_order = defs.resolve_asset_graph().toposorted_asset_keys
    order = [k for k in graph_order if k in job.asset_layer.selected_asset_keys]
    todo_assets = todo_by_shard(instance, order, versions, reg.all_keys)
    summary = RunSummary(reg.all_keys, reg.new_keys, appended_sources=reg.appended_sources,
                         empty_sources=reg.empty_sources)
    todo = [s for s in reg.all_keys if rebuild or todo_assets[s]]
    tags = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}

    from tqdm import tqdm

    bar = tqdm(todo, desc="shards", unit="shard", disable=not progress, file=sys.stderr)
    with _Stop() as stop:
        try:
            for shard in bar:
                selection = order if rebuild else todo_assets[shard]
                run_config = dict(QUIET_RUN_CONFIG)
                if rebuild:
                    run_config["ops"] = {k.to_python_identifier(): {"config": {"rebuild": True}} for k in selection}
                result = job.execute_in_process(partition_key=shard, instance=instance, asset_selection=selection,
                                                run_config=run_config, raise_on_error=False, tags=tags)
                summary.runs += 1
                if stop.received() is not None:
                    instance.report_run_canceled(result.dagster_run, f"stopped by {signal.Signals(stop.signum).name}")
                    break
                if not result.success:
                    summary.failed[shard] = _failure_message(result)
                bar.set_postfix(failed=len(summary.failed))
            # the unpartitioned outputs (balanced tars, wdinfo, precache, energon indexes) catch up in one run
            global_jobdef = defs.resolve_job_def("global_job")
            global_keys = [k for k in graph_order if k in global_jobdef.asset_layer.selected_asset_keys]
            if stop.received() is None and (summary.runs or rebuild or outdated_globals(instance, global_keys, versions)):
                bar.write("updating balanced tars, wdinfo, precached encodings and energon indexes ...")
                result = global_jobdef.execute_in_process(instance=instance, run_config=QUIET_RUN_CONFIG,
                                                          raise_on_error=False, tags=tags)
                summary.runs += 1
                if stop.received() is not None:
                    instance.report_run_canceled(result.dagster_run, f"stopped by {signal.Signals(stop.signum).name}")
                elif not result.success:
                    summary.failed["(global)"] = _failure_message(result)
        except KeyboardInterrupt:  # a signal between two runs: nothing of ours was in flight
            pass
    if stop.signum is not None:
        summary.stopped_by = stop.signum
        done = set(current_partitions(instance, order[-1], versions.get(order[-1].path[-1]))) if order else set()
        summary.not_run = [s for s in todo if s not in done]
    summary.materialized = {k.to_user_string(): len(current_partitions(instance, k, versions.get(k.path[-1])))
                            for k in order}
    for k in global_keys if stop.signum is None else []:
        summary.materialized[k.to_user_string()] = int(latest_version(instance, k) == versions.get(k.path[-1]))
        summary.global_assets.append(k.to_user_string())
    return summary
