"""What a run has to do: the (asset, shard) pairs whose latest materialization is missing or was made at
another version than the config's (``shardprep.versions``).

Every asset reports its version as the data version of what it materializes (``assets.shard_runs``):
the one tag Dagster indexes per partition, so finding the current partitions is one query per asset
whatever the number of shards. It is the version of the config the run executed, which may differ
from the code location's (a run tagged ``shardprep/config``); the code location also shows its own
config's versions as code versions in the UI.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG
from dagster._core.event_api import EventLogRecord
from dagster._core.events import DagsterEventType

from shardprep import state
from shardprep.config import DatasetConfig
from shardprep.keys import partition_key
from shardprep.layout import Layout
from shardprep.ledger import Registration, load_ledger


def current_partitions(instance: dg.DagsterInstance, key: dg.AssetKey, version: str | None) -> set[str]:
    """Partitions of ``key`` whose latest materialization was made at ``version`` (any version when
    ``version`` is None: an unversioned code location)."""
    if version is None:
        return set(instance.get_materialized_partitions(key))
    tags = instance.event_log_storage.get_latest_tags_by_partition(
        key, DagsterEventType.ASSET_MATERIALIZATION, [DATA_VERSION_TAG])
    return {p for p, t in tags.items() if t.get(DATA_VERSION_TAG) == version}


def latest_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The version an unpartitioned asset's latest materialization was made at (None: never)."""
    return _version(latest_materializations(instance, [key])[key])


def latest_materializations(instance: dg.DagsterInstance,
                            keys: list[dg.AssetKey]) -> dict[dg.AssetKey, EventLogRecord | None]:
    """The latest materialization of each of ``keys`` (None: never), from one read of their asset records:
    what Dagster keeps per asset, where two queries per key (its latest event, then its latest record) cost
    ~14 ms a key on 2 cores, between the last shard and the unpartitioned assets and again at the end of
    every run (bench/E2E.md). For unpartitioned assets, which one run at a time materializes (a partitioned
    asset's record is written by many runs at once: ``newest_materialization`` reads its events instead)."""
    entries = {r.asset_entry.asset_key: r.asset_entry for r in instance.get_asset_records(list(keys))}
    return {k: entries[k].last_materialization_record if k in entries else None for k in keys}


def _version(record: EventLogRecord | None) -> str | None:
    materialization = record.asset_materialization if record is not None else None
    return None if materialization is None else materialization.tags.get(DATA_VERSION_TAG, "")


def _at_version(key: dg.AssetKey, record: EventLogRecord | None, versions: dict[str, str]) -> bool:
    """Whether ``record`` (``key``'s latest materialization, None: never) was made at the config's version."""
    return _version(record) == versions.get(key.path[-1])


def todo_by_shard(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey], versions: dict[str, str],
                  shards: list[str]) -> dict[str, list[dg.AssetKey]]:
    """``{shard: [asset keys to materialize]}`` for every shard, in ``asset_keys`` order."""
    todo: dict[str, list[dg.AssetKey]] = {s: [] for s in shards}
    for k in asset_keys:
        # one set difference per asset, not a lookup per (shard, asset): LAION-5B has 580,000 shards
        for s in todo.keys() - current_partitions(instance, k, versions.get(k.path[-1])):
            todo[s].append(k)
    return todo


def incomplete_shards(cfg: DatasetConfig, versions: dict[str, str], names: list[str]) -> dict[str, list[str]]:
    """``state.incomplete`` of the config's output root (``{shard: [asset]}``)."""
    layout = Layout(cfg.output_root)
    ledger = load_ledger(layout)
    return state.incomplete(ledger, state.load(layout, names), versions) if ledger else {}


def stale_in_index(cfg: DatasetConfig, versions: dict[str, str], names: list[str]) -> dict[str, set[str]]:
    """``{partition: {asset}}`` holding a shard ``incomplete_shards`` names."""
    out: dict[str, set[str]] = {}
    for shard, assets in incomplete_shards(cfg, versions, names).items():
        # the config's sharding is the ledger's (checked at registration): no second ledger load
        block = partition_key(int(shard), cfg.shards_per_partition, cfg.oom_shard_count)
        out.setdefault(block, set()).update(assets)
    return out


def outdated_globals(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey],
                     versions: dict[str, str]) -> list[dg.AssetKey]:
    """Unpartitioned assets never materialized, or last materialized at another version."""
    latest = latest_materializations(instance, asset_keys)
    return [k for k in asset_keys if not _at_version(k, latest[k], versions)]


def _latest_storage_id(instance: dg.DagsterInstance, key: dg.AssetKey) -> int | None:
    records = instance.fetch_materializations(key, limit=1).records
    return records[0].storage_id if records else None


def newest_materialization(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey]) -> int:
    """The storage id of the newest materialization of any of ``asset_keys`` (0: none)."""
    return max((i for i in map(lambda k: _latest_storage_id(instance, k), asset_keys) if i), default=0)


def current_globals(instance: dg.DagsterInstance, keys: list[dg.AssetKey], versions: dict[str, str],
                    after: int) -> set[dg.AssetKey]:
    """The unpartitioned ``keys`` last materialized at their version of ``versions``, after storage id ``after``."""
    latest = latest_materializations(instance, keys)
    return {k for k, record in latest.items()
            if record is not None and _at_version(k, record, versions) and record.storage_id > after}


def globals_needed(instance: dg.DagsterInstance, shard_keys: list[dg.AssetKey], global_keys: list[dg.AssetKey],
                   versions: dict[str, str], newest_shard: int | None = None) -> bool:
    """Whether the unpartitioned assets must run: one is outdated, or a shard was materialized after the
    oldest of their latest materializations (also after a crash between the shards and the global step).
    ``newest_shard``: ``newest_materialization(instance, shard_keys)``, when the caller has it."""
    if not global_keys:
        return False
    latest = latest_materializations(instance, global_keys)
    if not all(_at_version(k, latest[k], versions) for k in global_keys):
        return True
    if newest_shard is None:
        newest_shard = newest_materialization(instance, shard_keys)
    return newest_shard > min(latest[k].storage_id if latest[k] is not None else 0 for k in global_keys)


@dataclass
class Plan:
    """What a run works on: the config, its registered shards, the asset order and what is to do."""

    config_path: str
    cfg: DatasetConfig
    registration: Registration
    defs: dg.Definitions
    versions: dict[str, str]
    shard_keys: list[dg.AssetKey]  # per-shard assets, dependency order
    global_keys: list[dg.AssetKey]  # unpartitioned assets, dependency order
    todo: dict[str, list[dg.AssetKey]]  # shard -> assets missing or outdated
    rebuild: bool = False
    only: set[str] | None = None  # `run --shards`: the shards selected (None: all)
    only_spec: str | None = None  # ... as given, for the runs' tag

    @property
    def shards(self) -> list[str]:
        """The Dagster partitions: shards, or blocks of them (``shards_per_partition``)."""
        return self.registration.partitions or self.registration.all_keys

    def todo_shards(self) -> list[str]:
        return [s for s in self.shards if (self.rebuild or self.todo[s]) and self.selected(s)]

    def selected(self, partition: str) -> bool:
        """Whether ``partition`` holds a shard of the ``run --shards`` selection (always, without one)."""
        return self.only is None or partition in self._selected_partitions

    @functools.cached_property
    def _selected_partitions(self) -> set[str]:
        return {partition_key(int(k), self.cfg.shards_per_partition, self.cfg.oom_shard_count) for k in self.only}

    def assets_to_do(self, shard: str) -> list[dg.AssetKey]:
        return self.shard_keys if self.rebuild else self.todo[shard]

    def replan(self, instance: dg.DagsterInstance) -> None:
        """What is to do: what Dagster has not materialized at the current version, and what the state
        index says is not complete (a partition's materialization may predate a shard of it)."""
        self.todo = todo_by_shard(instance, self.shard_keys, self.versions, self.shards)
        stale = stale_in_index(self.cfg, self.versions, [k.path[-1] for k in self.shard_keys])
        for partition, names in stale.items():
            if partition in self.todo:
                self.todo[partition] = [k for k in self.shard_keys
                                        if k in self.todo[partition] or k.path[-1] in names]
