"""Dagster at LAION-scale partition counts: what shardprep's planning, status, launching, automation and
the UI's partition page cost with N shard partitions, on the embedded SQLite instance or PostgreSQL.

    python bench/partitions.py --shards 100000 --storage sqlite|postgres [--materialized 0.99]

Builds a synthetic dataset (128 tiny source files, as LAION-2B-en ships 128 parquet files, and a
ledger giving them N shards: nothing is downloaded), a fresh instance (a new DAGSTER_HOME with the
checkout's dagster.yaml, or dagster.postgres.yaml pointed at a database of its own, dropped at the
end), then times each step and prints a JSON object and a markdown table.

Populating: the first events go through ``instance.report_runless_asset_event`` (timed, to
extrapolate); the rest are copies of the event row Dagster wrote for that asset, the partition
replaced, bulk-inserted into the index's ``event_logs`` and ``asset_event_tags`` tables (the two
tables every read below uses). SQLite's per-run event shards are not written: no read here uses
them. Only materializations are written (no planned events, no runs), so nothing is failed or in
progress. The last event of each asset goes through Dagster again, so the asset record is current.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))

SOURCE_FILES = 128  # LAION-2B-en's parquet files
SAMPLES_PER_SHARD = 10_000
SAMPLED_EVENTS = 2_000  # events written one by one through Dagster, to extrapolate from
LAUNCH_SHARDS = 1_000
PG_DB = "shardprep_scale"
# what a shard's materialization carries besides its version (``assets.shard_runs``)
METADATA = {"samples": 10000, "successes": 9132, "failed_to_download": 801, "failed_to_resize": 67,
            "bytes": 351_234_567, "seconds": 412.5}


class StepTimeout(Exception):
    pass


_expired = []  # the alarm went off: whatever exception the step's code wrapped it in, the step ran out of time


def _alarm(signum, frame):
    _expired.append(True)
    raise StepTimeout


def timed(results: dict, step: str, fn, *args, limit: int = 600, **kwargs):
    """Run ``fn``, record its wall seconds under ``step`` (``> limit`` if it ran past ``limit``)."""
    signal.signal(signal.SIGALRM, _alarm)
    _expired.clear()
    signal.alarm(limit)
    start = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
        results[step] = round(time.perf_counter() - start, 2)
        return out
    except Exception:
        if not _expired:
            raise
        results[step] = f"> {limit} (stopped)"
        return None
    finally:
        signal.alarm(0)
        print(f"  {step}: {results[step]}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- instance and dataset


def _pg(sql: str) -> None:
    import psycopg2

    conn = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql)
    conn.close()


def prepare_home(work: Path, storage: str) -> None:
    """A fresh DAGSTER_HOME: the checkout's dagster.yaml, or dagster.postgres.yaml on our own database."""
    home = work / "home"
    home.mkdir(parents=True)
    if storage == "postgres":
        os.environ.update(DAGSTER_PG_HOST="127.0.0.1", DAGSTER_PG_PORT="5432", DAGSTER_PG_USER="postgres",
                          DAGSTER_PG_PASSWORD="", DAGSTER_PG_DB=PG_DB)
        _pg(f"DROP DATABASE IF EXISTS {PG_DB}")
        _pg(f"CREATE DATABASE {PG_DB}")
    shutil.copy(CHECKOUT / ("dagster.postgres.yaml" if storage == "postgres" else "dagster.yaml"),
                home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)


def make_dataset(work: Path, n: int) -> Path:
    """Source files, config and a ledger of ``n`` shards spread over the files (as registration
    would write it: the files' fingerprints match, so a run registers nothing new)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardprep.ledger import LEDGER_VERSION
    from shardprep.sources import file_fingerprint, list_source_files

    src, out = work / "src", work / "out"
    src.mkdir()
    out.mkdir()
    table = pa.table({"url": ["http://127.0.0.1/a.jpg"], "caption": ["a"]})
    for i in range(SOURCE_FILES):
        pq.write_table(table, src / f"part-{i:05d}.parquet")
    oom = max(5, len(str(n - 1)))  # LAION-5B's 580,000 shards need 6 digits
    config = work / "shardprep.yaml"
    config.write_text(f"source: {src}/*.parquet\noutput_root: {out}\noom_shard_count: {oom}\n"
                      f"samples_per_shard: {SAMPLES_PER_SHARD}\n")
    files, first = [], 0
    for i, url in enumerate(list_source_files(f"{src}/*.parquet")):
        count = n // SOURCE_FILES + (i < n % SOURCE_FILES)
        rows = count * SAMPLES_PER_SHARD
        files.append({"source": url, "fingerprint": file_fingerprint(url), "rows": rows, "columns": ["url", "caption"],
                      "digest": None, "segments": [{"first_shard": first, "num_shards": count, "row_start": 0,
                                                    "row_stop": rows}]})
        first += count
    (out / "ledger.json").write_text(json.dumps({"version": LEDGER_VERSION, "samples_per_shard": SAMPLES_PER_SHARD,
                                                 "oom_shard_count": oom, "files": files}))
    os.environ["SHARDPREP_CONFIG"] = str(config)  # the code location the UI and daemons load serves it
    return config


# ---------------------------------------------------------------- step 1: registering partitions


class Crash(BaseException):
    """A process killed mid-way (not an Exception: register_partitions must not catch it)."""


class CrashAfter:
    """The instance, but the process dies after ``chunks`` calls adding partitions."""

    def __init__(self, instance, chunks: int) -> None:
        self._instance, self._left = instance, chunks

    def __getattr__(self, name):
        return getattr(self._instance, name)

    def add_dynamic_partitions(self, name, keys):
        if self._left == 0:
            raise Crash
        self._left -= 1
        self._instance.add_dynamic_partitions(name, keys)


def register(instance, keys: list[str], results: dict) -> None:
    from shardprep_dagster.orchestration.runner import SHARD_PARTITIONS, register_partitions

    chunks = len(keys) // 10_000 * 3 // 10  # 30% of the chunks, then the process dies
    start = time.perf_counter()
    try:
        register_partitions(CrashAfter(instance, chunks), keys)
    except Crash:
        pass
    results["1a register: crash at 30%"] = round(time.perf_counter() - start, 2)
    added = timed(results, "1b register: full call after the crash", register_partitions, instance, keys)
    assert added == len(keys) - chunks * 10_000, added
    assert timed(results, "1c register: re-run (adds nothing)", register_partitions, instance, keys) == 0
    stored = timed(results, "1d get_dynamic_partitions", instance.get_dynamic_partitions, SHARD_PARTITIONS)
    assert list(stored) == keys, "the instance's partitions differ from the ledger's keys"


# ---------------------------------------------------------------- step 2: populating


def materialize_one(instance, key, shard: str, version: str) -> None:
    import dagster as dg
    from dagster._core.definitions.data_version import CODE_VERSION_TAG, DATA_VERSION_TAG

    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset_key=key, partition=shard, tags={DATA_VERSION_TAG: version, CODE_VERSION_TAG: version},
        metadata={**METADATA, "version": version}))


def bulk_copy(instance, key, shards: list[str], batch: int = 20_000) -> None:
    """Copies of the asset's latest event row for ``shards``, with their data-version tag rows."""
    import sqlalchemy as db
    from dagster._core.events import DagsterEventType
    from dagster._core.storage.event_log.schema import AssetEventTagsTable as Tags
    from dagster._core.storage.event_log.schema import SqlEventLogStorageTable as Events

    mat = DagsterEventType.ASSET_MATERIALIZATION.value
    with instance.event_log_storage.index_connection() as conn:
        row = conn.execute(db.select(Events).where(Events.c.asset_key == key.to_string(),
                                                   Events.c.dagster_event_type == mat)
                           .order_by(Events.c.id.desc()).limit(1)).mappings().one()
        tag = conn.execute(db.select(Tags).where(Tags.c.event_id == row["id"])).mappings().one()
    head, tail = row["event"].split(f'"{row["partition"]}"', 1)
    assert f'"{row["partition"]}"' not in tail  # the partition occurs once: a plain replace is right
    base = {c: row[c] for c in ("run_id", "dagster_event_type", "timestamp", "step_key", "asset_key")}
    for i in range(0, len(shards), batch):
        part = shards[i:i + batch]
        with instance.event_log_storage.index_connection() as conn:
            last = conn.execute(db.select(db.func.max(Events.c.id))).scalar() or 0
            conn.execute(Events.insert(), [{**base, "partition": s, "event": f'{head}"{s}"{tail}'} for s in part])
            ids = conn.execute(db.select(Events.c.id).where(Events.c.id > last, Events.c.asset_key == base["asset_key"])
                               .order_by(Events.c.id)).scalars().all()
            assert len(ids) == len(part)
            same = {c: tag[c] for c in ("asset_key", "key", "value", "event_timestamp")}
            conn.execute(Tags.insert(), [{**same, "event_id": e} for e in ids])


def populate(instance, shard_keys, versions: dict, present: list[str], results: dict) -> None:
    sample = present[:min(SAMPLED_EVENTS, len(present) // 2)]
    start = time.perf_counter()
    for shard in sample:
        materialize_one(instance, shard_keys[0], shard, versions[shard_keys[0].path[-1]])
    per_event = (time.perf_counter() - start) / len(sample)
    total = len(present) * len(shard_keys)
    results["2a report_runless_asset_event, s/event"] = round(per_event, 5)
    results["2b one by one, extrapolated (s)"] = round(per_event * total, 0)
    start = time.perf_counter()
    for i, key in enumerate(shard_keys):
        version = versions[key.path[-1]]
        rest = present[len(sample):] if i == 0 else present
        if i:
            materialize_one(instance, key, rest[0], version)  # the row the copies are made from
            rest = rest[1:]
        bulk_copy(instance, key, rest[:-1])
        materialize_one(instance, key, rest[-1], version)  # through Dagster: the asset record is current
    results["2c bulk insert, all events (s)"] = round(time.perf_counter() - start, 1)
    print(f"  populated: {results['2c bulk insert, all events (s)']} s", file=sys.stderr, flush=True)
    results["2d events written"] = total


# ---------------------------------------------------------------- steps 5-7: the code location's view


def workspace(instance):
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(
        executable_path=sys.executable, module_name="shardprep_dagster.definitions", working_directory=str(CHECKOUT)),
        location_name="shardprep")
    return WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin))


# the asset partition page's queries, as dagster-webserver 1.13.27's UI sends them
PARTITION_HEALTH = """query PartitionHealthQuery($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) { ... on AssetNode { id
    partitionKeysByDimension { name type partitionKeys }
    assetPartitionStatuses { ... on DefaultPartitionStatuses {
      materializedPartitions materializingPartitions failedPartitions } } } } }"""
PARTITION_STATS = """query AssetPartitionStats($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) { ... on AssetNode { id
    partitionStats { numMaterialized numMaterializing numFailed numPartitions } } } }"""


def graphql(ctx, query: str, key) -> dict:
    from dagster_graphql.test.utils import execute_dagster_graphql

    return execute_dagster_graphql(ctx.create_request_context(), query, {"assetKey": {"path": list(key.path)}}).data


def backfill_iteration(ctx) -> None:
    from dagster._daemon.backfill import execute_backfill_iteration

    for error in execute_backfill_iteration(ctx, logging.getLogger("backfill")):
        if error is not None:
            raise RuntimeError(error.to_string())


# ---------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--storage", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--materialized", type=float, default=0.99, help="share of shards materialized")
    parser.add_argument("--step-limit", type=int, default=600, help="seconds before a step is stopped")
    parser.add_argument("--skip", default="", help="steps not to run, comma-separated: automation,ui,launch")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and database")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix=f"partitions-{args.storage}-{args.shards}-"))
    results: dict = {"shards": args.shards, "storage": args.storage}
    try:
        run(args, work, results)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if args.storage == "postgres":
                _pg(f"DROP DATABASE IF EXISTS {PG_DB}")
    print(json.dumps(results))
    print("\n| step | seconds |\n|---|---|")
    for step, value in results.items():
        print(f"| {step} | {value} |")
    return 0


def run(args, work: Path, results: dict) -> None:
    prepare_home(work, args.storage)
    config = make_dataset(work, args.shards)
    limit, skip = args.step_limit, set(args.skip.split(","))

    import dagster as dg

    from shardprep.config import load_config
    from shardprep.layout import Layout
    from shardprep.ledger import load_ledger
    from shardprep.versions import artifact_versions
    from shardprep_dagster.orchestration.instance import get_instance
    from shardprep_dagster.orchestration.launch import launch
    from shardprep_dagster.orchestration.runner import make_plan
    from shardprep_dagster.orchestration.status import asset_statuses, load_defs

    instance = get_instance()
    keys = load_ledger(Layout(load_config(str(config)).output_root)).keys()
    register(instance, keys, results)

    defs = timed(results, "build_defs (code location)", load_defs, str(config))
    graph = defs.resolve_asset_graph()
    shard_keys = [k for k in graph.toposorted_asset_keys
                  if graph.get(k).partitions_def is not None and graph.get(k).is_materializable]
    versions = artifact_versions(load_config(str(config)))
    missing = set(random.Random(0).sample(keys, round(len(keys) * (1 - args.materialized))))
    present = [k for k in keys if k not in missing]
    populate(instance, shard_keys, versions, present, results)
    results["per-shard assets"] = len(shard_keys)

    statuses = timed(results, "3a status (cold: builds Dagster's status cache)", asset_statuses, instance, defs,
                     limit=limit)
    timed(results, "3b status (warm)", asset_statuses, instance, defs, limit=limit)
    if statuses:
        results["status: materialized of first asset"] = statuses[0].materialized
    plan = timed(results, "4 make_plan (1% missing)", make_plan, str(config), instance, limit=limit)
    if plan:
        assert len(plan.todo_shards()) == len(missing), (len(plan.todo_shards()), len(missing))

    def tick():
        return dg.evaluate_automation_conditions(defs, instance)

    result = None
    if "automation" not in skip:
        result = timed(results, "6a automation tick (first, no cursor)", tick, limit=limit)
    if result is not None:
        results["automation: requested"] = result.total_requested
        timed(results, "6b automation tick (second, with cursor)", dg.evaluate_automation_conditions, defs,
              instance, cursor=result.cursor, limit=limit)

    def source_tick():
        from shardprep_dagster.resources.dataset import DatasetResource
        from shardprep_dagster.sensors.new_source_files import detect_new_source_files

        context = dg.build_sensor_context(instance=instance)
        return detect_new_source_files(context, DatasetResource(config_path=str(config)))

    timed(results, "6c new_source_files sensor tick (nothing new)", source_tick, limit=limit)

    with workspace(instance) as ctx:
        asset = shard_keys[-1]
        data = None
        if "ui" not in skip:
            data = timed(results, "7a UI PartitionHealthQuery", graphql, ctx, PARTITION_HEALTH, asset, limit=limit)
        if data:
            got = data["assetNodeOrError"]["assetPartitionStatuses"]["materializedPartitions"]
            results["UI: materialized partitions returned"] = len(got)
        if "ui" not in skip:
            timed(results, "7b UI partitionStats", graphql, ctx, PARTITION_STATS, asset, limit=limit)
        if "launch" in skip:
            return

        todo = sorted(missing)[:LAUNCH_SHARDS]
        pairs = {k: set(todo) for k in shard_keys}
        timed(results, f"5a launch backfill ({len(todo)} shards x {len(shard_keys)} assets)", launch, instance,
              pairs, tags={}, title="bench", limit=limit)
        timed(results, "5b one backfill daemon iteration", backfill_iteration, ctx, limit=limit)
        results["runs queued by the iteration"] = instance.get_runs_count()


if __name__ == "__main__":
    sys.exit(main())
