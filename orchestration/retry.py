"""`shardprep retry`: download again the transiently failed rows of finished image shards
(``shardprep.images.retry``), and forget the Dagster materializations of the downstream (asset, shard)
pairs of each shard that gained samples (``invalidate``), so the next `shardprep run` redoes exactly
them. Nothing else is run."""

from __future__ import annotations

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG

from shardprep.artifacts import enabled
from shardprep.config import config_url, load_config
from shardprep.images.retry import ARTIFACT, RetryReport, downstream_shard_artifacts, retry_shard
from shardprep.keys import parse_shard_ids
from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.versions import read_stamp
from shardprep_dagster.assets.images import contact_sheet_metadata
from shardprep_dagster.assets.shard_runs import shard_locks
from shardprep_dagster.orchestration.invalidate import invalidate


def retry(config_path: str, reasons: set[str] | str, shards: str | None = None,
          instance: dg.DagsterInstance | None = None, on_report=None) -> list[RetryReport]:
    """Retry every finished image shard of the ledger (only ``shards``, e.g. ``12-40,55``, when given);
    ``on_report(report)`` as each shard is done. ``instance``: default the CLI's, at $DAGSTER_HOME."""
    if instance is None:
        from shardprep_dagster.orchestration.instance import get_instance

        instance = get_instance()
    cfg = load_config(config_url(config_path))
    layout = Layout(cfg.output_root)
    ledger = load_ledger(layout)
    if ledger is None:
        raise ValueError(f"{layout.root}: no shards registered yet: `shardprep run` makes them first")
    ids = parse_shard_ids(shards) if shards else None
    keys = [s.key for s in ledger.shards()
            if s.media == "image" and (ids is None or int(s.key) in ids)]

    def wipe(artifacts: list[str], shard: str) -> None:
        # the stamps are gone already (the core's); only assets in this config's graph have partitions
        invalidate(instance, layout, [a for a in artifacts if enabled(a, cfg)], [shard])

    reports = []
    for key in keys:
        # the locks a run's steps take for this shard: one downloading it now, or embedding its old tar
        # (whose stamp would come after ours is removed), finishes first
        with shard_locks(layout, key, [ARTIFACT, *downstream_shard_artifacts()]):
            report = retry_shard(layout, cfg, key, reasons, on_invalidate=wipe)
            sheet = contact_sheet_metadata(layout, key, rebuild=True) if report.recovered else {}
            if report.retried:  # the shard's partition shows the round (and the new preview)
                _record_round(instance, layout, ledger.partition_of(key), report, sheet)
        reports.append(report)
        if on_report is not None:
            on_report(report)
    return reports


def _record_round(instance: dg.DagsterInstance, layout: Layout, partition: str, report: RetryReport,
                  sheet: dict) -> None:
    """A materialization of the shard's ``image_shards`` partition at its version, saying what the retry
    round changed (the UI's partition page; `shardprep run` needs nothing more of the shard itself)."""
    stamp = read_stamp(layout, ARTIFACT, report.shard)
    if stamp is None:
        return
    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset_key=ARTIFACT, partition=partition, tags={DATA_VERSION_TAG: stamp["version"]},
        metadata={"retry": report.summary(), "retry_round": report.retry_round, "retried": report.retried,
                  "recovered": report.recovered, "still_failed": report.still_failed, **sheet}))
