"""source_parquet: each shard's rows, copied out of the source files and checked."""

import time

import dagster as dg
import pyarrow.parquet as pq

from shardprep.ledger import load_ledger
from shardprep.sources import SourceError, read_rows, required_columns
from shardprep.storage import atomic_write
from shardprep_dagster.assets.shard_runs import ShardRunConfig, from_record, materialize_shards
from shardprep_dagster.resources.dataset import DatasetResource


@dg.asset(
    **from_record("source_parquet"),
    kinds={"parquet"},
)
def source_parquet(context: dg.AssetExecutionContext, config: ShardRunConfig,
                   dataset: DatasetResource) -> dg.MaterializeResult:
    """The input rows of each shard (url, caption and every other source column), as
    ``<root>/parquet/{shard}.parquet``. Rows come from the ledger's fixed assignment."""
    cfg, layout = dataset.config, dataset.layout
    ledger = load_ledger(layout)
    if ledger is None:
        raise dg.Failure(f"no shard ledger at {layout.ledger}: register the source files first")

    def describe(key: str) -> dict:
        shard = ledger.shard(key)
        return {"source": shard.source, "row_start": shard.row_start, "row_stop": shard.row_stop,
                "rows": shard.rows, "path": dg.MetadataValue.path(layout.source_parquet(key))}

    def copy_rows(key: str) -> dict:
        shard = ledger.shard(key)
        t0 = time.time()
        table = read_rows(shard.source, shard.row_start, shard.row_stop)
        if table.num_rows != shard.rows:
            raise SourceError(f"source file {shard.source}: shard {key} should hold rows "
                              f"[{shard.row_start}, {shard.row_stop}) but the file now has fewer rows; "
                              "it changed after registration")
        for field_name, col in required_columns(cfg, shard.media):
            if col not in table.column_names:
                raise SourceError(f"source file {shard.source}: column {col!r} (config field "
                                  f"'{field_name}') is missing")
        with atomic_write(layout.source_parquet(key)) as f:
            pq.write_table(table, f)
        return {**describe(key), "status": "written", "seconds": round(time.time() - t0, 3)}

    return materialize_shards(context, dataset, "source_parquet", copy_rows, rebuild=config.rebuild,
                              describe=describe)
