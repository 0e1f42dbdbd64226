"""Invalidating (asset, shard) pairs so that `shardprep run`, status, backfills and the UI see them as
missing and redo them: a re-sharded source file's changed shards, outputs `verify` found broken. Their
materializations are forgotten and their version stamps removed (else a run would find the outputs
"complete" and skip them).

Dagster 1.13's SQL event logs (SQLite, Postgres) do not implement ``wipe_asset_partitions`` ("not
supported yet"); for them the partitions' events are deleted from the event index here, the way
``wipe_asset`` deletes a whole asset's. This uses Dagster's storage internals: re-check it (the tests
do) when upgrading Dagster.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.versions import remove_stamp

WIPE_CHUNK = 900  # partitions per delete: SQLite builds before 3.32 bind at most 999 values in one statement


def _chunks(items: Sequence[str], size: int):
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


def _delete_partition_events(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partitions: list[str]) -> None:
    """What ``wipe_asset_partitions`` does on storages that implement it, for the SQL event logs (SQLite,
    Postgres) that do not: the partitions' asset events leave the event index (SQLite keeps them in
    each run's own log, as ``wipe_asset`` does), and the asset's cached partition status is dropped so
    it is recomputed without them."""
    from dagster._core.storage.event_log.schema import AssetEventTagsTable, SqlEventLogStorageTable
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
    from sqlalchemy import and_, select

    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage):
        raise NotImplementedError(f"cannot wipe partitions of {asset_key.to_user_string()} in a "
                                  f"{type(storage).__name__}")
    events = SqlEventLogStorageTable.c
    with storage.index_connection() as conn:
        for chunk in _chunks(partitions, WIPE_CHUNK):
            where = and_(events.asset_key == asset_key.to_string(), events.partition.in_(chunk))
            conn.execute(AssetEventTagsTable.delete().where(
                AssetEventTagsTable.c.event_id.in_(select(events.id).where(where))))
            conn.execute(SqlEventLogStorageTable.delete().where(where))
        _point_at_latest_materialization(conn, asset_key)
    storage.wipe_asset_cached_status(asset_key)


def _point_at_latest_materialization(conn, asset_key: dg.AssetKey) -> None:
    """The asset's row keeps its latest materialization event (the UI's "latest materialization"):
    after a wipe it must name one that is still there, or none."""
    from dagster._core.events import DagsterEventType
    from dagster._core.storage.event_log.schema import AssetKeyTable, SqlEventLogStorageTable
    from dagster._serdes import deserialize_value, serialize_value
    from sqlalchemy import and_, func, select

    events = SqlEventLogStorageTable.c
    latest_id = conn.execute(select(func.max(events.id)).where(and_(
        events.asset_key == asset_key.to_string(),
        events.dagster_event_type == DagsterEventType.ASSET_MATERIALIZATION.value))).scalar()
    values = {"last_materialization": None}
    if latest_id is not None:
        row = conn.execute(select(events.event, events.run_id).where(events.id == latest_id)).one()
        entry = deserialize_value(row.event, dg.EventLogEntry)
        record = dg.EventLogRecord(storage_id=latest_id, event_log_entry=entry)
        values = {"last_materialization": serialize_value(record), "last_run_id": row.run_id}
    conn.execute(AssetKeyTable.update().values(**values).where(AssetKeyTable.c.asset_key == asset_key.to_string()))


def wipe_partitions(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partitions: list[str]) -> None:
    """Forget every materialization of ``partitions`` of ``asset_key``."""
    try:
        for chunk in _chunks(partitions, WIPE_CHUNK):
            instance.wipe_asset_partitions(asset_key, chunk)
    except NotImplementedError:  # Dagster's own SQL event logs (1.13): "not supported yet"
        _delete_partition_events(instance, asset_key, partitions)


def invalidate(instance: dg.DagsterInstance, layout: Layout, assets: list[str], shards: list[str]) -> None:
    """Forget that ``shards`` of each asset in ``assets`` are materialized: the stamps first (outputs are
    never trusted again), then the Dagster materializations of their partitions (a block's: its other
    shards keep their stamps, so the block's next run does only these)."""
    ledger = load_ledger(layout)
    partitions = list(dict.fromkeys(ledger.partition_of(s) for s in shards)) \
        if ledger is not None and ledger.shards_per_partition > 1 else shards
    for asset in assets:
        for shard in shards:
            remove_stamp(layout, asset, shard)
        wipe_partitions(instance, dg.AssetKey(asset), partitions)
