"""Driving the code location from the terminal (`shardprep run`): partitions, runs, summaries."""
