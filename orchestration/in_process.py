"""`shardprep run --in-process`: one shard after the other in this process, then the unpartitioned
assets; for debugging, and for output roots only this process can see (``memory://``)."""

from __future__ import annotations

import os
import socket
import sys

import dagster as dg

from shardprep_dagster.assets.shard_runs import SHARDS_TAG
from shardprep_dagster.orchestration.plan import Plan, globals_needed, newest_materialization
from shardprep_dagster.orchestration.progress import ShardProgress
from shardprep_dagster.orchestration.stop import Stop
from shardprep_dagster.orchestration.summary import RunSummary
from shardprep_dagster.resources.dataset import HOST_TAG, PID_TAG

QUIET_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    from shardprep_dagster.orchestration.launch import error_cause

    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            return f"{event.step_key}: {error_cause(event.step_failure_data.error)}"
    return "run failed"


def _run_config(keys: list[dg.AssetKey], rebuild: bool) -> dict:
    config = dict(QUIET_RUN_CONFIG)
    if rebuild:
        config["ops"] = {k.to_python_identifier(): {"config": {"rebuild": True}} for k in keys}
    return config


def execute(plan: Plan, instance: dg.DagsterInstance, summary: RunSummary, progress: bool) -> None:
    from tqdm import tqdm

    job = plan.defs.resolve_job_def("shards_job")
    global_job = plan.defs.resolve_job_def("global_job")
    tags = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(),
            **({SHARDS_TAG: plan.only_spec} if plan.only_spec is not None else {})}
    todo = plan.todo_shards()
    bar = tqdm(total=0, desc="shards", unit="shard", disable=not progress, file=sys.stderr)
    shard_progress = ShardProgress(plan, todo, bar)
    bar.total = shard_progress.total
    bar.refresh()
    with Stop() as stop:
        try:
            for shard in todo:  # a partition: a shard, or a block of them
                selection = plan.assets_to_do(shard)
                result = job.execute_in_process(partition_key=shard, instance=instance, asset_selection=selection,
                                                run_config=_run_config(selection, plan.rebuild),
                                                raise_on_error=False, tags=tags)
                summary.runs += 1
                if stop.received() is not None:
                    instance.report_run_canceled(result.dagster_run, stop.reason)
                    break
                if not result.success:
                    summary.failed[shard] = _failure_message(result)
                shard_progress.poll({shard})
                bar.set_postfix(failed=len(summary.failed))
            # the unpartitioned outputs (balanced tars, wdinfo, precache, energon indexes) catch up in one run
            summary.shards_settled = newest_materialization(instance, plan.shard_keys)
            if stop.received() is None and (plan.rebuild or globals_needed(instance, plan.shard_keys,
                                                                           plan.global_keys, plan.versions,
                                                                           summary.shards_settled)):
                bar.write("updating balanced tars, wdinfo, precached encodings and energon indexes ...")
                result = global_job.execute_in_process(instance=instance, run_config=QUIET_RUN_CONFIG,
                                                       raise_on_error=False, tags=tags)
                summary.runs += 1
                if stop.received() is not None:
                    instance.report_run_canceled(result.dagster_run, stop.reason)
                elif not result.success:
                    summary.failed["(global)"] = _failure_message(result)
        except KeyboardInterrupt:  # a signal between two runs: nothing of ours was in flight
            pass
    bar.close()
    summary.stopped_by = stop.signum
