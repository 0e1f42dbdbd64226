"""Takedowns: samples a list names (URLs, domains, sample keys, image sha256) removed from every artifact
that holds them, and kept out of every later download.

* ``lists``: reading a takedown list (parquet, CSV or text, any fsspec URL) into entries, and the store of
  the lists registered under the output root (``.shardprep/takedowns/``).
* ``apply``: finding the samples of finished shards that match, removing them from each per-shard
  artifact's files (tars, parquets, embedding rows, scores, diffusion samples, previews) and stamping
  those outputs again, so the global artifacts (dedup, selection, balanced tars, wdinfo, precached
  encodings, energon indexes, report) take the change like any changed shard; an audit record per
  application says when, what and why.
"""
