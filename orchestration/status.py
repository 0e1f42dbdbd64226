"""`shardprep status`: per asset, how many shards are materialized, outdated, failed, in progress or
missing (unpartitioned assets: materialized or not, and when), read from the output root's state index
(``shardprep.state``): a handful of files whatever the number of shards, and no Dagster import, no query
of the instance per partition.

A shard counts as failed for an asset when its last attempt at that asset failed, or when an upstream
asset's did and this one is not complete at the current version (it waits for the upstream shard), as
Dagster's UI shows a run's skipped downstream steps."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from shardprep import arrow_lists, state
from shardprep.artifacts import ARTIFACTS, enabled
from shardprep.config import config_url, load_config
from shardprep.layout import Layout
from shardprep.ledger import load_ledger, media_of
from shardprep.storage import pid_alive
from shardprep.versions import ALL_SHARDS, artifact_versions


@dataclass(frozen=True)
class AssetStatus:
    asset: str
    partitioned: bool
    total: int = 0  # shards registered that the asset applies to (its media)
    materialized: int = 0
    failed: int = 0  # last attempt failed, or an upstream shard's did (materialized earlier or not)
    in_progress: int = 0
    outdated: int = 0  # materialized, but at another version than the config's (will be redone)
    last_materialized: float | None = None  # when its latest output was completed (any shard)
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


def _running(worker: str) -> bool:
    """Whether the process that started a shard may still be at it: on this host, while its pid lives;
    on another host, until its outcome is recorded."""
    host, _, pid = worker.rpartition(":")
    return host != state.worker().rpartition(":")[0] or not pid.isdigit() or pid_alive(int(pid))


def _shard_status(name: str, st: state.ArtifactState, keys, version: str, upstream_failed: set[str]) -> AssetStatus:
    """Counted in Arrow (``keys``: an array of the shards the asset applies to); only the few failed or
    running shards become Python objects (580,000 shards: a Python set per asset cost seconds)."""
    t = st.table.filter(pc.is_in(st.table.column("shard"), value_set=keys))
    versions = t.column("version")
    is_current = arrow_lists.is_value(versions, version)
    is_other = arrow_lists.is_other_value(versions, version)
    # the last attempt failed (a blocking check included), or an upstream shard's did and this one waits
    failed = set(t.filter(pc.is_valid(t.column("failure"))).column("shard").to_pylist())
    if upstream_failed:  # those of this asset's shards, unless complete here all the same
        waiting = arrow_lists.array(sorted(upstream_failed), pa.string())
        waiting = waiting.filter(pc.is_in(waiting, value_set=keys))
        current = t.filter(pc.and_(is_current, pc.is_in(t.column("shard"), value_set=waiting)))
        failed |= set(waiting.to_pylist()) - set(current.column("shard").to_pylist())
    running = {r["shard"] for r in t.filter(pc.is_valid(t.column("started_at"))).select(["shard", "worker"]).to_pylist()
               if _running(r["worker"])} - failed
    special = t.filter(pc.is_in(t.column("shard"), value_set=arrow_lists.array(sorted(failed | running), pa.string())))
    done_special = special.filter(arrow_lists.is_value(special.column("version"), version)).num_rows
    other_special = special.filter(arrow_lists.is_other_value(special.column("version"), version)).num_rows
    written = pc.max(t.filter(pc.is_valid(versions)).column("written_at")).as_py()
    return AssetStatus(name, True, total=len(keys),
                       materialized=(pc.sum(is_current).as_py() or 0) - done_special,
                       outdated=(pc.sum(is_other).as_py() or 0) - other_special,
                       failed=len(failed), in_progress=len(running), last_materialized=written)


def asset_statuses(config_path: str) -> list[AssetStatus]:
    """One status per asset the config enables, in dependency order."""
    cfg = load_config(config_url(config_path))
    layout = Layout(cfg.output_root)
    versions = artifact_versions(cfg)
    names = [a for a in ARTIFACTS if enabled(a, cfg)]
    ledger = load_ledger(layout)
    by_media = ledger.keys_by_media() if ledger else {"image": [], "video": []}
    key_arrays: dict[tuple[str, ...], pa.Array] = {}  # by the media an asset applies to: built once
    try:
        states = state.load(layout, names)
    except OSError:  # a root this process may not write: the journal is applied in memory
        states = state.load(layout, names, fold_first=False)
    failed_by: dict[str, set[str]] = {}
    out = []
    for name in names:
        record, st = ARTIFACTS[name], states[name]
        if not record.partitioned:
            r = st.row(ALL_SHARDS) or {}
            done = r.get("version") is not None
            failed_after = r.get("failure") is not None and (r.get("failed_at") or 0) > (r.get("written_at") or 0)
            out.append(AssetStatus(name, False, last_materialized=r.get("written_at") if done else None,
                                   outdated=int(done and r["version"] != versions[name]),
                                   last_failed=r.get("failed_at") if failed_after else None))
            continue
        medias = tuple(m for m in by_media if record.applies(m))
        if medias not in key_arrays:
            key_arrays[medias] = arrow_lists.array([k for m in medias for k in by_media[m]], pa.string())
        keys = key_arrays[medias]
        upstream = set().union(*(failed_by.get(p, set()) for p in record.parents))
        s = _shard_status(name, st, keys, versions[name], upstream)
        failed_by[name] = set(st.failures()) | upstream
        out.append(s)
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


def media_note(config_path: str) -> str:
    """A line saying how many shards are image and video shards, when there are video shards (each
    per-shard asset is materialized for both kinds; one of them only says "not applicable")."""
    from shardprep.config import ConfigError

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


def status(config_path: str | None = None) -> str:
    from shardprep_dagster.resources.settings import load_settings

    config_path = config_path or load_settings().config
    table = format_status(asset_statuses(config_path))
    note = media_note(config_path)
    return table + ("\n\n" + note if note else "")
