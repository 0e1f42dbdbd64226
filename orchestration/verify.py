"""`shardprep verify` (and `shardprep run --verify`): re-read every materialized output cheaply
(``shardprep.verify``), report what is broken, and invalidate those (asset, shard) pairs so the next
run repairs exactly them.

Per-shard assets: the broken pair loses its stamp and its Dagster materialization (``invalidate``).
Unpartitioned assets: the asset's materialization is wiped so the next run's global step runs. One
that is only stale (whole, but made from per-shard outputs made again since: a reshard, a takedown)
is brought in step by that step's incremental update; the balanced and precached tars, when damaged,
lose their stamp too, which makes that step rebuild them from the shards; the energon indexes repair
themselves (an untrusted sqlite is rebuilt, a missing ``.tar.idx`` restored); wdinfo and the report
are rewritten anyway.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import dagster as dg

from shardprep import state
from shardprep.artifacts import ARTIFACTS, GLOBALS
from shardprep.config import config_url, load_config
from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.verify import Problem, verify_global, verify_shard
from shardprep.versions import artifact_versions, remove_stamp
from shardprep_dagster.orchestration.invalidate import invalidate
from shardprep_dagster.orchestration.plan import latest_version

THREADS = 16  # reading is I/O bound (object stores: one request per file or header range)
REBUILT_WHEN_BROKEN = ("balanced_shards", "precached_encodings")


@dataclass
class VerifyReport:
    checked: dict[str, int] = field(default_factory=dict)  # asset -> shards (or 1) verified
    problems: list[Problem] = field(default_factory=list)
    marked: bool = False
    index_diffs: dict[str, list[str]] = field(default_factory=dict)  # asset -> shards the state index had wrong
    index_rebuilt: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def broken(self) -> dict[str, list[str]]:
        """``{asset: [shards]}`` with a problem."""
        out: dict[str, list[str]] = {}
        for p in self.problems:
            if p.shard not in out.setdefault(p.artifact, []):
                out[p.artifact].append(p.shard)
        return out

    def summary(self) -> str:
        lines = [f"verified {n} {'shards' if asset not in GLOBALS else 'output'} of {asset}"
                 for asset, n in self.checked.items()]
        lines += [f"{'STALE' if p.stale else 'BROKEN'} {p}" for p in self.problems]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s) in {sum(map(len, self.broken().values()))} (asset, shard) "
                         + ("pair(s), marked for re-materialization: `shardprep run` repairs them"
                            if self.marked else "pair(s) (not marked)"))
        else:
            lines.append("every output is complete")
        differ = sum(map(len, self.index_diffs.values()))
        lines.append(f"state index: {differ} entr{'y' if differ == 1 else 'ies'} differed from the stamps"
                     + ("; rebuilt from the stamps" if self.index_rebuilt else "") if differ else
                     "state index: rebuilt from the stamps" if self.index_rebuilt else "state index: mirrors the stamps")
        return "\n".join(lines)


def verify_dataset(config_path: str, instance: dg.DagsterInstance, mark: bool = True,
                   rebuild_index: bool = False) -> VerifyReport:
    """Verify every materialized (asset, shard) of the config's enabled assets; with ``mark``, invalidate
    the broken ones so the next run redoes them (and nothing else). The state index is compared with
    the stamps and made again from them when it differs (with ``mark``) or when asked."""
    from shardprep_dagster.definitions import build_defs

    config_path = config_url(config_path)
    cfg = load_config(config_path)
    layout, versions = Layout(cfg.output_root), artifact_versions(cfg)
    ledger = load_ledger(layout)
    shard_of = {s.key: s for s in ledger.shards()} if ledger else {}
    graph = build_defs(config_path).resolve_asset_graph()
    # per-shard truth: the state index (a partition may be a block of shards)
    names = [k.path[-1] for k in graph.toposorted_asset_keys if graph.get(k).partitions_def is not None]
    states = state.load(layout, names, fold_first=False)
    report = VerifyReport(marked=mark)
    with ThreadPoolExecutor(THREADS, thread_name_prefix="shardprep-verify") as pool:
        for key in graph.toposorted_asset_keys:
            node, name = graph.get(key), key.path[-1]
            if node.partitions_def is not None:
                # only the shards the asset makes something of (an image-only dataset: no video_shards)
                shards = sorted(s for s in states[name].complete(versions[name]) & shard_of.keys()
                                if ARTIFACTS[name].applies(shard_of[s].media))
                if not shards and ARTIFACTS[name].media is not None:
                    continue
                found = pool.map(lambda s, n=name: verify_shard(layout, cfg, n, s, shard_of[s].rows,
                                                                 media=shard_of[s].media), shards)
                report.problems += [Problem(name, s, msg) for s, f in zip(shards, found) for msg in f.problems]
                report.checked[name] = len(shards)
            elif latest_version(instance, key) is not None:
                found = verify_global(layout, cfg, name)
                report.problems += [Problem(name, "_all", msg, stale=msg in found.stale) for msg in found.problems]
                report.checked[name] = 1
    if mark:
        _mark(instance, layout, report)
    report.index_diffs = state.stamps_equal_index(layout, [a for a in ARTIFACTS if a in versions])
    if rebuild_index or (mark and report.index_diffs):
        state.rebuild(layout)
        report.index_rebuilt = True
    return report


def _mark(instance: dg.DagsterInstance, layout: Layout, report: VerifyReport) -> None:
    globals_ = set(GLOBALS)
    damaged = {p.artifact for p in report.problems if not p.stale}
    for asset, shards in report.broken().items():
        if asset in globals_:
            if asset in REBUILT_WHEN_BROKEN and asset in damaged:
                remove_stamp(layout, asset)
            instance.wipe_assets([dg.AssetKey(asset)])
        else:
            invalidate(instance, layout, [asset], shards)
