from shardprep_dagster.sensors.new_source_files import (
    MAX_PARTITION_ADDS_PER_TICK,
    new_source_files,
    new_source_files_sensor,
)
from shardprep_dagster.sensors.shard_work import shard_work_sensor

__all__ = ["MAX_PARTITION_ADDS_PER_TICK", "new_source_files", "new_source_files_sensor", "shard_work_sensor"]
