"""`shardprep takedown --list FILE`: register the lists and apply them under the shards' locks (the
``takedowns`` asset's ``apply``), then bring the global assets up to date at once with a run over the changed
shards only."""

from __future__ import annotations

import dagster as dg

from shardprep.config import config_url, load_config
from shardprep_dagster.assets.takedowns import apply


def takedown(config_path: str, lists: list[str], run: bool = True, on_shard=None, in_process: bool = False,
             instance: dg.DagsterInstance | None = None):
    """`shardprep takedown --config CONFIG --list FILE`: register and apply the lists, then (``run``) bring
    the global assets up to date with `shardprep run` over the changed shards only (nothing else is
    downloaded or made). Returns (``ApplyReport``, the run's summary or None)."""
    if instance is None:
        from shardprep_dagster.orchestration.instance import get_instance

        instance = get_instance()
    config_path = config_url(config_path)
    cfg = load_config(config_path)
    report = apply(instance, cfg, lists, on_shard=on_shard)
    summary = None
    if run and report.shards:
        from shardprep_dagster.orchestration.runner import run_pipeline

        summary = run_pipeline(config_path, instance=instance, shards=",".join(s.shard for s in report.shards),
                               progress=False, in_process=in_process)
    return report, summary
