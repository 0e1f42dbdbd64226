"""`shardprep reshard`: settle a source file rewritten or shrunk after its shards were assigned.

The core (``shardprep.ledger.reshard_source``) decides which shards changed and removes their copies;
here their Dagster materializations of every per-shard asset are wiped (so `shardprep run`, status
and backfills see them as missing and redo them) and new shards become dynamic partitions."""

from __future__ import annotations

from typing import Sequence

import dagster as dg

from shardprep.artifacts import PER_SHARD
from shardprep.config import config_url, load_config
from shardprep.layout import Layout
from shardprep.ledger import ReshardResult, load_ledger, reshard_source
from shardprep_dagster.orchestration.invalidate import invalidate

PARTITION_ADD_CHUNK = 10_000  # dynamic partitions added per call


def _chunks(items: Sequence[str], size: int):
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


def reshard(config_path: str, source_url: str, instance: dg.DagsterInstance | None = None) -> ReshardResult:
    """Re-shard one source file (``shardprep reshard --config CONFIG --source URL``): shards whose rows
    changed lose their materializations of every per-shard asset, new shards become partitions.
    ``instance``: the Dagster instance (default: the CLI's, at $DAGSTER_HOME)."""
    from shardprep_dagster.assets import shard_partitions

    if instance is None:
        from shardprep_dagster.orchestration.instance import get_instance

        instance = get_instance()
    cfg = load_config(config_url(config_path))

    def wipe(shards: list[str]) -> None:
        invalidate(instance, Layout(cfg.output_root), list(PER_SHARD), shards)

    result = reshard_source(cfg, source_url, on_invalidated=wipe)
    ledger = load_ledger(Layout(cfg.output_root))
    known = set(instance.get_dynamic_partitions(shard_partitions.name))
    new = [p for p in dict.fromkeys(ledger.partition_of(k) for k in result.new_keys) if p not in known]
    for chunk in _chunks(new, PARTITION_ADD_CHUNK):
        instance.add_dynamic_partitions(shard_partitions.name, chunk)
    return result
