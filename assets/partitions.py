"""One dynamic partition per shard; keys are the ledger's zero-padded shard ids and never change."""

import dagster as dg

SHARD_PARTITIONS = "shards"  # the partition set's name, wherever the instance is asked about it
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARD_PARTITIONS)
