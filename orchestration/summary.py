"""What a `shardprep run` reports: ``RunSummary``, filled from the instance after the run (``finish``), so
that its exit code is the truth about the dataset whoever's run made what."""

from __future__ import annotations

from dataclasses import dataclass, field

import dagster as dg

from shardprep_dagster.orchestration.plan import Plan, current_globals, current_partitions, incomplete_shards


@dataclass
class RunSummary:
    shards: list[str]
    new_shards: list[str]
    runs: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # shard -> error
    materialized: dict[str, int] = field(default_factory=dict)  # asset -> partitions current
    appended_sources: list[str] = field(default_factory=list)  # registered earlier; new rows became new shards
    empty_sources: list[str] = field(default_factory=list)
    global_assets: list[str] = field(default_factory=list)  # unpartitioned: materialized is 0 or 1
    stopped_by: int | None = None  # the signal that stopped the run (SIGTERM, SIGINT)
    not_run: list[str] = field(default_factory=list)  # shards left for the next run after a stop
    backfills: list[str] = field(default_factory=list)  # queued: the backfills this run launched
    global_run: str | None = None  # queued: the unpartitioned assets' run, when it executed in this process
    waited_on: list[str] = field(default_factory=list)  # queued: other processes' backfills this run waited for
    shards_settled: int = 0  # storage id of the newest shard materialization when the global step began
    shard_count: int = 0  # shards registered (``shards`` are the partitions: shards, or blocks of them)
    shards_per_partition: int = 1

    def waited_for(self, backfill_ids: list[str]) -> None:
        """Note other processes' backfills this run waited for (named if what they had fails)."""
        self.waited_on += [b for b in backfill_ids if b not in self.waited_on]

    @property
    def ok(self) -> bool:
        return not self.failed and self.stopped_by is None


def finish(plan: Plan, instance: dg.DagsterInstance, summary: RunSummary) -> RunSummary:
    """The summary as the instance has it after the run, whoever materialized what: every (asset, shard)
    not current at its version and every enabled unpartitioned asset not brought up to date after the
    shards is a failure (a stopped run's shards not run are left for the next run instead)."""
    current = {k: current_partitions(instance, k, plan.versions.get(k.path[-1])) for k in plan.shard_keys}
    missing: dict[str, list[str]] = {}
    for k in plan.shard_keys:
        for shard in set(plan.shards) - current[k]:
            missing.setdefault(shard, []).append(k.to_user_string())
    # and per shard, from the state index (a partition may be a block: Dagster sees only the block)
    for shard, assets in incomplete_shards(plan.cfg, plan.versions, [k.path[-1] for k in plan.shard_keys]).items():
        if plan.registration.shards_per_partition > 1 or shard not in missing:
            missing.setdefault(shard, []).extend(a for a in assets if a not in missing.get(shard, []))
    if plan.only is not None:  # `run --shards`: the truth about the selected shards (and the globals)
        missing = {s: assets for s, assets in missing.items() if s in plan.only}
    summary.materialized = {k.to_user_string(): len(current[k] & set(plan.shards)) for k in plan.shard_keys}
    others = f" (waited for backfill(s) {', '.join(summary.waited_on)} of another process)" if summary.waited_on else ""
    if summary.stopped_by is not None:
        summary.not_run = sorted(missing)
        # what the cancellation left undone is not a failure: it is left for the next run
        summary.failed = {s: e for s, e in summary.failed.items()
                          if s not in missing or not e.endswith(("not materialized", "cancelled"))}
        return summary
    for shard, assets in sorted(missing.items()):
        summary.failed.setdefault(shard, f"{', '.join(assets)}: not materialized at the current version{others}")
    current_global = current_globals(instance, plan.global_keys, plan.versions, summary.shards_settled)
    for k in plan.global_keys:
        name = k.to_user_string()
        ok = k in current_global
        summary.materialized[name] = int(ok)
        summary.global_assets.append(name)
        if not ok:
            summary.failed.setdefault("(global)", f"{name}: not brought up to date after the shards{others}")
    return summary
