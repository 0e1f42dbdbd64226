"""takedowns: the configured takedown lists applied to every finished shard, before the global assets.

``apply`` is the Dagster side of ``shardprep.takedown``: the shard locks while a shard's files change, and a
materialization of each changed (asset, partition) at its version, so the UI shows the takedown on the
partition's page and `shardprep run` sees changed shards and brings the global assets up to date
(``orchestration.plan``). The asset runs it for the configured lists at every global phase;
`shardprep takedown --list FILE` for a list given on the command line (``orchestration.takedown``)."""

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG

from shardprep.artifacts import ARTIFACTS, PER_SHARD, enabled
from shardprep.config import DatasetConfig
from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.takedown.apply import ApplyReport, ShardTakedown, apply_lists
from shardprep.takedown.lists import audit_records
from shardprep.versions import read_stamp
from shardprep_dagster.assets.shard_runs import from_record, shard_locks, versioned
from shardprep_dagster.resources.dataset import DatasetResource


def apply(instance: dg.DagsterInstance, cfg: DatasetConfig, lists: list[str] | tuple[str, ...] = (),
          on_shard=None) -> ApplyReport:
    """Apply the config's takedown lists and ``lists`` (``shardprep.takedown.apply.apply_lists``) under
    the shards' locks; each changed (asset, shard partition) gets a materialization saying so."""
    layout = Layout(cfg.output_root)
    ledger = load_ledger(layout)
    artifacts = [a for a in PER_SHARD if enabled(a, cfg)]

    def locked(shard: str, media: str):
        return shard_locks(layout, shard, [a for a in artifacts if ARTIFACTS[a].applies(media)])

    def record(done: ShardTakedown) -> None:
        partition = ledger.partition_of(done.shard) if ledger is not None else done.shard
        for name, count in done.artifacts.items():
            stamp = read_stamp(layout, name, done.shard)
            if name not in artifacts or stamp is None:
                continue
            instance.report_runless_asset_event(dg.AssetMaterialization(
                asset_key=name, partition=partition, tags={DATA_VERSION_TAG: stamp["version"]},
                metadata={"takedown": f"{len(done.removed)} sample(s) of shard {done.shard} removed "
                                      f"({count} from this asset's files)",
                          "takedown_keys": dg.MetadataValue.json(sorted(done.keys)[:100]),
                          "takedown_lists": ", ".join(sorted({r['list'] for r in done.removed}))}))
        if on_shard is not None:
            on_shard(done)

    return apply_lists(layout, (*cfg.takedown_lists, *lists), locked=locked, on_shard=record)


def _table(rows: list[dict]) -> dg.MetadataValue:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return dg.MetadataValue.md("\n".join(lines))


@dg.asset(
    **from_record("takedowns"),
    kinds={"parquet", "json"},
)
def takedowns(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """Samples named by a takedown list (``takedown_lists`` in the config, or `shardprep takedown --list`)
    taken out of every per-shard artifact's files (``shardprep.takedown``): tars, parquets, embedding
    rows, scores, diffusion samples, previews. The global assets after it (dedup, selection, balanced
    tars, wdinfo, precached encodings, energon indexes, report) see the changed shards and update.
    Lists are kept under ``.shardprep/takedowns/lists/``, an audit record per application under
    ``.shardprep/takedowns/audit/``; later downloads never fetch a listed sample."""
    cfg, layout = dataset.config, dataset.layout
    report = apply(context.instance, cfg,
                   on_shard=lambda done: context.log.info(
                       f"shard {done.shard}: {len(done.removed)} sample(s) removed ({done.artifacts})"))
    audits = audit_records(layout)
    per_list: dict[str, int] = {}
    for record in audits:
        for r in record["removed"]:
            per_list[r["list"]] = per_list.get(r["list"], 0) + 1
    lists = [{"list version": lst["version"], "source": lst["source"], "entries": lst["entries"],
              "samples removed (all applications)": per_list.get(lst["version"], 0)} for lst in report.lists]
    metadata = {
        "lists": len(report.lists),
        "removed_now": report.removed,
        "removed_total": sum(per_list.values()),
        "shards_changed_now": len(report.shards),
        "shards_checked_now": report.checked,
        "applications": len(audits),
        **({"per_list": _table(lists)} if lists else {}),
        **({"removed_now_per_artifact": _table([{"artifact": a, "samples": n}
                                                for a, n in report.per_artifact().items()])}
           if report.shards else {}),
        **({"audit_record": dg.MetadataValue.path(report.audit)} if report.audit else {}),
    }
    return versioned(dataset, "takedowns", dg.MaterializeResult(metadata=metadata))
