"""`shardprep run`: register new source rows as shards, find every (asset, shard) that is missing or
outdated (``orchestration.plan``), have Dagster materialize them, and report.

Two ways to execute, one plan:

* queued (the default, ``orchestration.queued``): an asset backfill of exactly those pairs, run by
  Dagster's daemons through the instance's run queue: several shards in flight at once, bounded by the
  instance's run limit and its ``download`` and ``gpu`` pools, like every run the UI or automation starts;
* in process (``--in-process``, ``orchestration.in_process``): one shard after the other in this process
  (debugging, and output roots only this process can see, such as ``memory://``).
"""

from __future__ import annotations

import dagster as dg

from shardprep import state
from shardprep.config import config_url
from shardprep.errors import ShardprepError
from shardprep.keys import parse_shard_ids
from shardprep.layout import Layout
from shardprep.ledger import Registration, register_sources
from shardprep_dagster.assets.partitions import SHARD_PARTITIONS
from shardprep_dagster.orchestration.instance import get_instance, instance_lock
from shardprep_dagster.orchestration.launch import ensure_daemon
from shardprep_dagster.orchestration.plan import Plan
from shardprep_dagster.orchestration.recovery import recover_dead_runs
from shardprep_dagster.orchestration.summary import RunSummary, finish
from shardprep_dagster.resources.dataset import load_dataset


def register_partitions(instance: dg.DagsterInstance, keys: list[str], chunk: int = 10_000) -> int:
    """Add the shards the instance does not know yet, in chunks (one call with 400,000 keys exceeds
    SQLite's variable limit); idempotent, so a crash in the middle and a re-run leave exactly ``keys``.
    Processes adding the same keys at once lose nothing: a chunk another one added first is re-read."""
    existing = set(instance.get_dynamic_partitions(SHARD_PARTITIONS))
    new = [k for k in keys if k not in existing]
    for i in range(0, len(new), chunk):
        part = new[i:i + chunk]
        try:
            instance.add_dynamic_partitions(SHARD_PARTITIONS, part)
        except Exception:  # noqa: BLE001 - a unique-key race with another process (Postgres, SQLite)
            known = set(instance.get_dynamic_partitions(SHARD_PARTITIONS))
            missing = [k for k in part if k not in known]
            if missing:
                instance.add_dynamic_partitions(SHARD_PARTITIONS, missing)
    return len(new)


def make_plan(config_path: str, instance: dg.DagsterInstance, rebuild: bool = False,
              registration: Registration | None = None) -> Plan:
    """What a run of the config at ``config_path`` must do. The config is read once per process
    (``load_dataset``: the code location built here reads the same copy); ``registration``: the source
    files already registered by the caller (else here)."""
    from shardprep_dagster.definitions import build_defs

    cfg, versions = load_dataset(config_path)
    reg = registration or register_sources(cfg, config_path=config_path)  # a bad source fails here
    with instance_lock(instance, "partitions"):
        register_partitions(instance, reg.partitions)
    defs = build_defs(config_path)
    graph = defs.resolve_asset_graph()
    order = graph.toposorted_asset_keys
    shard_keys = [k for k in order if graph.get(k).partitions_def is not None and graph.get(k).is_materializable]
    global_keys = [k for k in order if graph.get(k).partitions_def is None and graph.get(k).is_materializable]
    plan = Plan(config_path, cfg, reg, defs, versions, shard_keys, global_keys, {}, rebuild)
    plan.replan(instance)
    return plan


def _selection(spec: str, registration: Registration) -> set[str]:
    try:
        ids = parse_shard_ids(spec)
    except ValueError as e:
        raise ShardprepError(f"--shards: {e}") from None
    keys = {k for k in registration.all_keys if int(k) in ids}
    if not keys:
        raise ShardprepError(f"--shards {spec}: no registered shard is in this selection "
                             f"({len(registration.all_keys)} shards registered)")
    return keys


def run_pipeline(config_path: str, *, rebuild: bool = False, progress: bool = True,
                 instance: dg.DagsterInstance | None = None, in_process: bool = False,
                 shards: str | None = None) -> RunSummary:
    """Register new source rows, then materialize every (asset, shard) that is missing or outdated and
    the unpartitioned assets after them (queued through Dagster's daemons, or ``in_process``).
    ``shards``: only these (``12-40,55``); a block holding one of them does only the selected ones."""
    config_path = config_url(config_path)
    # a bad config or source is named before the instance is opened (nothing to recover for it)
    cfg, _ = load_dataset(config_path)
    instance = instance or get_instance()
    if not in_process and getattr(instance, "root_directory", None) is not None:
        # the queue daemon's start (its imports, its code server loading the definitions: ~3 s) overlaps
        # registering and planning instead of following them
        ensure_daemon(instance)
    registration = register_sources(cfg, config_path=config_path)
    state.ensure(Layout(cfg.output_root))
    recover_dead_runs(instance)
    plan = make_plan(config_path, instance, rebuild, registration=registration)
    if shards is not None:
        plan.only, plan.only_spec = _selection(shards, registration), shards
    summary = RunSummary(plan.shards, plan.registration.new_keys,
                         appended_sources=plan.registration.appended_sources,
                         empty_sources=plan.registration.empty_sources,
                         shard_count=len(plan.registration.all_keys),
                         shards_per_partition=plan.registration.shards_per_partition)
    if in_process:
        from shardprep_dagster.orchestration.in_process import execute

        execute(plan, instance, summary, progress)
    else:
        from shardprep_dagster.orchestration.queued import execute

        execute(plan, instance, summary, progress)
    # the run's changes into the state index's tables, so `status` finds a short journal
    state.fold(Layout(cfg.output_root))
    return finish(plan, instance, summary)


