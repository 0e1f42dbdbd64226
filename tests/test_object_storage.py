"""The whole pipeline on a non-local fsspec root: source and outputs on ``memory://``, every asset, check,
index and the report; outputs read back through fsspec by webdataset's own tar iterators and our loaders.
Nothing may land on local disk by mistake (a path treated as local would create a ``memory:`` folder)."""

import io
import os
import pickle
import sqlite3
import tempfile

import dagster as dg
import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from shardprep.layout import Layout
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config


def _tar_samples(fs, url: str) -> list[dict]:
    with fs.open(url, "rb") as f:
        members = ({**m, "__url__": url} for m in wds.tariterators.tar_file_iterator(f))
        return list(wds.tariterators.group_by_keys(members))


@pytest.fixture
def memory_dataset(tmp_path, image_site, tiny_clip_dir, tiny_nemo_dirs):
    fs = fsspec.filesystem("memory")
    root = f"memory://shardprep-test-{os.getpid()}-{tmp_path.name}"
    local = synthetic.make_source_parquets(str(tmp_path / "src"), image_site[1], n_files=2, rows_per_file=[30, 12],
                                           n_images=120, seed=12)
    for path in local:
        fs.put_file(path, f"{root}/source/{os.path.basename(path)}")
    config = write_config(tmp_path / "c.yaml", source=f"{root}/source/*.parquet", output_root=f"{root}/out",
                          samples_per_shard=15, image_size=32, resize_mode="center_crop",
                          allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
                          thread_count=8, timeout=5, tar_chunk_size=10, **nemo_config(tiny_nemo_dirs))
    yield fs, config, Layout(f"{root}/out")
    fs.rm(root, recursive=True)


def test_whole_pipeline_on_a_memory_root(memory_dataset, tmp_path, monkeypatch):
    fs, config, layout = memory_dataset
    monkeypatch.chdir(tmp_path)  # a "memory:" folder would appear here if a URL were used as a local path
    with dg.instance_for_test() as instance:
        summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert summary.ok, summary.failed
        assert summary.shards == ["00000", "00001", "00002"]
        assert all(n == 3 for a, n in summary.materialized.items() if a not in summary.global_assets)
        assert all(summary.materialized[a] == 1 for a in summary.global_assets)
        again = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert again.ok and again.runs == 0
    assert not any(p.name.startswith("memory") for p in tmp_path.rglob("*")), "a URL was used as a local path"
    assert not [p for p in fs.find(layout.root) if ".tmp-" in p]

    keys = []
    for shard in summary.shards:
        with fs.open(layout.shard_parquet(shard), "rb") as f:
            table = pq.read_table(f).to_pandas()
        ok = sorted(table[table.status == "success"]["key"])
        samples = _tar_samples(fs, layout.tar(shard))
        assert [s["__key__"] for s in samples] == ok and all({"jpg", "json", "txt"} <= set(s) for s in samples)
        with fs.open(layout.img_emb(shard), "rb") as f:
            img = np.load(io.BytesIO(f.read()))
        assert img.shape[0] == len(ok) and img.dtype == np.float16
        with fs.open(layout.reordered_img(shard), "rb") as f:
            assert np.load(io.BytesIO(f.read())).shape[0] == (15 if shard != "00002" else 12)
        keys += ok

    # our DALLE2-style loader reads the tars and reordered embeddings straight from the memory root
    from shardprep.dataloaders import create_image_embedding_dataloader

    loader = create_image_embedding_dataloader(
        tar_url=[layout.tar(s) for s in summary.shards], num_workers=0, batch_size=4,
        img_embeddings_url=layout.reordered_img_dir, index_width=2, shuffle_shards=False, extra_keys=["__key__"],
        img_preproc=lambda im: np.asarray(im))
    assert sorted(k for _, _, batch in loader for k in batch) == sorted(keys)

    # NeMo outputs and both energon indexes
    with fs.open(layout.balanced_wdinfo, "rb") as f:
        info = pickle.load(f)
    assert info["chunk_size"] == 10 and len(info["tar_files"]) == len(keys) // 10
    for name in info["tar_files"]:
        assert len(_tar_samples(fs, f"{layout.balanced_dir}/{name}")) == 10
    with fs.open(layout.precached_wdinfo, "rb") as f:
        assert pickle.load(f)["tar_files"] == info["tar_files"]
    diffusion = [s["__key__"] for shard in summary.shards for s in _tar_samples(fs, layout.diffusion_tar(shard))]
    assert sorted(diffusion) == sorted(keys)
    for folder, n in ((layout.images_dir, len(keys)), (layout.diffusion_dir, len(keys))):
        for name in (".info.json", ".info.yaml", "split.yaml", "dataset.yaml", "index.uuid"):
            assert fs.exists(f"{folder}/.nv-meta/{name}"), (folder, name)
        with tempfile.NamedTemporaryFile(suffix=".sqlite") as local:
            fs.get_file(f"{folder}/.nv-meta/index.sqlite", local.name)
            with sqlite3.connect(local.name) as db:
                assert db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == n
    with fs.open(layout.report_html, "rb") as f:
        assert b"Dataset report" in f.read()
