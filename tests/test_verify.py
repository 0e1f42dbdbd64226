"""Outputs verified after the fact: a truncated tar, a deleted .npy and a corrupt parquet are each named
by `verify`, and the next run repairs exactly those (asset, shard) pairs, nothing else."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
import webdataset as wds

from shardprep.config import load_config
from shardprep.layout import Layout
from shardprep.report.page import collect
from shardprep.verify import verify_energon_index, verify_image_shard
from shardprep_dagster.orchestration.runner import run_pipeline
from shardprep_dagster.orchestration.verify import verify_dataset
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config
from tests.fixtures.live_dagster import prepare_home


def _materialized_since(instance: dg.DagsterInstance, storage_id: int) -> set[tuple[str, str | None]]:
    """(asset, partition) pairs materialized after the event log position ``storage_id``."""
    return {(key.to_user_string(), r.partition_key) for key in instance.get_asset_keys()
            for r in instance.fetch_materializations(key, limit=10_000).records if r.storage_id > storage_id}


def _last_storage_id(instance: dg.DagsterInstance) -> int:
    return max(r.storage_id for key in instance.get_asset_keys()
               for r in instance.fetch_materializations(key, limit=1).records)


@pytest.fixture
def done(tmp_path, image_site, tiny_clip_dir):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[45], n_images=120, seed=8)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=15, image_size=32, allow_private_addresses=True, thread_count=8,
                          timeout=5, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
                          enable_nemo_text2img=False, enable_nemo_diffusion=False)
    home = prepare_home(tmp_path / "home")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        yield config, Layout(str(tmp_path / "out")), instance, home


def test_verify_names_each_broken_output_and_run_repairs_only_those(done):
    config, layout, instance, _ = done
    clean = verify_dataset(config, instance)
    assert clean.ok, clean.summary()
    assert clean.checked == {"source_parquet": 3, "image_shards": 3, "clip_embeddings": 3,
                             "reordered_embeddings": 3, "image_scores": 3, "image_energon_index": 1,
                             "duplicates": 1, "sample_selection": 1, "takedowns": 1, "dataset_report": 1}

    tar = Path(layout.tar("00001"))
    good_keys = [s["__key__"] for s in wds.WebDataset(str(tar), shardshuffle=False)]
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 2])  # truncated
    os.remove(layout.img_emb("00000"))  # deleted
    pq = Path(layout.shard_parquet("00002"))
    pq.write_bytes(b"\0" * pq.stat().st_size)  # corrupt, same size
    before = _last_storage_id(instance)

    report = verify_dataset(config, instance)
    broken = report.broken()
    # the energon index over the image tars is whole, but stale now: the truncated tar changed under it
    assert broken == {"image_shards": ["00001", "00002"], "clip_embeddings": ["00000"],
                      "image_energon_index": ["_all"]}, report.summary()
    assert [p.stale for p in report.problems if p.artifact == "image_energon_index"] == [True]
    text = report.summary()
    for url in (layout.tar("00001"), layout.img_emb("00000"), layout.shard_parquet("00002")):
        assert url in text
    assert "truncated" in text and "missing" in text

    summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert summary.ok and summary.runs == 4  # three shard runs (one asset each) and the global step
    per_shard = {k for k in _materialized_since(instance, before) if k[1] is not None}
    assert per_shard == {("image_shards", "00001"), ("image_shards", "00002"), ("clip_embeddings", "00000")}
    assert [s["__key__"] for s in wds.WebDataset(str(tar), shardshuffle=False)] == good_keys
    assert np.load(layout.img_emb("00000")).shape[0] > 0
    again = verify_dataset(config, instance)
    assert again.ok
    # the state index mirrors every stamp after the runs, the repair included (version, time, sizes)
    assert clean.index_diffs == {} and again.index_diffs == {} and not again.index_rebuilt
    assert "state index: mirrors the stamps" in again.summary()


def test_verify_rebuilds_a_state_index_that_differs_from_the_stamps(done):
    config, layout, instance, home = done
    table = Path(layout.state_table("clip_embeddings"))
    table.unlink()  # lost: the index no longer says clip_embeddings is complete anywhere
    assert verify_dataset(config, instance, mark=False).index_diffs == {"clip_embeddings": ["00000", "00001", "00002"]}
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "verify", "--config", config,
                          "--no-mark", "--rebuild-index"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "state index: 3 entries differed from the stamps; rebuilt from the stamps" in out.stdout
    assert table.exists() and verify_dataset(config, instance, mark=False).index_diffs == {}


def test_verify_cli_reports_without_marking(done):
    config, layout, instance, home = done
    os.remove(layout.reordered_img("00002"))
    Path(f"{layout.tar('00000')}.idx").unlink()  # energon's per-tar index
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "verify", "--config", config, "--no-mark"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "BROKEN reordered_embeddings 00002" in out.stdout and "BROKEN image_energon_index _all" in out.stdout
    assert "00000.tar.idx" in out.stdout and "(not marked)" in out.stdout
    assert verify_dataset(config, instance, mark=False).broken() == {
        "reordered_embeddings": ["00002"], "image_energon_index": ["_all"]}
    # the dataset report lists it too, found by the same code
    problems = collect(layout, cfg=load_config(config)).problems
    assert [p for p in problems if layout.reordered_img("00002") in p] and len(problems) == 1, problems


def test_verify_functions_on_their_own(done):
    _, layout, _, _ = done
    assert verify_image_shard(layout, "00000", rows=15).ok
    wrong = verify_image_shard(layout, "00000", rows=16)
    assert wrong.problems == [f"{layout.shard_parquet('00000')}: 15 rows, the ledger gives the shard 16"]
    assert verify_energon_index(layout.images_dir).ok
