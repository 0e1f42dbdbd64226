from shardprep_dagster.sensors.new_source_files import (
    MAX_PARTITION_ADDS_PER_TICK,
    new_source_files,
    new_source_files_sensor,
)

__all__ = ["MAX_PARTITION_ADDS_PER_TICK", "new_source_files", "new_source_files_sensor"]
