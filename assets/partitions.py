"""One dynamic partition per shard; keys are the ledger's zero-padded shard ids and never change."""

import dagster as dg

shard_partitions = dg.DynamicPartitionsDefinition(name="shards")
