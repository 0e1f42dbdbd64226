"""new_source_files: a parquet file appearing under the configured source becomes new shard partitions
(new blocks of shards, or shards added to the open last block, with ``shards_per_partition``)."""

import json

import dagster as dg

from shardprep import state
from shardprep.ledger import SourceChangedError, load_ledger, register_sources
from shardprep.sources import SourceError, file_fingerprint, list_all_source_files
from shardprep_dagster.assets import shard_partitions, source_parquet
from shardprep_dagster.resources.dataset import DatasetResource

MAX_PARTITION_ADDS_PER_TICK = 25_000  # Dagster's limit per sensor evaluation


def detect_new_source_files(context: dg.SensorEvaluationContext, dataset: DatasetResource):
    """Lists the source (any fsspec URL) and gives new files, and rows appended to known ones, shard ids
    through the ledger; requests one run per new shard (run_key = shard, so a replayed tick launches
    nothing twice). A file rewritten or shrunk after registration is reported once with the command
    that re-shards it; a bad file is reported and the others go on."""
    cfg = dataset.config
    cursor = json.loads(context.cursor) if context.cursor else {}
    try:
        files = list_all_source_files(cfg)  # {url: media}, images and videos
    except SourceError as e:
        return dg.SkipReason(str(e))
    # the cursor remembers what was already reported, so each problem is logged once, not every tick
    bad: dict[str, str] = {u: m for u, m in cursor.get("bad", {}).items() if u in files}
    # rewritten files: url -> fingerprint when reported (an older cursor holds a list: report those again)
    changed_before = cursor.get("changed", {})
    changed: dict[str, str] = {u: f for u, f in changed_before.items() if u in files} \
        if isinstance(changed_before, dict) else {}

    # a rewritten file still as reported is not checked again: that reads its rows and copies
    todo = [u for u in files if not (u in changed and _fingerprint(u) == changed[u])]
    # all files in one registration while none is bad (a call per file loads the whole ledger each
    # time: 30,000 times a tick for LAION); one at a time otherwise, so a bad file holds back no other
    batch = [u for u in todo if u not in bad]
    grown: list[str] = []  # shard keys registered this tick
    try:
        grown += register_sources(cfg, source_files={u: files[u] for u in batch},
                                  config_path=dataset.config_path).new_keys
        for url in batch:
            changed.pop(url, None)
        todo = [u for u in todo if u in bad]
    except (SourceError, SourceChangedError):
        pass  # nothing was registered: the files go one at a time below
    errors, rewritten = [], []
    for url in todo:
        try:
            grown += register_sources(cfg, source_files={url: files[url]}, config_path=dataset.config_path).new_keys
            bad.pop(url, None)
            changed.pop(url, None)
        except SourceChangedError as e:
            rewritten.append(str(e))
            changed[url] = e.fingerprint
        except SourceError as e:
            if bad.get(url) != str(e):
                errors.append(str(e))
            bad[url] = str(e)
    for msg in errors:
        context.log.error(msg)
    for msg in rewritten:
        context.log.warning(msg)
    problems = errors + rewritten
    cursor = {"bad": bad, "changed": changed}

    ledger = load_ledger(dataset.layout)
    if ledger is not None and ledger.shards_per_partition == 1:
        # the journal of the steps' stamps, folded into the state index (with shard blocks the shard_work
        # sensor does it): driven from the UI alone, nothing else would keep it short
        state.fold(dataset.layout)
    known = set(context.instance.get_dynamic_partitions(shard_partitions.name))
    new_keys = [k for k in (ledger.partition_keys() if ledger else []) if k not in known][:MAX_PARTITION_ADDS_PER_TICK]
    # a block already known that gained shards this tick runs again (for its new shards only)
    grown_blocks = list(dict.fromkeys(ledger.partition_of(k) for k in grown)) if ledger else []
    requested = list(dict.fromkeys(new_keys + [p for p in grown_blocks if p in known]))
    if not requested:
        return dg.SensorResult(skip_reason=dg.SkipReason("no new shards" + (
            f"; {len(problems)} source file problem(s): " + " | ".join(problems) if problems else "")),
            cursor=json.dumps(cursor))
    return dg.SensorResult(
        dynamic_partitions_requests=[shard_partitions.build_add_request(new_keys)] if new_keys else [],
        # run_key: a block's run is asked for again only when its last shard is a new one
        run_requests=[dg.RunRequest(partition_key=p, run_key=p if ledger.shards_per_partition == 1
                                    else f"{p}@{ledger.partition_shards(p)[-1]}") for p in requested],
        cursor=json.dumps(cursor),
    )


def _fingerprint(url: str) -> str | None:
    try:
        return file_fingerprint(url)
    except SourceError:
        return None  # gone since listed: register_sources reports it


def new_source_files_sensor(interval: int = 30) -> dg.SensorDefinition:
    """The sensor, ticking every ``interval`` seconds (the daemon itself wakes every 5 s). Its runs
    materialize source_parquet; declarative automation carries each shard through the rest."""

    @dg.sensor(name="new_source_files", target=dg.AssetSelection.assets(source_parquet.key), minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING, description=detect_new_source_files.__doc__)
    def new_source_files(context: dg.SensorEvaluationContext, dataset: DatasetResource):
        return detect_new_source_files(context, dataset)

    return new_source_files


new_source_files = new_source_files_sensor()
