"""What a run has to do: the (asset, shard) pairs whose latest materialization is missing or was made at
another version than the config's (``shardprep.versions``).

Every asset carries its version as code version. Per-shard assets also report it as each partition's
data version (``assets.shard_runs``), the one tag Dagster indexes per partition, so finding the
current partitions is one query per asset whatever the number of shards; unpartitioned assets are
read from their latest materialization's code version.
"""

from __future__ import annotations

import dagster as dg
from dagster._core.definitions.data_version import CODE_VERSION_TAG, DATA_VERSION_TAG
from dagster._core.events import DagsterEventType


def current_partitions(instance: dg.DagsterInstance, key: dg.AssetKey, version: str | None) -> set[str]:
    """Partitions of ``key`` whose latest materialization was made at ``version`` (any version when
    ``version`` is None: an unversioned code location)."""
    if version is None:
        return set(instance.get_materialized_partitions(key))
    tags = instance.event_log_storage.get_latest_tags_by_partition(
        key, DagsterEventType.ASSET_MATERIALIZATION, [DATA_VERSION_TAG])
    return {p for p, t in tags.items() if t.get(DATA_VERSION_TAG) == version}


def latest_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The code version of an unpartitioned asset's latest materialization (None: never materialized)."""
    event = instance.get_latest_materialization_event(key)
    if event is None or event.asset_materialization is None:
        return None
    return event.asset_materialization.tags.get(CODE_VERSION_TAG, "")


def todo_by_shard(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey], versions: dict[str, str],
                  shards: list[str]) -> dict[str, list[dg.AssetKey]]:
    """``{shard: [asset keys to materialize]}`` for every shard, in ``asset_keys`` order."""
    done = {k: current_partitions(instance, k, versions.get(k.path[-1])) for k in asset_keys}
    return {s: [k for k in asset_keys if s not in done[k]] for s in shards}


def outdated_globals(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey],
                     versions: dict[str, str]) -> list[dg.AssetKey]:
    """Unpartitioned assets never materialized, or last materialized at another version."""
    return [k for k in asset_keys if latest_version(instance, k) != versions.get(k.path[-1])]
