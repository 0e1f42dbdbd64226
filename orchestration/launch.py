"""`shardprep run`'s work handed to Dagster: an asset backfill of exactly the (asset, shard) pairs to do.

Dagster's BackfillDaemon turns it into runs as their upstream partitions materialize, batched by each
asset's BackfillPolicy (one model load per batch), and submits them to the run queue, where the
QueuedRunCoordinator launches them within the instance's run and pool limits: the same machinery that
runs the UI's backfills and automation, so every way of launching work shares one concurrency. When no
daemon serves the instance, one is started (``orchestration.queue_daemon``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import dagster as dg
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.partitions.context import partition_loading_context
from dagster._core.events import DagsterEventType
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus, PartitionBackfill
from dagster._core.utils import make_new_backfill_id

from shardprep_dagster.orchestration import daemon_process
from shardprep_dagster.orchestration.queue_daemon import ACTIVE_BACKFILLS, IN_FLIGHT, external_daemon, wake

Pairs = dict[dg.AssetKey, set[str]]  # asset -> shards (unpartitioned assets: {""})


# ---------------------------------------------------------------- the daemon


def daemon_serving(instance: dg.DagsterInstance) -> str | None:
    """Which daemon turns this instance's backfills into runs and launches them: ``private`` (one this
    process started, or another process's, holding the lock), ``external`` (a dagster-daemon with a fresh
    heartbeat), or None."""
    home = instance.root_directory
    if daemon_process.running_here(home):
        return "private"
    dead_id = daemon_process.last_daemon_id(home)
    if dead_id is None:
        return "private"
    return "external" if external_daemon(instance, dead_id) else None


def ensure_daemon(instance: dg.DagsterInstance) -> str:
    """Make sure a daemon turns backfills into runs and launches them: ``external`` (a dagster-daemon
    serves the instance), ``private`` (ours runs), or ``started`` (ours was started now)."""
    serving = daemon_serving(instance)
    if serving is not None:
        return serving
    daemon_process.spawn(instance.root_directory)
    return "started"


# ---------------------------------------------------------------- backfills


def launch(instance: dg.DagsterInstance, pairs: Pairs, *, tags: dict[str, str], title: str,
           run_config: dict | None = None) -> str:
    """Create an asset backfill of exactly ``pairs``; returns its id (the daemon takes it from there)."""
    from shardprep_dagster.assets import shard_partitions

    subset = AssetGraphSubset(
        partitions_subsets_by_asset_key={k: shard_partitions.subset_with_partition_keys(sorted(v))
                                         for k, v in pairs.items() if "" not in v},
        non_partitioned_asset_keys={k for k, v in pairs.items() if "" in v})
    backfill = PartitionBackfill.from_asset_graph_subset(
        backfill_id=make_new_backfill_id(), backfill_timestamp=time.time(), tags=tags,
        dynamic_partitions_store=instance, asset_graph_subset=subset, title=title,
        description=f"{len(pairs)} assets, {sum(map(len, pairs.values()))} (asset, shard) pairs",
        run_config=run_config)
    instance.add_backfill(backfill)
    wake()  # an idle private daemon of this instance takes it at once
    return backfill.backfill_id


def cancel(instance: dg.DagsterInstance, backfill_id: str) -> None:
    """Ask the daemon to cancel the backfill: queued runs are dropped, running ones terminated."""
    backfill = instance.get_backfill(backfill_id)
    if backfill is not None and backfill.status == BulkActionStatus.REQUESTED:
        instance.update_backfill(backfill.with_status(BulkActionStatus.CANCELING))
        wake()  # the daemon terminates its runs now, not at its next look


def backfill_over(status: BulkActionStatus) -> bool:
    """A backfill in ``status`` is over: the daemon has marked it completed, failed or canceled."""
    return status not in ACTIVE_BACKFILLS


@dataclass
class Progress:
    status: BulkActionStatus
    done: Pairs = field(default_factory=dict)  # materialized by the backfill
    failed: Pairs = field(default_factory=dict)  # failed, or not run because an upstream failed

    @property
    def finished(self) -> bool:
        return backfill_over(self.status)


def _pairs(subset: AssetGraphSubset) -> Pairs:
    out: Pairs = defaultdict(set)
    for key, partitions in subset.partitions_subsets_by_asset_key.items():
        out[key] |= set(partitions.get_partition_keys())
    for key in subset.non_partitioned_asset_keys:
        out[key].add("")
    return dict(out)


def _materialized_since(instance: dg.DagsterInstance, key: dg.AssetKey, shards: set[str], since: float) -> set[str]:
    """Which of ``shards`` of ``key`` ("" for an unpartitioned asset) were materialized after ``since``."""
    partitions = sorted(s for s in shards if s) or None
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=partitions, after_timestamp=since), limit=len(shards)
        + 1000).records
    return {r.partition_key or "" for r in records} & shards


def progress(instance: dg.DagsterInstance, backfill_id: str) -> Progress:
    backfill = instance.get_backfill(backfill_id)
    data = backfill.asset_backfill_data
    if data is None:
        return Progress(backfill.status)
    return Progress(backfill.status, _pairs(data.materialized_subset), _pairs(data.failed_and_downstream_subset))


def materialized_out(instance: dg.DagsterInstance, backfill_id: str) -> bool:
    """Whether an active backfill has nothing left but the daemon's bookkeeping: it has runs, none of them in
    flight, and every (asset, shard) pair of its target has been materialized since it began. The daemon
    marks such a backfill completed at its next pass, which comes a tick after the last run's success and
    takes seconds on a busy machine (a 2 x 10,000-row chain waited 5.8 s there, bench/E2E.md); a follower can
    go on at once. A backfill with a failure, or one still to create its next runs, reads False."""
    return _materialized_out(instance, instance.get_backfill(backfill_id))


def settled(instance: dg.DagsterInstance, backfill_id: str) -> str | None:
    """"finished" (the daemon has marked it over), "materialized out" (``materialized_out``) or None (neither),
    from one read of the backfill."""
    backfill = instance.get_backfill(backfill_id)
    if backfill is not None and backfill_over(backfill.status):
        return "finished"
    return "materialized out" if _materialized_out(instance, backfill) else None


def _materialized_out(instance: dg.DagsterInstance, backfill: PartitionBackfill | None) -> bool:
    data = backfill.asset_backfill_data if backfill is not None else None
    if data is None or backfill.status != BulkActionStatus.REQUESTED or not data.failed_and_downstream_subset.is_empty:
        return False
    runs = dg.RunsFilter(tags={"dagster/backfill": backfill.backfill_id})
    if not instance.get_runs_count(filters=runs) or instance.get_runs_count(
            filters=dg.RunsFilter(tags=runs.tags, statuses=IN_FLIGHT)):
        return False
    return not _missing(instance, backfill)


def in_flight(instance: dg.DagsterInstance) -> tuple[Pairs, list[str]]:
    """The (asset, shard) pairs some active backfill or run still has to do (whoever launched it:
    another `shardprep run`, the UI, automation), and the ids of those backfills."""
    pairs: Pairs = defaultdict(set)
    ids = []
    for backfill in instance.get_backfills(filters=BulkActionsFilter(statuses=ACTIVE_BACKFILLS)):
        data = backfill.asset_backfill_data
        if data is None:
            continue
        ids.append(backfill.backfill_id)
        left = data.target_subset - data.materialized_subset - data.failed_and_downstream_subset
        for key, shards in _pairs(left).items():
            pairs[key] |= shards
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT)):
        if "dagster/backfill" in run.tags or not run.asset_selection:
            continue
        for key in run.asset_selection:
            pairs[key] |= set(run_partitions(instance, run)) or {""}
    return dict(pairs), ids


def run_partitions(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[str]:
    """The shards a run materializes: its partition, or every shard of its partition range."""
    from shardprep_dagster.assets import shard_partitions

    if "dagster/partition" in run.tags:
        return [run.tags["dagster/partition"]]
    start, end = run.tags.get("dagster/asset_partition_range_start"), run.tags.get("dagster/asset_partition_range_end")
    if start is None or end is None:
        return []
    with partition_loading_context(dynamic_partitions_store=instance):
        return list(shard_partitions.get_partition_keys_in_range(dg.PartitionKeyRange(start, end)))


def error_cause(error) -> str:
    """The first line of what went wrong in a step: the innermost cause of Dagster's error (for an
    exception in the asset's code Dagster reports only 'Error occurred while executing op ...', with
    the exception itself as the cause), e.g. ``OSError: [Errno 28] No space left on device``."""
    while getattr(error, "cause", None) is not None:
        error = error.cause
    lines = [line.strip() for line in (error.message or "").strip().splitlines() if line.strip()]
    if not lines:
        return getattr(error, "cls_name", None) or "failed"
    # a dg.Failure raised on purpose says what happened in its description: its class path adds nothing
    return lines[0].removeprefix("dagster._core.definitions.events.Failure: ")


def failures(instance: dg.DagsterInstance, backfill_id: str, materialized: bool = False) -> dict[str, str]:
    """``{shard: first error}`` for every shard the backfill did not materialize entirely ("(global)" for
    unpartitioned assets): a batched step reports each shard's own error (``assets.shard_runs``), else a
    step's error counts for every shard of its run; a run that died without a step failure (its worker
    killed) gives its run failure; a pair no run reached is "not materialized". ``materialized``: the
    backfill was found ``materialized_out`` (every pair materialized since it began), so none is missing."""
    out: dict[str, str] = {}
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id},
                                                   statuses=[dg.DagsterRunStatus.FAILURE]))
    for run in runs:
        run_failures(instance, run, out)
    if materialized:
        return out
    backfill = instance.get_backfill(backfill_id)
    data = backfill.asset_backfill_data if backfill is not None else None
    if data is not None:
        for key, shards in _missing(instance, backfill).items():
            for shard in shards:
                out.setdefault(shard or "(global)", f"{key.to_user_string()}: not materialized")
    return out


def _missing(instance: dg.DagsterInstance, backfill: PartitionBackfill) -> Pairs:
    """The pairs of ``backfill``'s target without a materialization since it began. The backfill's own
    accounting can miss one the instance has (seen with Celery workers writing events while the daemon reads
    them, and always for a while after the last run, until the daemon's next pass), so it is only the first
    filter; the instance decides."""
    data = backfill.asset_backfill_data
    out: Pairs = {}
    for key, shards in _pairs(data.target_subset - data.materialized_subset).items():
        missing = shards - _materialized_since(instance, key, shards, backfill.backfill_timestamp)
        if missing:
            out[key] = missing
    return out


def run_failures(instance: dg.DagsterInstance, run: dg.DagsterRun, out: dict[str, str]) -> dict[str, str]:
    """``out`` with the first error of each shard of a failed ``run`` (see ``failures``) not in it yet."""
    shards = run_partitions(instance, run) or ["(global)"]
    run_error = None
    for record in instance.all_logs(run.run_id, of_type={DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE,
                                                         DagsterEventType.ENGINE_EVENT}):
        event = record.dagster_event
        if event.event_type == DagsterEventType.ENGINE_EVENT:
            if "terminated by signal" in (record.message or ""):  # the code server saw its worker die
                run_error = record.message.split("] ", 1)[-1].split(". ")[0]
            continue
        if event.event_type == DagsterEventType.RUN_FAILURE:
            run_error = run_error or (record.message or "run failed").strip().splitlines()[0]
            continue
        data = event.step_failure_data
        per_shard = {}
        if data.user_failure_data is not None:
            value = data.user_failure_data.metadata.get("failed_shards")
            per_shard = dict(getattr(value, "value", None) or {})
        message = error_cause(data.error) if data.error else "failed"
        for shard in shards:
            if shard not in out and (not per_shard or shard in per_shard):
                out[shard] = f"{event.step_key}: {per_shard.get(shard, message)}"
    for shard in shards:
        if shard not in out and run_error is not None:
            out[shard] = f"run {run.run_id[:8]}: {run_error}"
    return out
