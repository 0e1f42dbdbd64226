"""Dagster at LAION-scale shard counts: what shardprep's planning, status, launching, automation and the
UI's partition page cost with N shards in Dagster partitions of K shards (``shards_per_partition``), on
the embedded SQLite instance or PostgreSQL.

    python bench/partitions.py --shards 600000 --shards-per-partition 100 --storage sqlite|postgres
        [--materialized 0.99] [--missing scattered|blocks] [--profile]

Builds a synthetic dataset (128 tiny source files, as LAION-2B-en ships 128 parquet files, and a
ledger giving them N shards in blocks of K: nothing is downloaded), a fresh instance (a new DAGSTER_HOME
with the checkout's dagster.yaml, or dagster.postgres.yaml pointed at a database of its own, dropped at
the end), then times each step and prints a JSON object and a markdown table.

What is missing: ``1 - --materialized`` of the shards (1%), drawn one by one (``--missing scattered``,
the default: with blocks of 100 most blocks hold one) or as whole blocks (``--missing blocks``). The
two sides agree, as a run leaves them: the state index (``shardprep.state``) has a row per present
shard at its artifact's version; Dagster has a materialization of each partition (block) all of whose
shards are present (a block with a failed shard is not materialized: ``assets.shard_runs``).

Populating Dagster: the first events go through ``instance.report_runless_asset_event`` (timed, to
extrapolate); the rest are copies of the event row Dagster wrote for that asset, the partition
replaced, bulk-inserted into the index's ``event_logs`` and ``asset_event_tags`` tables (the two
tables every read below uses). SQLite's per-run event shards are not written: no read here uses
them. Only materializations are written (no planned events, no runs), so nothing is failed or in
progress. The last event of each asset goes through Dagster again, so the asset record is current.

Populating the state index: each artifact's table is written directly (``state.SCHEMA``, one row per
present shard, outputs ``{}``) with the index's meta file, as ``state.ensure`` leaves it, instead of
millions of stamps and journal entries.

``shardprep status`` is timed as the real command in a subprocess (whole process: imports included).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))

SOURCE_FILES = 128  # LAION-2B-en's parquet files
SAMPLES_PER_SHARD = 10_000
SAMPLED_EVENTS = 200  # events written one by one through Dagster, to extrapolate from
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
        if _expired:  # the step's code caught the stop (e.g. in a thread pool's wait) and went on to the end
            results[step] = f"{results[step]} (ran past the {limit} s limit: the stop was swallowed)"
        return out
    except Exception:
        if not _expired:
            raise
        results[step] = f"> {limit} (stopped)"
        return None
    finally:
        signal.alarm(0)
        print(f"  {step}: {results[step]}", file=sys.stderr, flush=True)


def profiled(results: dict, step: str, fn, *args, top: int = 5, **kwargs):
    """Run ``fn`` under cProfile; record its ``top`` functions by own time (and print 15 to stderr)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn(*args, **kwargs)
    finally:
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(25)
    print(f"---- profile: {step}\n{out.getvalue()}", file=sys.stderr, flush=True)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # (file, line, fn) -> (cc, nc, tt, ct, ..)
    results[f"profile {step} (top {top} by own time: function, calls, own s, cumulative s)"] = [
        f"{Path(f).name}:{line} {name}, {nc}, {tt:.2f}, {ct:.2f}" for (f, line, name), (cc, nc, tt, ct, _) in rows]


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


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


def make_dataset(work: Path, n: int, per_partition: int) -> Path:
    """Source files, config and a ledger of ``n`` shards spread over the files, in Dagster partitions of
    ``per_partition`` shards (as registration would write it: the files' fingerprints match, so a run
    registers nothing new)."""
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
    # shard_key pads to oom_shard_count digits: LAION-5B's 580,000 shards need 6 (a block's last id too)
    oom = max(5, len(str(n - 1 + per_partition)))
    config = work / "shardprep.yaml"
    config.write_text(f"source: {src}/*.parquet\noutput_root: {out}\noom_shard_count: {oom}\n"
                      f"samples_per_shard: {SAMPLES_PER_SHARD}\nshards_per_partition: {per_partition}\n")
    files, first = [], 0
    for i, url in enumerate(list_source_files(f"{src}/*.parquet")):
        count = n // SOURCE_FILES + (i < n % SOURCE_FILES)
        rows = count * SAMPLES_PER_SHARD
        files.append({"source": url, "fingerprint": file_fingerprint(url), "rows": rows, "columns": ["url", "caption"],
                      "digest": None, "segments": [{"first_shard": first, "num_shards": count, "row_start": 0,
                                                    "row_stop": rows}]})
        first += count
    (out / "ledger.json").write_text(json.dumps({"version": LEDGER_VERSION, "samples_per_shard": SAMPLES_PER_SHARD,
                                                 "oom_shard_count": oom, "shards_per_partition": per_partition,
                                                 "files": files}))
    os.environ["SHARDPREP_CONFIG"] = str(config)  # the code location the UI and daemons load serves it
    return config


def choose_missing(shards: list[str], partition_of: dict[str, str], share: float, how: str) -> set[str]:
    """The shards not materialized: ``share`` of them, one by one or as whole partitions (blocks)."""
    rng = random.Random(0)
    if how == "scattered":
        return set(rng.sample(shards, round(len(shards) * share)))
    partitions = list(dict.fromkeys(partition_of.values()))
    chosen = set(rng.sample(partitions, max(1, round(len(partitions) * share))))
    return {s for s in shards if partition_of[s] in chosen}


def write_state_index(config: Path, shards: list[str], missing: set[str]) -> dict[str, int]:
    """The state index as runs leave it: per artifact one table (``state.SCHEMA``) with a row per present
    shard at the artifact's version (image artifacts: every shard is an image shard here), the
    unpartitioned artifacts' ``_all`` row, and the meta file ``state.ensure`` writes; no journal."""
    import pyarrow as pa

    from shardprep import state
    from shardprep.artifacts import ARTIFACTS, enabled
    from shardprep.config import load_config
    from shardprep.layout import Layout
    from shardprep.storage import write_bytes, write_parquet
    from shardprep.versions import ALL_SHARDS, artifact_versions

    cfg = load_config(str(config))
    layout, versions = Layout(cfg.output_root), artifact_versions(cfg)
    present = [s for s in shards if s not in missing]  # id order: zero-padded keys, so sorted too
    now = time.time()
    rows = {}
    for name, record in ARTIFACTS.items():
        if not enabled(name, cfg) or not record.applies("image"):
            continue  # video artifacts have no row for an image shard (materialized as "not applicable")
        keys = present if record.partitioned else [ALL_SHARDS]
        n = len(keys)
        table = pa.Table.from_arrays([
            pa.array(keys, pa.string()), pa.array([versions[name]] * n, pa.string()),
            pa.array([now] * n, pa.float64()), pa.array(["{}"] * n, pa.string()), pa.nulls(n, pa.string()),
            pa.nulls(n, pa.float64()), pa.nulls(n, pa.float64()), pa.nulls(n, pa.string())], schema=state.SCHEMA)
        write_parquet(layout.state_table(name), table)
        rows[name] = n
    write_bytes(state._meta_url(layout), json.dumps({"format": state.FORMAT, "rebuilt_at": now}).encode("utf-8"))
    return rows


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
    """The ledger's partition keys into the instance (``register_partitions``, 10k chunks); with more
    than 10 chunks, first a call that dies after 30% of them."""
    from shardprep_dagster.orchestration.runner import SHARD_PARTITIONS, register_partitions

    chunks = len(keys) // 10_000 * 3 // 10  # 30% of the chunks, then the process dies
    if chunks:
        start = time.perf_counter()
        try:
            register_partitions(CrashAfter(instance, chunks), keys)
        except Crash:
            pass
        results["1a register: crash at 30%"] = round(time.perf_counter() - start, 2)
    step = "1b register: full call after the crash" if chunks else "1b register: all partitions"
    added = timed(results, step, register_partitions, instance, keys)
    assert added == len(keys) - chunks * 10_000, added
    assert timed(results, "1c register: re-run (adds nothing)", register_partitions, instance, keys) == 0
    stored = timed(results, "1d get_dynamic_partitions", instance.get_dynamic_partitions, SHARD_PARTITIONS)
    assert list(stored) == keys, "the instance's partitions differ from the ledger's keys"


# ---------------------------------------------------------------- step 2: populating


def materialize_one(instance, key, partition: str, version: str) -> None:
    import dagster as dg
    from dagster._core.definitions.data_version import CODE_VERSION_TAG, DATA_VERSION_TAG

    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset_key=key, partition=partition, tags={DATA_VERSION_TAG: version, CODE_VERSION_TAG: version},
        metadata={**METADATA, "version": version}))


def bulk_copy(instance, key, partitions: list[str], batch: int = 20_000) -> None:
    """Copies of the asset's latest event row for ``partitions``, with their data-version tag rows."""
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
    for i in range(0, len(partitions), batch):
        part = partitions[i:i + batch]
        with instance.event_log_storage.index_connection() as conn:
            last = conn.execute(db.select(db.func.max(Events.c.id))).scalar() or 0
            conn.execute(Events.insert(), [{**base, "partition": s, "event": f'{head}"{s}"{tail}'} for s in part])
            ids = conn.execute(db.select(Events.c.id).where(Events.c.id > last, Events.c.asset_key == base["asset_key"])
                               .order_by(Events.c.id)).scalars().all()
            assert len(ids) == len(part)
            same = {c: tag[c] for c in ("asset_key", "key", "value", "event_timestamp")}
            conn.execute(Tags.insert(), [{**same, "event_id": e} for e in ids])


def populate(instance, shard_keys, versions: dict, present: list[str], results: dict) -> None:
    """A materialization of each partition in ``present`` for each of ``shard_keys``."""
    sample = present[:min(SAMPLED_EVENTS, len(present) // 2)]
    start = time.perf_counter()
    for partition in sample:
        materialize_one(instance, shard_keys[0], partition, versions[shard_keys[0].path[-1]])
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


# ---------------------------------------------------------------- step 3: `shardprep status`


def status_command(config: Path, limit: int) -> str:
    """The real ``shardprep status`` in its own process (what a user waits for: imports included)."""
    out = subprocess.run([str(CHECKOUT / ".venv" / "bin" / "shardprep"), "status", "--config", str(config)],
                         capture_output=True, text=True, timeout=limit, env=dict(os.environ))
    if out.returncode:
        raise RuntimeError(f"shardprep status failed ({out.returncode}): {out.stderr[-3000:]}")
    return out.stdout


def status_counts(table: str) -> dict[str, int]:
    """``{asset: materialized}`` of the per-shard assets in ``shardprep status``'s table."""
    out = {}
    for line in table.splitlines()[1:]:
        cells = line.split()
        if len(cells) >= 7 and cells[1].isdigit():
            out[cells[0]] = int(cells[1])
    return out


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

    from shardprep_dagster.orchestration.queue_daemon import one_planned_event_per_asset

    one_planned_event_per_asset()  # as `shardprep run`'s daemon does (set it to 0 to see Dagster's default)

    for error in execute_backfill_iteration(ctx, logging.getLogger("backfill")):
        if error is not None:
            raise RuntimeError(error.to_string())


# ---------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--shards-per-partition", type=int, default=1,
                        help="the config's shards_per_partition: Dagster partitions are blocks of this many shards")
    parser.add_argument("--storage", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--materialized", type=float, default=0.99, help="share of shards materialized")
    parser.add_argument("--missing", choices=["scattered", "blocks"], default="scattered",
                        help="the shards not materialized: drawn one by one, or as whole blocks")
    parser.add_argument("--step-limit", type=int, default=300, help="seconds before a step is stopped")
    parser.add_argument("--automation-limit", type=int, default=120, help="seconds before an automation tick is stopped")
    parser.add_argument("--skip", default="", help="steps not to run, comma-separated: automation,ui,launch,sensor")
    parser.add_argument("--profile", action="store_true", help="also profile make_plan and status in this process")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and database")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix=f"partitions-{args.storage}-{args.shards}-{args.shards_per_partition}-"))
    results: dict = {"shards": args.shards, "shards_per_partition": args.shards_per_partition,
                     "storage": args.storage, "missing": args.missing,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load average at start": load_average()}
    try:
        run(args, work, results)
    finally:
        results["load average at end"] = load_average()
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
    config = make_dataset(work, args.shards, args.shards_per_partition)
    limit, skip = args.step_limit, set(args.skip.split(","))

    import dagster as dg

    from shardprep.config import load_config
    from shardprep.layout import Layout
    from shardprep.ledger import load_ledger
    from shardprep.versions import artifact_versions
    from shardprep_dagster.definitions import build_defs
    from shardprep_dagster.orchestration.instance import get_instance
    from shardprep_dagster.orchestration.launch import launch
    from shardprep_dagster.orchestration.runner import make_plan
    from shardprep_dagster.orchestration.status import asset_statuses

    instance = get_instance()
    ledger = load_ledger(Layout(load_config(str(config)).output_root))
    shards, partitions = ledger.keys(), ledger.partition_keys()
    partition_of = {s: ledger.partition_of(s) for s in shards}
    results["partitions"] = len(partitions)
    register(instance, partitions, results)

    defs = timed(results, "build_defs (code location)", build_defs, str(config))
    graph = defs.resolve_asset_graph()
    shard_keys = [k for k in graph.toposorted_asset_keys
                  if graph.get(k).partitions_def is not None and graph.get(k).is_materializable]
    versions = artifact_versions(load_config(str(config)))
    missing = choose_missing(shards, partition_of, 1 - args.materialized, args.missing)
    todo = {partition_of[s] for s in missing}  # partitions holding a missing shard: not materialized
    present = [p for p in partitions if p not in todo]
    results["shards missing"], results["partitions to do"] = len(missing), len(todo)
    populate(instance, shard_keys, versions, present, results)
    results["per-shard assets"] = len(shard_keys)
    rows = timed(results, "2e state index written (tables + meta)", write_state_index, config, shards, missing)
    results["index rows per image artifact"] = max(rows.values())

    out = timed(results, "3a `shardprep status` subprocess (first)", status_command, config, limit, limit=limit)
    if out:
        counts = status_counts(out)
        results["status: materialized source_parquet"] = counts.get("source_parquet")
        assert counts.get("source_parquet") == len(shards) - len(missing), out
    timed(results, "3b `shardprep status` subprocess (again)", status_command, config, limit, limit=limit)
    timed(results, "3c asset_statuses in process", asset_statuses, str(config), limit=limit)
    plan = timed(results, "4 make_plan (1% of shards missing)", make_plan, str(config), instance, limit=limit)
    if plan:
        assert set(plan.todo_shards()) == todo, (len(plan.todo_shards()), len(todo))
    if args.profile:
        profiled(results, "make_plan", make_plan, str(config), instance)
        profiled(results, "asset_statuses", asset_statuses, str(config))

    def tick():
        return dg.evaluate_automation_conditions(defs, instance)

    result = None
    if "automation" not in skip:
        result = timed(results, "6a automation tick (first, no cursor)", tick, limit=args.automation_limit)
    if result is not None:
        results["automation: requested"] = result.total_requested
        timed(results, "6b automation tick (second, with cursor)", dg.evaluate_automation_conditions, defs,
              instance, cursor=result.cursor, limit=args.automation_limit)

    def source_tick():
        from shardprep_dagster.resources.dataset import DatasetResource
        from shardprep_dagster.sensors.new_source_files import detect_new_source_files

        context = dg.build_sensor_context(instance=instance)
        return detect_new_source_files(context, DatasetResource(config_path=str(config)))

    if "sensor" not in skip:
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

        # what `shardprep run` launches for this plan: every (asset, partition) to do, with blocks the
        # complete blocks between them filled in (orchestration.queued._shard_pairs)
        if plan:
            from shardprep_dagster.orchestration.queued import _shard_pairs

            pairs = _shard_pairs(plan, plan.todo_shards())
        else:
            pairs = {k: set(todo) for k in shard_keys}
        results["backfill partitions (filled)"] = max(map(len, pairs.values()), default=0)
        timed(results, f"5a launch backfill ({len(todo)} partitions x {len(pairs)} assets)", launch, instance,
              pairs, tags={}, title="bench", limit=limit)
        timed(results, "5b one backfill daemon iteration (submits runs)", backfill_iteration, ctx, limit=limit)
        results["runs submitted by the iteration"] = instance.get_runs_count()


if __name__ == "__main__":
    sys.exit(main())
