"""A block run on one machine keeps download and embedding overlapped: each shard's embedding starts as
soon as its download ends, while the next shard downloads (``assets.follow``), shown by the per-shard
timestamps both assets report; the clip step still materializes its own partition and check."""

import dagster as dg

from shardprep.models import clip as clip_models
from shardprep.versions import read_stamp
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures.live_dagster import prepare_home
from tests.fixtures.slow_runs import slow_image_source

BLOCK = "00000-00003"


def _per_shard(instance: dg.DagsterInstance, asset: str) -> dict[str, dict]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[BLOCK]), limit=1).records
    meta = records[0].asset_materialization.metadata
    return {r.data["shard"]: r.data for r in meta["per_shard"].value.records}, meta


def test_a_block_run_embeds_each_shard_while_the_next_one_downloads(tmp_path, tiny_clip_dir, monkeypatch):
    # a device of its own (the CPU "device" is leased through a lock file other tests may hold)
    monkeypatch.setenv("SHARDPREP_DEVICE_LOCK_DIR", str(tmp_path / "device-locks"))
    # 4 shards of 8 rows in one block; images answer after 0.3 s (2 threads: ~1.2 s a shard's download)
    with slow_image_source(tmp_path, tiny_clip_dir, rows=32, samples_per_shard=8, slow_seconds=0.3,
                           thread_count=2, seed=7, batch_size=16, shards_per_partition=4) as (config, layout):
        home = prepare_home(tmp_path / "home")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            loads_before = clip_models.LOAD_COUNT  # per process: earlier tests in this worker may have loaded it
            summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
            loads = clip_models.LOAD_COUNT - loads_before
            assert summary.ok, summary.failed
            downloads, _ = _per_shard(instance, "image_shards")
            embeds, clip_meta = _per_shard(instance, "clip_embeddings")
            checks = list(instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(dg.AssetKey("clip_embeddings"), "rows_match_samples"), limit=5))

    shards = ["00000", "00001", "00002", "00003"]
    assert sorted(downloads) == sorted(embeds) == shards
    for k in shards:
        assert embeds[k]["status"] == "written" and embeds[k].get("embedded"), embeds[k]
        assert embeds[k]["embedded"] == "following the download"
        assert embeds[k]["samples"] == downloads[k]["successes"] > 0
        # after its own download ...
        assert embeds[k]["started_at"] >= downloads[k]["finished_at"]
        assert read_stamp(layout, "clip_embeddings", k)["version"]
    for k, nxt in zip(shards, shards[1:]):
        # ... and before the next shard's download has ended: the two overlap
        assert embeds[k]["started_at"] < downloads[nxt]["finished_at"], (k, embeds[k], downloads[nxt])
    # the clip step reported and checked its block itself, with the model loaded once in the run's process
    assert clip_meta["shards"].value == 4 and loads <= 1
    assert checks and checks[0].status.value == "SUCCEEDED"
