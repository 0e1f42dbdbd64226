"""`shardprep run`: register shards for every source file, then materialize every missing
(asset, shard) through Dagster, recorded in the instance at $DAGSTER_HOME."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field

import dagster as dg

from orchestration.instance import get_instance
from shardprep.config import load_config
from shardprep.ledger import register_sources

QUIET_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
PID_TAG, HOST_TAG = "shardprep/pid", "shardprep/host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark runs of `shardprep run` processes that died (killed, machine crash) as failed and give back
    their pool slots, which would otherwise block every later GPU or download step."""
    host = socket.gethostname()
    dead = []
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING],
                              tags={HOST_TAG: host})
    for run in instance.get_runs(filters=in_flight):
        pid = int(run.tags.get(PID_TAG, "0"))
        if pid and pid != os.getpid() and not _alive(pid):
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
    materialized: dict[str, int] = field(default_factory=dict)  # asset -> partitions materialized
    changed_sources: list[str] = field(default_factory=list)
    empty_sources: list[str] = field(default_factory=list)
    global_assets: list[str] = field(default_factory=list)  # unpartitioned: materialized is 0 or 1

    @property
    def ok(self) -> bool:
        return not self.failed


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            err = event.step_failure_data.error
            return f"{event.step_key}: {err.message.strip().splitlines()[0]}"
    return "run failed"


def missing_by_shard(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey],
                     shards: list[str]) -> dict[str, list[dg.AssetKey]]:
    done = {k: instance.get_materialized_partitions(k) for k in asset_keys}
    return {s: [k for k in asset_keys if s not in done[k]] for s in shards}


def run_pipeline(config_path: str, *, rebuild: bool = False, progress: bool = True,
                 instance: dg.DagsterInstance | None = None) -> RunSummary:
    from assets import shard_partitions
    from definitions import build_defs

    config_path = os.path.abspath(config_path)
    cfg = load_config(config_path)
    reg = register_sources(cfg)  # a bad source fails here, before anything is recorded
    instance = instance or get_instance()
    recover_dead_runs(instance)
    existing = set(instance.get_dynamic_partitions(shard_partitions.name))
    to_add = [k for k in reg.all_keys if k not in existing]
    if to_add:
        instance.add_dynamic_partitions(shard_partitions.name, to_add)

    defs = build_defs(config_path)
    job = defs.resolve_job_def("shards_job")
    graph_order = defs.resolve_asset_graph().toposorted_asset_keys
    order = [k for k in graph_order if k in job.asset_layer.selected_asset_keys]
    missing = missing_by_shard(instance, order, reg.all_keys)
    summary = RunSummary(reg.all_keys, reg.new_keys, changed_sources=reg.changed_sources,
                         empty_sources=reg.empty_sources)
    todo = [s for s in reg.all_keys if rebuild or missing[s]]

    from tqdm import tqdm

    bar = tqdm(todo, desc="shards", unit="shard", disable=not progress, file=sys.stderr)
    for shard in bar:
        selection = order if rebuild else missing[shard]
        run_config = dict(QUIET_RUN_CONFIG)
        if rebuild:
            run_config["ops"] = {k.to_python_identifier(): {"config": {"rebuild": True}} for k in selection}
        result = job.execute_in_process(partition_key=shard, instance=instance, asset_selection=selection,
                                        run_config=run_config, raise_on_error=False,
                                        tags={PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()})
        summary.runs += 1
        if not result.success:
            summary.failed[shard] = _failure_message(result)
        bar.set_postfix(failed=len(summary.failed))
    # the unpartitioned outputs (balanced tars, wdinfo, precache, energon indexes) catch up in one run
    global_jobdef = defs.resolve_job_def("global_job")
    global_keys = [k for k in graph_order if k in global_jobdef.asset_layer.selected_asset_keys]
    never = [k for k in global_keys if instance.get_latest_materialization_event(k) is None]
    if summary.runs or never or rebuild:
        bar.write("updating balanced tars, wdinfo, precached encodings and energon indexes ...")
        result = global_jobdef.execute_in_process(instance=instance, run_config=QUIET_RUN_CONFIG,
                                                  raise_on_error=False,
                                                  tags={PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()})
        summary.runs += 1
        if not result.success:
            summary.failed["(global)"] = _failure_message(result)
    summary.materialized = {k.to_user_string(): len(instance.get_materialized_partitions(k)) for k in order}
    for k in global_keys:
        summary.materialized[k.to_user_string()] = int(instance.get_latest_materialization_event(k) is not None)
        summary.global_assets.append(k.to_user_string())
    return summary
