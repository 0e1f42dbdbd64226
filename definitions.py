"""The shardprep Dagster code location (loaded from the checkout by workspace.yaml)."""

import os
import sys
from pathlib import Path

import dagster as dg

sys.path.insert(0, str(Path(__file__).parent))  # assets/, resources/, sensors/ live beside this file

from assets import global_assets, per_shard_assets  # noqa: E402
from resources import ClipResource, DatasetResource, NemoEncoders  # noqa: E402
from sensors import new_source_files  # noqa: E402

DEFAULT_CONFIG = str(Path(__file__).parent / "demo" / "work" / "shardprep.yaml")
CONFIG_PATH = os.environ.get("SHARDPREP_CONFIG", DEFAULT_CONFIG)
# Declarative automation carries each new shard through every per-shard asset. It runs by default;
# SHARDPREP_AUTOMATION=off starts it stopped (it can also be toggled in the UI: Automation tab).
AUTOMATION_ON = os.environ.get("SHARDPREP_AUTOMATION", "on").lower() not in ("off", "0", "false")

shards_job = dg.define_asset_job(
    "shards_job",
    selection=dg.AssetSelection.assets(*per_shard_assets),
    description="Every per-shard asset for one shard (or a range of shards).",
)

global_job = dg.define_asset_job(
    "global_job",
    selection=dg.AssetSelection.assets(*global_assets),
    description="The unpartitioned, incrementally updated outputs: balanced tars, wdinfo, precache, indexes.",
)

automation = dg.AutomationConditionSensorDefinition(
    "shardprep_automation",
    target=dg.AssetSelection.all(),
    default_status=dg.DefaultSensorStatus.RUNNING if AUTOMATION_ON else dg.DefaultSensorStatus.STOPPED,
    minimum_interval_seconds=int(os.environ.get("SHARDPREP_AUTOMATION_INTERVAL", "15")),  # tests set it low
)


def build_defs(config_path: str) -> dg.Definitions:
    """The code location for one dataset config (the CLI and tests build it for their own config)."""
    dataset = DatasetResource(config_path=config_path)
    return dg.Definitions(
        assets=[*per_shard_assets, *global_assets],
        jobs=[shards_job, global_job],
        sensors=[new_source_files, automation],
        resources={"dataset": dataset, "clip": ClipResource(dataset=dataset), "nemo": NemoEncoders(dataset=dataset)},
        # one process per run, not per step: a run loads each model once and skips ~15 s of imports per step
        executor=dg.in_process_executor,
    )


defs = build_defs(CONFIG_PATH)
