"""The shardprep Dagster code location, loaded by module name (``workspace.yaml``, Celery workers)."""

import dagster as dg

from shardprep.artifacts import enabled, enabled_parents
from shardprep.storage import exists
from shardprep_dagster.assets import batched, global_assets, per_shard_assets
from shardprep_dagster.orchestration import run_workers
from shardprep_dagster.resources import ClipResource, DatasetResource, NemoEncoders, concurrency_wait
from shardprep_dagster.resources.dataset import load_dataset
from shardprep_dagster.resources.executor import executor_for
from shardprep_dagster.resources.settings import Settings, load_settings
from shardprep_dagster.sensors import new_source_files_sensor, shard_work_sensor

concurrency_wait.apply()  # a step waiting for a pool slot sleeps instead of spinning a core (Dagster 1.13)

# With shard blocks a run takes a range of up to this many blocks: 6,000 blocks of 100 (LAION-5B) are
# ~100 runs; a block's complete shards cost a run nothing (orchestration.queued.fill_gaps)
BLOCKS_PER_RUN = 64


def _batched(assets: list[dg.AssetsDefinition], settings: Settings, blocks: bool) -> list[dg.AssetsDefinition]:
    """Backfills take several shards per run, so each run loads its models once, not once per shard (with
    shard blocks: several blocks)."""
    per_run = {**{a.key: BLOCKS_PER_RUN if blocks else settings.gpu_shards_per_run for a in batched("gpu")},
               **{a.key: BLOCKS_PER_RUN if blocks else settings.download_shards_per_run for a in batched("download")}}
    return [a.with_attributes(backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=per_run[a.key]))
            if a.key in per_run else a for a in assets]


def _enabled(assets: list[dg.AssetsDefinition], config_path: str) -> list[dg.AssetsDefinition]:
    """The assets the config turns on, each with its version as code version (``shardprep.versions``:
    a config change that alters an asset's output makes it stale). A disabled asset is not in the graph
    at all, so it can never claim to be materialized. Without a config file yet (a fresh checkout: the
    demo writes one) every asset is kept, unversioned, so the UI still shows the graph."""
    if not exists(config_path):
        return assets
    cfg, versions = load_dataset(config_path)

    def configured(spec: dg.AssetSpec) -> dg.AssetSpec:
        # a dependency on an asset the config turns off is dropped: it is never materialized, and
        # automation would wait on it for ever
        name = spec.key.path[-1]
        deps = [d for d in spec.deps if d.asset_key.path[-1] in enabled_parents(name, cfg)]
        return spec.replace_attributes(code_version=versions[name], deps=deps)

    return [a.map_asset_specs(configured) for a in assets if enabled(a.key.path[-1], cfg)]


def build_defs(config_path: str, settings: Settings | None = None) -> dg.Definitions:
    """The code location for one dataset config (the CLI and tests build it for their own config)."""
    settings = settings or load_settings()
    dataset = DatasetResource(config_path=config_path)
    per_shard, global_ = _enabled(per_shard_assets, config_path), _enabled(global_assets, config_path)
    blocks = exists(config_path) and load_dataset(config_path)[0].shards_per_partition > 1
    sensors = [new_source_files_sensor(settings.sensor_interval)]
    if blocks:
        # at dataset scale the state index drives the per-shard assets (sensors/shard_work.py); Dagster's
        # declarative automation keeps the global assets' schedule
        per_shard = [a.map_asset_specs(lambda spec: spec.replace_attributes(automation_condition=None))
                     for a in per_shard]
        sensors.append(shard_work_sensor([a.key.path[-1] for a in per_shard], settings.automation_interval,
                                         running=settings.automation))
    shards_job = dg.define_asset_job("shards_job", selection=dg.AssetSelection.assets(*per_shard),
                                     description="Every per-shard asset for one shard (or a range of shards).")
    global_job = dg.define_asset_job("global_job", selection=dg.AssetSelection.assets(*global_),
                                     description="The unpartitioned, incrementally updated outputs: balanced "
                                     "tars, wdinfo, precache, indexes.")
    automation = dg.AutomationConditionSensorDefinition(
        "shardprep_automation",
        target=dg.AssetSelection.all(),
        default_status=dg.DefaultSensorStatus.RUNNING if settings.automation else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=settings.automation_interval,
    )
    return dg.Definitions(
        assets=_batched([*per_shard, *global_], settings, blocks),
        jobs=[shards_job, global_job],
        sensors=[*sensors, automation],
        resources={"dataset": dataset, "clip": ClipResource(dataset=dataset), "nemo": NemoEncoders(dataset=dataset)},
        executor=executor_for(settings),  # SHARDPREP_EXECUTOR: in the run's process, or Celery workers
    )


_settings = load_settings()
defs = build_defs(_settings.config, _settings)
run_workers.fork_from_warm_process(__name__)  # in a code server: runs start as forks of a warm process
