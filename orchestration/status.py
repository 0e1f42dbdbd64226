"""`shardprep status`: per asset, how many shards are materialized, failed or missing (unpartitioned
assets: materialized or not, and when), read from the Dagster instance at $DAGSTER_HOME."""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass

import dagster as dg
from dagster._core.definitions.partitions.context import partition_loading_context
from dagster._core.instance.types import CachingDynamicPartitionsLoader
from dagster._core.storage.partition_status_cache import AssetStatusCacheValue, get_and_update_asset_status_cache_value

from shardprep_dagster.orchestration.plan import current_partitions, latest_version
from shardprep_dagster.resources.dataset import config_url


@dataclass(frozen=True)
class AssetStatus:
    asset: str
    partitioned: bool
    total: int = 0  # partitions (shards) registered
    materialized: int = 0
    failed: int = 0  # last attempt failed (materialized earlier or not)
    in_progress: int = 0
    outdated: int = 0  # materialized, but at another version than the config's (will be redone)
    last_materialized: float | None = None  # timestamp of the latest materialization (any partition)
    last_failed: float | None = None  # unpartitioned: a failure after the latest materialization

    @property
    def missing(self) -> int:
        return self.total - self.materialized - self.failed - self.in_progress - self.outdated

    @property
    def state(self) -> str:
        """Unpartitioned assets: materialized / failed / missing."""
        if self.last_failed is not None:
            return "failed"
        if self.outdated:
            return "outdated"
        return "materialized" if self.last_materialized is not None else "missing"


def _entry(instance: dg.DagsterInstance, key: dg.AssetKey):
    records = instance.get_asset_records([key])
    return records[0].asset_entry if records else None


def _status_by_partition(instance: dg.DagsterInstance, key: dg.AssetKey, keys: list[str],
                         pdef: dg.PartitionsDefinition, loader: CachingDynamicPartitionsLoader) -> dict:
    """``instance.get_status_by_partition(key, keys, pdef)``, computed the same way but with the shard keys
    read once for every asset: Dagster's own call reads all of them twice per asset (their hash is the
    partitions definition's id), which at 100,000 shards cost more than the statuses themselves."""
    value = get_and_update_asset_status_cache_value(instance, key, pdef, dynamic_partitions_loader=loader)
    if not isinstance(value, AssetStatusCacheValue):
        return {}
    with partition_loading_context(dynamic_partitions_store=loader):
        in_progress = value.deserialize_in_progress_partition_subsets(pdef)
        failed = value.deserialize_failed_partition_subsets(pdef)
        materialized = value.deserialize_materialized_partition_subsets(pdef)
    st = dg.AssetPartitionStatus  # the order of Dagster's own call: in progress, failed, materialized
    return {k: st.IN_PROGRESS if k in in_progress else st.FAILED if k in failed else
            st.MATERIALIZED if k in materialized else None for k in keys}


def asset_statuses(instance: dg.DagsterInstance, defs: dg.Definitions) -> list[AssetStatus]:
    """One status per materializable asset of ``defs``, in dependency order; with versioned assets
    (a code location built for a config), a materialization at another version counts as outdated."""
    graph = defs.resolve_asset_graph()
    loader = CachingDynamicPartitionsLoader(instance)  # the shard keys, read once for all assets
    out = []
    for key in graph.toposorted_asset_keys:
        node = graph.get(key)
        if not node.is_materializable:
            continue
        entry = _entry(instance, key)
        last_mat = entry.last_materialization.timestamp if entry and entry.last_materialization else None
        pdef = node.partitions_def
        if pdef is None:
            failed_after = None
            if entry and entry.last_failed_to_materialize_record is not None and (
                    entry.last_materialization_storage_id is None
                    or entry.last_failed_to_materialize_storage_id > entry.last_materialization_storage_id):
                failed_after = entry.last_failed_to_materialize_entry.timestamp
            version = node.code_version
            outdated = int(last_mat is not None and version is not None and latest_version(instance, key) != version)
            out.append(AssetStatus(key.to_user_string(), False, last_materialized=last_mat,
                                   last_failed=failed_after, outdated=outdated))
            continue
        keys = list(pdef.get_partition_keys(dynamic_partitions_store=loader))
        by_status = _status_by_partition(instance, key, keys, pdef, loader)
        current = current_partitions(instance, key, node.code_version)
        outdated = sum(1 for k, v in by_status.items() if v == dg.AssetPartitionStatus.MATERIALIZED and k not in current)
        counts = Counter(by_status.values())
        out.append(AssetStatus(key.to_user_string(), True, total=len(keys), outdated=outdated,
                               materialized=counts[dg.AssetPartitionStatus.MATERIALIZED] - outdated,
                               failed=counts[dg.AssetPartitionStatus.FAILED],
                               in_progress=counts[dg.AssetPartitionStatus.IN_PROGRESS], last_materialized=last_mat))
    return out


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def format_status(statuses: list[AssetStatus]) -> str:
    """A plain-text table: one line per asset."""
    header = ["asset", "materialized", "outdated", "failed", "in progress", "missing", "of shards",
              "last materialized"]
    rows = []
    for s in statuses:
        if s.partitioned:
            rows.append([s.asset, str(s.materialized), str(s.outdated), str(s.failed), str(s.in_progress),
                         str(s.missing), str(s.total), _when(s.last_materialized)])
        else:
            rows.append([s.asset, {"materialized": "yes", "missing": "no", "failed": "FAILED",
                                   "outdated": "outdated"}[s.state],
                         "", "", "", "", "(unpartitioned)", _when(s.last_materialized)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or i == len(cells) - 1 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def load_defs(config_path: str | None) -> dg.Definitions:
    """The code location's definitions (for ``config_path`` when given: only the asset graph matters
    here, so any config of the dataset does)."""
    import warnings

    with warnings.catch_warnings():  # beta/preview notices of the asset definitions: noise in a terminal
        warnings.simplefilter("ignore", dg.BetaWarning)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        if config_path:
            from shardprep_dagster.definitions import build_defs

            return build_defs(config_url(config_path))
        from shardprep_dagster.definitions import defs

        return defs


def media_note(config_path: str) -> str:
    """A line saying how many shards are image and video shards, when there are video shards (each
    per-shard asset is materialized for both kinds; one of them only says "not applicable")."""
    from shardprep.artifacts import ARTIFACTS
    from shardprep.config import ConfigError, load_config
    from shardprep.layout import Layout
    from shardprep.ledger import load_ledger, media_of

    try:
        ledger = load_ledger(Layout(load_config(config_url(config_path)).output_root))
    except (ConfigError, OSError):  # no dataset yet: the table says everything is missing
        return ""
    if ledger is None or all(media_of(f) == "image" for f in ledger.files):
        return ""
    kinds = [s.media for s in ledger.shards()]
    only = {m: ", ".join(a.name for a in ARTIFACTS.values() if a.media == m) for m in ("image", "video")}
    return (f"shards: {kinds.count('image')} image, {kinds.count('video')} video. Image shards only: {only['image']}; "
            f"video shards only: {only['video']} (the other kind is materialized as not applicable)")


def status(config_path: str | None = None, instance: dg.DagsterInstance | None = None) -> str:
    from shardprep_dagster.orchestration.instance import get_instance
    from shardprep_dagster.resources.settings import load_settings

    instance = instance or get_instance()
    table = format_status(asset_statuses(instance, load_defs(config_path)))
    note = media_note(config_path or load_settings().config)
    return table + ("\n\n" + note if note else "")
