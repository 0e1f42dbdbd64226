"""End to end through Dagster: source parquet -> image shards -> CLIP embeddings -> reordered embeddings,
read back by the real webdataset, embedding-reader and DALLE2-pytorch loaders."""

import importlib.util
import sysconfig
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from orchestration.runner import run_pipeline
from shardprep.balanced import complete_tar_counts
from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config
from tests.fixtures.energon_read import energon_keys
from tests.fixtures.live_dagster import prepare_home

# the video assets are materialized for every shard too ("not applicable": no video_source)
SHARD_ASSETS = ["source_parquet", "image_shards", "video_shards", "clip_embeddings", "reordered_embeddings",
                "diffusion_samples", "video_diffusion_samples"]
GLOBAL_ASSETS = ["balanced_shards", "wdinfo", "precached_encodings", "image_energon_index", "diffusion_energon_index",
                 "dataset_report"]


def materialized(n_shards: int) -> dict:
    return {**{a: n_shards for a in SHARD_ASSETS}, **{a: 1 for a in GLOBAL_ASSETS}}


# One dataset and one Dagster instance for the module: the read-back test runs the pipeline, the
# incremental test (after it) re-runs it and adds a source file.
@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    home = prepare_home(tmp_path_factory.mktemp("dagster_home"))  # the repo's dagster.yaml: queued runs
    with dg.DagsterInstance.from_config(str(home)) as inst:
        yield inst


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, image_site, tiny_clip_dir, tiny_nemo_dirs):
    tmp_path = tmp_path_factory.mktemp("pipeline")
    _, base_url = image_site
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), base_url, n_files=2, rows_per_file=[45, 30], n_images=120, seed=3)
    config = write_config(
        tmp_path / "shardprep.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
        samples_per_shard=20, image_size=32, resize_mode="center_crop", allow_private_addresses=True,
        clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, thread_count=8, timeout=5,
        save_additional_columns=["source_id"], tar_chunk_size=10, **nemo_config(tiny_nemo_dirs))
    return config, Layout(str(tmp_path / "out")), src


def dalle2_module(name: str):
    """DALLE2-pytorch's loader module loaded by file path (its package __init__ pulls a model stack)."""
    path = Path(sysconfig.get_paths()["purelib"]) / "dalle2_pytorch" / "dataloaders" / f"{name}.py"
    if not path.exists():
        pytest.skip("dalle2-pytorch is not installed (make setup installs it with --no-deps)")
    spec = importlib.util.spec_from_file_location(f"dalle2_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_output_is_read_back_by_the_real_tools(dataset, instance):
    import torchvision.transforms as T
    from embedding_reader import EmbeddingReader

    config, layout, _ = dataset
    summary = run_pipeline(config, instance=instance, progress=False)  # the default: queued, through the daemon
    assert summary.ok, summary.failed
    # the 5 shards in one run through every per-shard asset (8 shards per run by default), then the global assets
    assert len(summary.backfills) == 2 and summary.runs == 2
    assert summary.shards == ["00000", "00001", "00002", "00003", "00004"]
    assert summary.materialized == materialized(5)

    ledger = load_ledger(layout)
    ours: dict[str, np.ndarray] = {}
    statuses = set()
    for shard in summary.shards:
        rows = ledger.shard(shard).rows
        table = pq.read_table(layout.shard_parquet(shard)).to_pandas()
        assert len(table) == rows  # one parquet row per input row, failures included
        statuses |= set(table["status"])
        ok = table[table.status == "success"]["key"].tolist()
        samples = list(wds.WebDataset(layout.tar(shard), shardshuffle=False))
        assert [s["__key__"] for s in samples] == sorted(ok)
        assert all({"jpg", "json", "txt"} <= set(s) for s in samples)
        img = np.load(layout.img_emb(shard))
        meta = pq.read_table(layout.emb_metadata(shard)).to_pandas()
        assert img.dtype == np.float16 and len(img) == len(meta) == len(ok)
        assert np.allclose(np.linalg.norm(img.astype(np.float32), axis=1), 1, atol=1e-2)
        reordered = np.load(layout.reordered_img(shard))
        assert reordered.shape == (rows, img.shape[1]) and reordered.dtype == np.float16
        for row, key in enumerate(meta["image_path"]):
            ours[key] = img[row]
            assert np.array_equal(reordered[index_of_key(key, 2)], img[row])  # 20/shard: 2-digit index
        failed_rows = [index_of_key(k, 2) for k in table[table.status != "success"]["key"]]
        assert not reordered[failed_rows].any()
    assert {"success", "failed_to_download", "failed_to_resize"} <= statuses

    # DALLE2-pytorch's own decoder loader: every key comes back with the embedding we computed
    decoder_loader = dalle2_module("decoder_loader")
    tars = [layout.tar(s) for s in summary.shards if Path(layout.tar(s)).exists()]
    loader = decoder_loader.create_image_embedding_dataloader(
        tar_url=tars, num_workers=1, batch_size=4, img_embeddings_url=layout.reordered_img_dir,
        text_embeddings_url=layout.reordered_text_dir, index_width=2, shuffle_shards=False,
        img_preproc=T.ToTensor(), extra_keys=["__key__"], handler=wds.handlers.reraise_exception)
    seen = {}
    for img, emb, keys in loader:
        assert img.shape[1:] == (3, 32, 32)
        for i, key in enumerate(keys):
            seen[key] = emb["img"][i].numpy()
    assert seen.keys() == ours.keys()
    assert all(np.array_equal(seen[k], ours[k]) for k in ours)

    # our loader yields the same as DALLE2's
    from shardprep.dataloaders import create_image_embedding_dataloader

    mine = create_image_embedding_dataloader(
        tar_url=tars, num_workers=0, batch_size=4, img_embeddings_url=layout.reordered_img_dir,
        text_embeddings_url=layout.reordered_text_dir, index_width=2, shuffle_shards=False,
        img_preproc=T.ToTensor(), extra_keys=["__key__"])
    got = {k: e for _, emb, keys in mine for k, e in zip(keys, emb["img"].numpy())}
    assert got.keys() == ours.keys() and all(np.array_equal(got[k], ours[k]) for k in ours)

    # embedding-reader reads clip_embeddings with their metadata, rows aligned with keys
    reader = EmbeddingReader(str(Path(layout.img_emb("x")).parent), file_format="parquet_npy",
                             meta_columns=["image_path", "caption"],
                             metadata_folder=str(Path(layout.emb_metadata("x")).parent))
    assert reader.count == len(ours)
    for embs, meta in reader(batch_size=16, show_progress=False):
        for e, key in zip(embs, meta["image_path"]):
            assert np.allclose(e, ours[key].astype(np.float32))

    check_nemo_outputs(layout, set(ours))


def check_nemo_outputs(layout: Layout, success_keys: set) -> None:
    """wdinfo and balanced tars as NeMo reads them; both energon indexes through the real energon loader."""
    import pickle

    import torch
    from megatron.energon import Cooker, DefaultTaskEncoder, basic_sample_keys, stateless

    info = pickle.loads(Path(layout.balanced_wdinfo).read_bytes())
    assert set(info) == {"tar_files", "chunk_size", "total_key_count"} and info["chunk_size"] == 10
    assert info["total_key_count"] == 10 * len(info["tar_files"]) and info["tar_files"]
    for name in info["tar_files"]:
        assert len(list(wds.WebDataset(f"{layout.balanced_dir}/{name}", shardshuffle=False))) == 10
    pre = pickle.loads(Path(layout.precached_wdinfo).read_bytes())
    assert pre["tar_files"] == info["tar_files"]
    sample = next(iter(wds.WebDataset(f"{layout.precached_dir}/{pre['tar_files'][0]}", shardshuffle=False)))
    enc = pickle.loads(sample["pickle"])
    assert set(enc) == {"autoencoderkl_image", "clip-vit-large-patch14_text"}

    # image index: CaptioningSample batches cover every successful key exactly once across the splits
    keys = energon_keys(layout.images_dir, "train") + energon_keys(layout.images_dir, "val")
    assert sorted(keys) == sorted(success_keys)

    @stateless
    def cook(sample: dict) -> dict:
        return dict(**basic_sample_keys(sample), pth=sample[".pth"], pickle=sample[".pickle"], json=sample[".json"])

    class Crude(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        @stateless
        def encode_sample(self, sample):
            assert sample["pth"].dtype == torch.bfloat16 and sample["pth"].shape == (16, 1, 4, 4)
            assert sample["pickle"].dtype == np.float16 and sample["json"]["source_key"] == sample["__key__"]
            return sample

        def batch(self, samples):  # T5 states differ in length: keep the samples as they are
            return samples

    diffusion = energon_keys(layout.diffusion_dir, "train", Crude()) + \
        energon_keys(layout.diffusion_dir, "val", Crude())
    assert sorted(diffusion) == sorted(success_keys)


def test_rerun_does_only_missing_work(dataset, instance, image_site):
    config, layout, src = dataset  # already run by the test above (or run now when selected alone)
    first = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert first.ok and first.runs in (0, 6)  # 5 shards + the global run, when not run before
    before = _snapshot(Path(layout.root))
    complete_before = list(complete_tar_counts(layout.balanced_dir))

    again = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert again.ok and again.runs == 0 and again.new_shards == []
    assert _snapshot(Path(layout.root)) == before

    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[25], n_images=120, seed=9,
                                   prefix="zz-new")
    third = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert third.ok and third.new_shards == ["00005", "00006"] and third.runs == 3  # 2 shards + global run
    after = _snapshot(Path(layout.root))
    # per-shard outputs and complete balanced tars never change; energon keeps old tars' .tar.idx
    immutable = [p for p in before if p.parts[0] in ("parquet", "images", "embeddings", "embeddings_reordered",
                                                     "diffusion", "precached") and ".nv-meta" not in p.parts
                 and p.suffix != ".pkl"]
    immutable += [Path("balanced") / n for n in complete_before]
    assert [p for p in immutable if after[p] != before[p]] == []
    assert any(p.name.endswith(".tar.idx") and p.parts[0] == "images" for p in immutable)
    assert third.materialized == materialized(7)
    assert len(complete_tar_counts(layout.balanced_dir)) > len(complete_before)  # new tars were added
