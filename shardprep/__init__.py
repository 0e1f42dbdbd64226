"""shardprep core library (no Dagster import)."""
