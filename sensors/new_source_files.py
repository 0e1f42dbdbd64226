"""new_source_files: a parquet file appearing under the configured source becomes new shard partitions."""

import json
import os

import dagster as dg

from assets import shard_partitions, source_parquet
from resources.dataset import DatasetResource
from shardprep.ledger import load_ledger, register_sources
from shardprep.sources import SourceError, list_source_files

MAX_PARTITION_ADDS_PER_TICK = 25_000  # Dagster's limit per sensor evaluation
# Seconds between ticks (the daemon itself wakes every 5 s); tests and demos can set it lower.
SENSOR_INTERVAL = int(os.environ.get("SHARDPREP_SENSOR_INTERVAL", "30"))


# Runs materialize source_parquet; declarative automation carries each shard through the rest.
@dg.sensor(target=source_parquet, minimum_interval_seconds=SENSOR_INTERVAL,
           default_status=dg.DefaultSensorStatus.RUNNING)
def new_source_files(context: dg.SensorEvaluationContext, dataset: DatasetResource):
    """Lists the source (any fsspec URL) and gives new files shard ids through the ledger; requests one
    run per new shard (run_key = shard, so a replayed tick launches nothing twice). A file rewritten
    after registration is reported, never re-sharded; a bad file is reported and the others go on."""
    cfg = dataset.config
    cursor = json.loads(context.cursor) if context.cursor else {}
    try:
        files = list_source_files(cfg.source)
    except SourceError as e:
        return dg.SkipReason(str(e))
    # the cursor remembers what was already reported, so each problem is logged once, not every tick
    bad: dict[str, str] = {u: m for u, m in cursor.get("bad", {}).items() if u in files}
    reported_changed = [u for u in cursor.get("changed", []) if u in files]

    errors, changed = [], []
    for url in files:  # one at a time, so one bad file does not hold back the others
        try:
            reg = register_sources(cfg, source_files=[url])
            changed += reg.changed_sources
            bad.pop(url, None)
        except SourceError as e:
            if bad.get(url) != str(e):
                errors.append(str(e))
            bad[url] = str(e)
    for msg in errors:
        context.log.error(msg)
    rewritten = [f"source file {url} changed after its shards were assigned (not re-sharded)"
                for url in changed if url not in reported_changed]
    for msg in rewritten:
        context.log.warning(msg)
    problems = errors + rewritten
    cursor = {"bad": bad, "changed": sorted(set(reported_changed) | set(changed))}

    ledger = load_ledger(dataset.layout)
    known = set(context.instance.get_dynamic_partitions(shard_partitions.name))
    new_keys = [k for k in (ledger.keys() if ledger else []) if k not in known][:MAX_PARTITION_ADDS_PER_TICK]
    if not new_keys:
        return dg.SensorResult(skip_reason=dg.SkipReason("no new shards" + (
            f"; {len(problems)} source file problem(s): " + " | ".join(problems) if problems else "")),
            cursor=json.dumps(cursor))
    return dg.SensorResult(
        dynamic_partitions_requests=[shard_partitions.build_add_request(new_keys)],
        run_requests=[dg.RunRequest(partition_key=k, run_key=k) for k in new_keys],
        cursor=json.dumps(cursor),
    )
