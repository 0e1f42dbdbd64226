"""shard_work: automation at dataset scale. With shard blocks (``shards_per_partition`` > 1) this sensor,
not Dagster's declarative automation, carries shards through the per-shard assets: each tick reads the
state index (a handful of files, ``shardprep.state``), finds the (asset, shard) pairs not complete at the
config's version, and asks for one run per block that has some, with only those assets.

Gated like the declarative conditions it replaces: a shard whose last attempt at an asset failed (its
blocking check included: the index records a failed check as a failure) is not retried automatically,
nor is anything downstream of it, until a person re-runs it (`shardprep run`). Blocks with a run in
flight are left alone. A run key per block and per set of pending pairs means a tick replayed, or a
block whose run failed, asks for nothing twice; a block that gained shards gets a new key.
"""

from __future__ import annotations

import hashlib
import json

import dagster as dg

from shardprep import state
from shardprep.artifacts import ARTIFACTS, PER_SHARD, enabled
from shardprep.ledger import load_ledger
from shardprep_dagster.resources.dataset import DatasetResource

MAX_RUNS_PER_TICK = 200
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED]


def _busy_partitions(instance: dg.DagsterInstance) -> set[str]:
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT))
    return {r.tags["dagster/partition"] for r in runs if "dagster/partition" in r.tags}


def pending_work(dataset: DatasetResource) -> dict[str, dict[str, list[str]]]:
    """``{block: {asset: [shards]}}`` the sensor would run: pairs not complete, not failed last time, with
    no upstream shard whose last attempt failed."""
    cfg, layout = dataset.config, dataset.layout
    ledger = load_ledger(layout)
    if ledger is None:
        return {}
    names = [a for a in PER_SHARD if enabled(a, cfg)]
    # folded here: the sensor runs where the work is driven (the daemon's machine), and with no
    # `shardprep run` following the work nothing else keeps the journal short for the block steps
    states = state.load(layout, names)
    # shards held back per asset: its own last attempt failed, or an upstream asset's (in dependency order)
    held: dict[str, set[str]] = {}
    for n in names:
        held[n] = set(states[n].failures()).union(*(held[p] for p in ARTIFACTS[n].parents if p in held))
    out: dict[str, dict[str, list[str]]] = {}
    for shard, assets in state.incomplete(ledger, states, dataset.versions).items():
        for a in assets:
            if shard in held[a]:
                continue
            out.setdefault(ledger.partition_of(shard), {}).setdefault(a, []).append(shard)
    return out


def shard_work_requests(instance: dg.DagsterInstance, dataset: DatasetResource) -> list[dg.RunRequest]:
    busy = _busy_partitions(instance)
    requests = []
    for block, work in pending_work(dataset).items():
        if block in busy:
            continue
        key = hashlib.sha1(json.dumps(work, sort_keys=True).encode()).hexdigest()[:16]
        requests.append(dg.RunRequest(partition_key=block, run_key=f"{block}:{key}",
                                      asset_selection=[dg.AssetKey(a) for a in PER_SHARD if a in work]))
        if len(requests) == MAX_RUNS_PER_TICK:  # the rest next tick: the queue is full enough
            break
    return requests


def shard_work_sensor(assets: list[str], interval: int = 15, running: bool = True) -> dg.SensorDefinition:
    """The sensor over the per-shard ``assets`` of the code location, every ``interval`` seconds;
    ``running``: its default status."""

    @dg.sensor(name="shard_work", minimum_interval_seconds=interval, asset_selection=dg.AssetSelection.assets(*assets),
               default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
               description=__doc__.split("\n\n")[0])
    def shard_work(context: dg.SensorEvaluationContext, dataset: DatasetResource):
        requests = shard_work_requests(context.instance, dataset)
        if not requests:
            return dg.SkipReason("every shard is complete, in flight, or waits for a failed one to be re-run")
        return requests

    return shard_work
