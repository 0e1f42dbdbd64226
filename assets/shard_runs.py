"""Running per-shard work for every partition of a run (one shard, or a batch from a backfill)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import zlib
from collections.abc import Iterator
from typing import Any, Callable

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG

from shardprep import state
from shardprep.artifacts import ARTIFACTS
from shardprep.checks import CheckOutcome
from shardprep.keys import parse_shard_ids
from shardprep.layout import Layout
from shardprep.ledger import load_ledger, shard_media
from shardprep.models.devices import Device, lease
from shardprep.storage import lock
from shardprep.verify import file_sizes
from shardprep.versions import read_stamp, remove_stamp, stamped_version, write_stamp
from shardprep_dagster.assets.partitions import shard_partitions
from shardprep_dagster.resources.dataset import DatasetResource

REBUILD_TAG = "shardprep/rebuild"  # a run tagged "true" rebuilds like ShardRunConfig(rebuild=True)
SHARDS_TAG = "shardprep/shards"  # `run --shards 12-40,55`: a block run does only these of its shards
LOCK_STRIPES = 256  # per-(asset, shard) locks share this many lock files
DEVICE_TAG = "shardprep/device"  # + "/<asset>": the device a GPU step of the run leased
CELERY_QUEUE_TAG = "dagster-celery/queue"  # with the Celery executor, the queue a step is sent to


def in_pool(pool: str) -> dict[str, Any]:
    """``@asset`` arguments for a step of ``pool``: its Dagster pool (slots bound how many run at once)
    and, under the Celery executor, the worker queue of the same name (``shardprep worker -q gpu``)."""
    return {"pool": pool, "op_tags": {CELERY_QUEUE_TAG: pool}}


def from_record(name: str) -> dict[str, Any]:
    """The ``@asset`` arguments that artifact ``name``'s record fixes (``shardprep.artifacts``): its
    dependencies (a global asset reads every shard of a per-shard parent), group, shard partitions and
    pool."""
    record = ARTIFACTS[name]

    def dep(parent: str) -> dg.AssetDep:
        whole = not record.partitioned and ARTIFACTS[parent].partitioned
        return dg.AssetDep(parent, partition_mapping=dg.AllPartitionMapping() if whole else None)

    args: dict[str, Any] = {"deps": [dep(p) for p in record.parents], "group_name": record.group}
    if record.partitioned:
        args["partitions_def"] = shard_partitions
    if record.pool is not None:
        args.update(in_pool(record.pool))
    return args


class ShardRunConfig(dg.Config):
    """Run config of every per-shard asset."""

    rebuild: bool = False  # redo shards whose outputs already exist (default: complete shards are kept)


def _table(rows: list[dict[str, Any]]) -> dg.MetadataValue:
    cols = list(rows[0]) if rows else ["shard"]
    schema = dg.TableSchema(columns=[
        dg.TableColumn(c, "float" if isinstance(rows[0].get(c), float) else
                       "int" if isinstance(rows[0].get(c), int) else "string") for c in cols])
    return dg.MetadataValue.table(records=[dg.TableRecord({c: r.get(c) for c in cols}) for r in rows],
                                  schema=schema)


def failures_table(status_dict: dict[str, int]) -> dg.MetadataValue:
    rows = [{"reason": k, "count": int(v)} for k, v in sorted(status_dict.items(), key=lambda kv: -kv[1])
            if k != "success"]
    return _table(rows or [{"reason": "(none)", "count": 0}])


# Global assets catch up on a schedule (or on demand from the UI); any newly finished shard is enough,
# so a failed shard never holds them back.
GLOBAL_AUTOMATION = dg.AutomationCondition.on_cron("*/10 * * * *")

# Per-shard assets follow their upstream shard, but never past a failed blocking check.
SHARD_AUTOMATION = dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()


def shard_check(name: str, asset: str, description: str) -> dg.AssetCheckSpec:
    """A blocking check evaluated per shard partition (downstream work waits for it to pass)."""
    return dg.AssetCheckSpec(name, asset=asset, blocking=True, partitions_def=shard_partitions,
                             description=description)


def _check_result(name: str, outcomes: dict[str, CheckOutcome]) -> dg.AssetCheckResult:
    if not outcomes:  # every shard of the run is of the other media: nothing to check
        return dg.AssetCheckResult(check_name=name, passed=True, description="not applicable (no shard of this kind)")
    if len(outcomes) == 1:
        (o,) = outcomes.values()
        return dg.AssetCheckResult(check_name=name, passed=o.passed, description=o.description,
                                   metadata=o.metadata, severity=dg.AssetCheckSeverity.ERROR)
    failed = {k: o.description for k, o in outcomes.items() if not o.passed}
    # a batched run records one evaluation for its shards: it fails if any shard fails
    return dg.AssetCheckResult(
        check_name=name, passed=not failed, severity=dg.AssetCheckSeverity.ERROR,
        description=f"{len(outcomes) - len(failed)}/{len(outcomes)} shards passed",
        metadata={"failed_shards": dg.MetadataValue.json(failed), "shards": len(outcomes)})


def worker_metadata() -> dict[str, Any]:
    """Which process did a step (host:pid), and how many models that process has loaded so far: under
    Celery a long-lived worker loads each model once, however many shards it does."""
    def loads(module: str) -> int:  # never imports the module: a step without models reports 0
        return int(getattr(sys.modules.get(module), "LOAD_COUNT", 0))

    return {"worker": f"{socket.gethostname()}:{os.getpid()}", "clip_loads_by_worker": loads("shardprep.models.clip"),
            "nemo_loads_by_worker": loads("shardprep.models.nemo")}


def lock_name(artifact: str, key: str) -> str:
    """The lock file that keeps writers of (``artifact``, shard ``key``) apart (one of LOCK_STRIPES)."""
    return f"shard-{zlib.crc32(f'{artifact}/{key}'.encode()) % LOCK_STRIPES}"


@contextlib.contextmanager
def shard_locks(layout: Layout, shard: str, artifacts: list[str]):
    """The locks the writers of ``artifacts`` take for ``shard``, held by a command that rewrites the shard's
    files outside a run (retry, takedown); stripes can coincide, and a lock file taken twice by one process
    would wait for itself: each name once, in order."""
    with contextlib.ExitStack() as held:
        for name in sorted({lock_name(a, shard) for a in artifacts}):
            held.enter_context(lock(layout.root, name))
        yield


def rebuilding(context: dg.AssetExecutionContext, rebuild: bool) -> bool:
    """Whether this step redoes complete shards: its config says so, or its run is tagged REBUILD_TAG."""
    return rebuild or context.run.tags.get(REBUILD_TAG) == "true"


# (artifact, shard, version) -> the figures of a shard made complete ahead of its own step, in this
# process, by a follower (``assets.follow``); the artifact's step reports them instead of "cached"
FOLLOWED: dict[tuple[str, str, str], dict[str, Any]] = {}


def write_one(layout, artifact: str, version: str, key: str, write: Callable[[str], dict[str, Any]], *,
              rebuild: bool = False, describe: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Make ``artifact``'s outputs of shard ``key`` complete at ``version``: ``write(key)`` unless its stamp
    says they are; returns the shard's figures (with when its writing started and ended)."""
    # one writer per (asset, shard) at a time, whoever launched it: a second one waits, then finds the
    # outputs complete (local roots; on object stores Dagster's queue keeps them apart)
    with lock(layout.root, lock_name(artifact, key)):
        stamp = None if rebuild else read_stamp(layout, artifact, key)
        if stamp is not None and stamp["version"] == version:
            # again: a process killed between the stamp and its journal entry left it out
            state.record_done(layout, artifact, key, version, stamp.get("outputs", {}),
                              stamp.get("written_at") or 0.0)
            return {"status": "cached", **(describe(key) if describe else {})}
        if stamp is not None or rebuild:
            # the outputs are about to change: not complete at any version until the new stamp (a crash
            # mid-write must not leave them claimed at the old one)
            remove_stamp(layout, artifact, key)
        started = time.time()
        result = write(key)
        # last: the outputs are complete; their sizes let `verify` find one cut short later
        write_stamp(layout, artifact, version, key, file_sizes(layout.shard_outputs(artifact, key)))
        return {**result, "started_at": round(started, 3), "finished_at": round(time.time(), 3)}


def materialize_shards(context: dg.AssetExecutionContext, dataset: DatasetResource, artifact: str,
                       write: Callable[[str], dict[str, Any]], *, rebuild: bool = False,
                       describe: Callable[[str], dict[str, Any]] | None = None,
                       check: tuple[str, Callable[[str], CheckOutcome]] | None = None,
                       on_done: Callable[[str], None] | None = None) -> dg.MaterializeResult:
    """``write(shard)`` for each partition of this run whose outputs are not complete at the current
    version (``shardprep.versions``: a stamp written after the outputs says so), then the asset's
    check, then report. ``describe(shard)``: metadata of outputs found complete (default: none).

    An artifact made from one media only (its record's ``media``: image_shards from image shards,
    video_shards from video shards) materializes a shard of the other kind with nothing written (status
    "not applicable"), so every partition of the one shard partition set is complete for every asset.

    A failing shard does not stop the others (their outputs are written and will be found complete on
    a re-run); the step fails at the end naming every failed shard. ``on_done(shard)``: called as each
    shard is found or made complete (``assets.follow``: the next artifact starts on it at once).
    Shards a follower already made complete in this process are reported with its figures.
    """
    partitions = list(context.partition_keys) if context.has_partition_key_range or context.has_partition_key else []
    layout, version = dataset.layout, dataset.versions[artifact]
    shards_of = partition_shards(dataset, partitions)
    if context.run.tags.get(SHARDS_TAG):
        ids = parse_shard_ids(context.run.tags[SHARDS_TAG])
        shards_of = {p: [k for k in keys if int(k) in ids] for p, keys in shards_of.items()}
    keys = [k for p in partitions for k in shards_of[p]]
    rebuild = rebuilding(context, rebuild)
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    media = ARTIFACTS[artifact].media
    kinds = shard_media(layout, keys) if media is not None else {}
    # complete at this version by the state index (which never claims more than the stamps): skipped
    # without a lock or a stamp read, so a run over a range of blocks costs nothing for its complete ones
    indexed = set() if rebuild else state.load(layout, [artifact], fold_first=False)[artifact].complete_among(
        keys, version)
    state.record_started(layout, artifact, [k for k in keys if kinds.get(k, media) == media and k not in indexed])
    for key in keys:
        if kinds.get(key, media) != media:
            results[key] = {"status": f"not applicable ({kinds[key]} shard)", "media": kinds[key]}
            continue
        ahead = FOLLOWED.pop((artifact, key, version), None)
        if ahead is not None:
            results[key] = ahead
        elif key in indexed:
            results[key] = {"status": "cached"}
        else:
            try:
                results[key] = write_one(layout, artifact, version, key, write, rebuild=rebuild, describe=describe)
            except Exception as e:  # noqa: BLE001 - reported per shard, then the step fails
                context.log.error(f"shard {key}: {type(e).__name__}: {e}")
                failures[key] = f"{type(e).__name__}: {e}"
                state.record_failed(layout, artifact, key, failures[key])
                continue
        if on_done is not None:
            on_done(key)
    if failures:
        # the partitions of a batch whose shards all succeeded are materialized all the same, so their
        # downstream assets go ahead; only the failed ones wait for a re-run (their done shards are
        # stamped: the re-run skips them)
        for p in partitions:
            if not any(k in failures for k in shards_of[p]):
                context.log_event(dg.AssetMaterialization(
                    asset_key=context.asset_key, partition=p, tags={DATA_VERSION_TAG: version},
                    metadata={k: v for k, v in _figures({k: results[k] for k in shards_of[p]}, version).items()
                              if isinstance(v, (int, float, str)) or k == "per_shard"}))
        raise dg.Failure(
            description=f"{len(failures)} of {len(keys)} shard(s) failed: "
            + "; ".join(f"{k}: {v}" for k, v in list(failures.items())[:10]),
            metadata={"failed_shards": dg.MetadataValue.json(failures),
                      "per_shard": _per_shard(results, failures)},
        )
    checks = None
    if check:
        outcomes = {k: check[1](k) for k in keys if kinds.get(k, media) == media}
        for k, o in outcomes.items():
            if not o.passed:  # the index gates downstream work on it, as Dagster's blocking check does
                state.record_failed(layout, artifact, k, f"check {check[0]} failed: {o.description}")
        checks = [_check_result(check[0], outcomes)]
    if len(partitions) > 1:
        # each partition's materialization carries its own shards' figures, not the run's totals (shard
        # 00002 of a run over six must not show the six shards' samples)
        for p in partitions:
            own = {k: results[k] for k in shards_of[p] if k in results}
            if own:
                context.add_asset_metadata(_figures(own, version), partition_key=p)
        metadata = {"version": version, **worker_metadata(), "partitions_in_run": len(partitions),
                    "shards_in_run": len(results)}
    else:
        metadata = _figures(results, version)
    # the version is each partition's data version: the one tag Dagster indexes per partition
    return dg.MaterializeResult(metadata=metadata, check_results=checks, data_version=dg.DataVersion(version))


def partition_shards(dataset: DatasetResource, partitions: list[str]) -> dict[str, list[str]]:
    """``{partition: [shard keys]}``: a partition is a shard, or a block of them (``shards_per_partition``)."""
    if dataset.config.shards_per_partition == 1:
        return {p: [p] for p in partitions}
    ledger = load_ledger(dataset.layout)
    return {p: ledger.partition_shards(p) if ledger else [] for p in partitions}


def _per_shard(results: dict[str, dict[str, Any]], failures: dict[str, str] | None = None) -> dg.MetadataValue:
    rows = [{"shard": k, **{n: v for n, v in r.items() if isinstance(v, (int, float, str))}} for k, r in results.items()]
    rows += [{"shard": k, "status": "failed", "reason": why} for k, why in (failures or {}).items()]
    return _table(rows)


PER_SHARD_ROWS = 200  # above this many shards, the table lists only those not found complete


def _figures(results: dict[str, dict[str, Any]], version: str) -> dict[str, Any]:
    """A materialization's metadata: one shard's own, or the shards' totals and a row per shard (a block,
    or a batch of partitions; of a range of many blocks, the shards not found complete)."""
    if len(results) == 1:
        return {**next(iter(results.values())), "version": version, **worker_metadata()}
    if len(results) > PER_SHARD_ROWS:
        shown = {k: r for k, r in results.items() if r.get("status") != "cached"}
    else:
        shown = results
    summary: dict[str, Any] = {"shards": len(results), "version": version, **worker_metadata(),
                               "cached_shards": sum(r.get("status") == "cached" for r in results.values())}
    for name in ("samples", "successes", "failed_to_download", "failed_to_resize", "rows", "bytes", "seconds"):
        vals = [r[name] for r in results.values() if isinstance(r.get(name), (int, float))]
        if vals:
            summary[name] = sum(vals)
    summary["per_shard"] = _per_shard(shown)
    return summary


def versioned(dataset: DatasetResource, artifact: str, result: dg.MaterializeResult) -> dg.MaterializeResult:
    """``result`` with the artifact's version (``shardprep.versions``) as its data version, which
    ``orchestration.plan`` compares with the config's to find outdated outputs; its stamp (the state
    index shows it), unless the asset wrote one at this version already."""
    version = dataset.versions[artifact]
    if stamped_version(dataset.layout, artifact) != version:
        write_stamp(dataset.layout, artifact, version)
    return result._replace(data_version=dg.DataVersion(version))


@contextlib.contextmanager
def gpu_device(context: dg.AssetExecutionContext, dataset: DatasetResource) -> Iterator[Device]:
    """The device this GPU step works on, leased for the step (``shardprep.models.devices``: one step per
    device, given back when the process ends however it ends) and named in a run tag, so the run shows
    which GPU did its shards."""
    with lease(dataset.config.device) as device:
        context.instance.add_run_tags(context.run.run_id, {f"{DEVICE_TAG}/{context.asset_key.to_user_string()}":
                                                       device.name})
        context.log.info(f"{context.asset_key.to_user_string()} runs on device {device.name}")
        yield device


@contextlib.contextmanager
def gpu_device_when_needed(context: dg.AssetExecutionContext,
                           dataset: DatasetResource) -> Iterator[Callable[..., Device | None]]:
    """``gpu_device``, leased at the first call of the function this yields: ``device()`` leases (once)
    and returns it; ``device(lease=False)`` returns it, or None when it was never leased."""
    with contextlib.ExitStack() as stack:
        held: list[Device] = []

        def device(lease: bool = True) -> Device | None:
            if not held and lease:
                held.append(stack.enter_context(gpu_device(context, dataset)))
            return held[0] if held else None

        yield device
