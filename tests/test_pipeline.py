"""End to end through Dagster: source parquet -> image shards -> CLIP embeddings -> reordered embeddings,
read back by the real webdataset, embedding-reader and DALLE2-pytorch loaders."""

import importlib.util
import os
import subprocess
import sysconfig
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.nemo.balanced import complete_tar_counts
from shardprep_dagster.orchestration.launch import in_flight
from shardprep_dagster.orchestration.recovery import recover_dead_runs
from shardprep_dagster.orchestration.runner import make_plan, run_pipeline
from shardprep_dagster.resources.dataset import PID_TAG
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config
from tests.fixtures.energon_read import energon_keys
from tests.fixtures.live_dagster import prepare_home
from tests.fixtures.score_heads import build_tiny_score_heads

# the video assets are materialized for every shard too ("not applicable": no video_source)
SHARD_ASSETS = ["source_parquet", "image_shards", "video_shards", "clip_embeddings", "reordered_embeddings",
                "image_scores", "diffusion_samples", "video_diffusion_samples"]
GLOBAL_ASSETS = ["takedowns", "duplicates", "sample_selection", "balanced_shards", "wdinfo", "precached_encodings",
                 "image_energon_index", "diffusion_energon_index", "dataset_report"]


# the tiny random CLIP puts different images at cosine up to ~0.998: only copies are duplicates here
# (tests/test_dedup.py plants near copies in real embedding space)
DEDUP_THRESHOLD = 0.999


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
    heads = build_tiny_score_heads(str(tmp_path / "heads"), dim=32)  # the tiny CLIP's width
    _, base_url = image_site
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), base_url, n_files=2, rows_per_file=[45, 30], n_images=120, seed=3)
    config = write_config(
        tmp_path / "shardprep.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
        samples_per_shard=20, image_size=32, resize_mode="center_crop", allow_private_addresses=True,
        clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, thread_count=8, timeout=5,
        save_additional_columns=["source_id"], tar_chunk_size=10, aesthetic_model=heads["aesthetic"],
        nsfw_model=heads["nsfw"], dedup=True, dedup_threshold=DEDUP_THRESHOLD, **nemo_config(tiny_nemo_dirs))
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
    # the 5 shards through every per-shard asset in one run per download slot (fewer shards than the slots'
    # 16 shards per run each: orchestration.queued.spread), then the global assets in a run of this process
    # (the in-process executor: orchestration.queued._globals_here), one run, not a backfill
    slots = instance.event_log_storage.get_concurrency_info("download").slot_count
    assert len(summary.backfills) == min(5, slots) and summary.runs == min(5, slots) + 1
    global_runs = [r for r in instance.get_runs() if "dagster/backfill" not in r.tags]
    assert len(global_runs) == 1 and global_runs[0].status == dg.DagsterRunStatus.SUCCESS
    assert global_runs[0].tags[PID_TAG] == str(os.getpid())  # a kill of this process leaves it recoverable
    assert summary.global_run == global_runs[0].run_id
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

    aesthetic = check_scores(config, layout, ours)
    dropped = check_duplicates(layout, ours)
    # dedup: true is a curation rule: the energon datasets leave the duplicates out
    check_nemo_outputs(layout, set(ours) - set(dropped), aesthetic)


def check_duplicates(layout: Layout, embeddings: dict) -> dict:
    """duplicates (an exact index at this size): against brute force over every sample,
    no two kept samples share their bytes or are near copies, and each dropped one names a kept sample it
    copies; ``{key: kept_key}`` of the dropped ones."""
    import pandas as pd

    masks = pd.concat([pq.read_table(p).to_pandas() for p in sorted(Path(layout.dedup_shards_dir).glob("*.parquet"))])
    assert sorted(masks["key"]) == sorted(embeddings)
    hashes = {}
    for p in sorted(Path(layout.images_dir).glob("*.parquet")):
        t = pq.read_table(p).to_pandas()
        hashes.update(zip(t["key"], t["sha256"]))
    kept = masks[masks["keep"]]["key"].tolist()
    assert len(set(hashes[k] for k in kept)) == len(kept)  # no exact copy kept
    e = np.stack([embeddings[k].astype(np.float32) for k in kept])
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    sims = e @ e.T
    np.fill_diagonal(sims, 0)
    assert sims.max() < DEDUP_THRESHOLD  # no near copy kept
    dropped = masks[~masks["keep"]]  # none in the first two files; the third repeats their images
    for key, kept_key, reason in zip(dropped["key"], dropped["duplicate_of"], dropped["reason"]):
        assert kept_key in set(kept) and kept_key < key  # the first arrival is kept
        if reason == "exact":
            assert hashes[key] == hashes[kept_key]
        else:
            a, b = (embeddings[k].astype(np.float32) for k in (key, kept_key))
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= DEDUP_THRESHOLD - 1e-3
    table = pq.read_table(layout.dedup_table).to_pandas()
    assert sorted(table["key"]) == sorted(dropped["key"])
    return dict(zip(dropped["key"], dropped["duplicate_of"]))


def check_scores(config: str, layout: Layout, embeddings: dict) -> dict:
    """image_scores: the configured heads' scores of every embedded sample, as the published torch modules
    compute them on the float32, L2-normalised embeddings; joined into clip-retrieval's metadata parquet."""
    import pandas as pd
    import torch

    from shardprep.config import load_config
    from shardprep.verify import verify_shard
    from tests.fixtures.score_heads import NsfwL14, aesthetic_v2

    cfg = load_config(config)
    modules = {"aesthetic_score": aesthetic_v2(dim=32), "nsfw_score": NsfwL14(dim=32)}
    for column, path in (("aesthetic_score", cfg.aesthetic_model), ("nsfw_score", cfg.nsfw_model)):
        modules[column].load_state_dict(torch.load(path, weights_only=True))
    scores = pd.concat([pq.read_table(p).to_pandas() for p in sorted(Path(layout.root, "scores").glob("*.parquet"))])
    assert sorted(scores["key"]) == sorted(embeddings) and set(scores["aesthetic_model"]) == {cfg.aesthetic_model}
    x = torch.from_numpy(np.stack([embeddings[k] for k in scores["key"]]).astype(np.float32))
    x = x / x.norm(dim=1, keepdim=True)
    for column, module in modules.items():
        with torch.no_grad():
            want = module.eval()(x)[:, 0].numpy()
        np.testing.assert_allclose(scores[column].to_numpy(), want, rtol=1e-4, atol=1e-5)
    assert scores["aesthetic_score"].std() > 0.01 and ((scores["nsfw_score"] > 0) & (scores["nsfw_score"] < 1)).all()
    # the same columns in the metadata parquet, row for row; clip_embeddings' outputs still verify
    for shard in (p.stem for p in Path(layout.root, "scores").glob("*.parquet")):
        meta = pq.read_table(layout.emb_metadata(shard)).to_pandas()
        mine = scores.set_index("key").loc[meta["image_path"]]
        assert np.array_equal(meta["aesthetic_score"].to_numpy(), mine["aesthetic_score"].to_numpy())
        assert not verify_shard(layout, cfg, "clip_embeddings", shard).problems
    # the UI's top and bottom contact sheets of a shard by aesthetic score
    from shardprep_dagster.assets.scores import extremes_metadata

    sheets = extremes_metadata(layout, shard)
    assert set(sheets) == {"top_by_aesthetic", "bottom_by_aesthetic"}
    assert all(v.value.startswith("![") and "(data:image/" in v.value for v in sheets.values())
    return dict(zip(scores["key"], scores["aesthetic_score"].astype(float)))


def check_nemo_outputs(layout: Layout, success_keys: set, aesthetic: dict | None = None) -> None:
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

    # image index: CaptioningSample batches cover every selected key exactly once across the splits
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
            if aesthetic is not None:  # image_scores' score, which NeMo's task encoder filters on
                assert sample["json"]["aesthetic_score"] == pytest.approx(aesthetic[sample["__key__"]], abs=1e-5)
            return sample

        def batch(self, samples):  # T5 states differ in length: keep the samples as they are
            return samples

    diffusion = energon_keys(layout.diffusion_dir, "train", Crude()) + \
        energon_keys(layout.diffusion_dir, "val", Crude())
    assert sorted(diffusion) == sorted(success_keys)


def test_the_global_run_here_is_in_flight_from_its_creation_and_recovered_when_its_process_dies(dataset, instance):
    """Another `shardprep run` must see the unpartitioned assets' run in flight from the moment this process
    decides to run them (created under the submit lock, before it executes), and a kill of this process
    must not leave it in flight for ever."""
    from shardprep_dagster.orchestration.queued import _global_run, _globals_here

    config, _, _ = dataset
    plan = make_plan(config, instance)
    assert _globals_here(plan)  # the default executor
    _, run = _global_run(plan, instance)
    busy, _ = in_flight(instance)
    assert {k: v for k, v in busy.items() if k in plan.global_keys} == {k: {""} for k in plan.global_keys}
    assert recover_dead_runs(instance) == []  # this process is alive
    dead = subprocess.Popen(["true"])
    dead.wait()
    # as if this process had been killed between creating the run and executing it
    instance.add_run_tags(run.run_id, {PID_TAG: str(dead.pid)})
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.NOT_STARTED
    assert recover_dead_runs(instance) == [run.run_id]
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    assert not any(k in in_flight(instance)[0] for k in plan.global_keys)


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
    # the new file's repeats of images from the first two files are found without re-reading their shards
    import pandas as pd

    new = pd.concat([pq.read_table(layout.dedup_shard(s)).to_pandas() for s in ("00005", "00006")])
    assert (new["duplicate_of"].dropna().str[:5].astype(int) < 5).any()  # kept in a shard of the first files
    ours = {k: e for s in third.shards if Path(layout.img_emb(s)).exists()
            for k, e in zip(pq.read_table(layout.emb_metadata(s)).column("image_path").to_pylist(),
                            np.load(layout.img_emb(s)))}
    dropped = check_duplicates(layout, ours)  # against brute force over all 7 shards
    # the new file repeats images of the first two: its copies are not added to the balanced tars
    balanced = [s["__key__"] for p in sorted(Path(layout.balanced_dir).glob("*.tar"))
                for s in wds.WebDataset(str(p), shardshuffle=False)]
    assert dropped and sorted(balanced) == sorted(set(ours) - set(dropped))


def test_a_new_score_head_rescores_without_redoing_downloads_or_embeddings(dataset, instance, tmp_path):
    """Another aesthetic head re-runs image_scores and what reads the scores (diffusion samples' json,
    the global outputs), never the downloads or the embeddings."""
    import yaml

    config, layout, _ = dataset
    assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok  # current first

    def counts() -> dict:
        return {a: len(instance.fetch_materializations(dg.AssetKey(a), limit=10_000).records)
                for a in SHARD_ASSETS + GLOBAL_ASSETS}

    before, old_scores = counts(), pq.read_table(layout.scores("00000")).to_pandas()
    fields = yaml.safe_load(Path(config).read_text())
    fields["aesthetic_model"] = build_tiny_score_heads(str(tmp_path / "heads"), dim=32, seed=99)["aesthetic"]
    changed = write_config(tmp_path / "changed.yaml", **fields)
    summary = run_pipeline(changed, instance=instance, progress=False, in_process=True)
    assert summary.ok, summary.failed
    done = {a: n - before[a] for a, n in counts().items() if n != before[a]}
    shards = len(summary.shards)
    assert {a: done.get(a, 0) for a in SHARD_ASSETS} == {
        **{a: 0 for a in SHARD_ASSETS}, "image_scores": shards, "diffusion_samples": shards,
        "video_shards": 0, "video_diffusion_samples": 0}
    new_scores = pq.read_table(layout.scores("00000")).to_pandas()
    assert list(new_scores["key"]) == list(old_scores["key"])
    assert not np.allclose(new_scores["aesthetic_score"], old_scores["aesthetic_score"])
    np.testing.assert_array_equal(new_scores["nsfw_score"], old_scores["nsfw_score"])


def _crude():
    """A task encoder that reads the diffusion dataset's CrudeWebdataset samples as they are."""
    from megatron.energon import Cooker, DefaultTaskEncoder, basic_sample_keys, stateless

    @stateless
    def cook(sample: dict) -> dict:
        return dict(**basic_sample_keys(sample), json=sample[".json"])

    class Crude(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        def batch(self, samples):
            return samples

    return Crude()


def test_curation_rules_reselect_without_redoing_any_shard(dataset, instance, tmp_path):
    """aesthetic_min, nsfw_max and caption_min_length on top of dedup: only the selection and the global
    outputs are redone; the balanced tars, both energon datasets (through the real energon loader) and the
    decoder loader's selection_url hold exactly the selected samples, and the diffusion json carries the
    computed aesthetic_score NeMo filters on."""
    import pandas as pd
    import torchvision.transforms as T
    import yaml

    from shardprep.dataloaders import create_image_embedding_dataloader

    config, layout, _ = dataset
    assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
    scores = pd.concat([pq.read_table(p).to_pandas() for p in sorted(Path(layout.scores_dir).glob("*.parquet"))])
    fields = yaml.safe_load(Path(config).read_text())
    fields.update(aesthetic_min=float(scores["aesthetic_score"].quantile(0.3)),
                  nsfw_max=float(scores["nsfw_score"].quantile(0.8)), caption_min_length=12)
    changed = write_config(tmp_path / "rules.yaml", **fields)

    def counts() -> dict:
        return {a: len(instance.fetch_materializations(dg.AssetKey(a), limit=10_000).records)
                for a in SHARD_ASSETS + GLOBAL_ASSETS}

    before = counts()
    summary = run_pipeline(changed, instance=instance, progress=False, in_process=True)
    assert summary.ok, summary.failed
    assert summary.materialized == materialized(len(summary.shards))
    done = {a: n - before[a] for a, n in counts().items() if n != before[a]}
    assert not set(done) & set(SHARD_ASSETS), done  # no download, embedding, score or latent again
    assert {"sample_selection", "balanced_shards", "image_energon_index", "diffusion_energon_index"} <= set(done)

    # the selection, recomputed here from the inputs it reads
    dedup = pd.concat([pq.read_table(p).to_pandas() for p in sorted(Path(layout.dedup_shards_dir).glob("*.parquet"))])
    shards = pd.concat([pq.read_table(layout.shard_parquet(s)).to_pandas() for s in summary.shards])
    shards = shards[shards.status == "success"].merge(scores, on="key").merge(dedup[["key", "keep"]], on="key")
    want = set(shards[shards["keep"] & (shards.aesthetic_score >= fields["aesthetic_min"])
                      & (shards.nsfw_score <= fields["nsfw_max"]) & (shards.caption.str.len() >= 12)]["key"])
    assert 0 < len(want) < len(shards)
    selection = pd.concat([pq.read_table(layout.selection(s)).to_pandas() for s in summary.shards])
    assert set(selection[selection.keep]["key"]) == want
    assert set(selection[~selection.keep]["reason"]) <= {"dedup", "nsfw_max", "aesthetic_min", "caption_min_length"}

    # the outputs a trainer reads: exactly the selected samples
    energon = energon_keys(layout.images_dir, "train") + energon_keys(layout.images_dir, "val")
    assert sorted(energon) == sorted(want)
    diffusion = energon_keys(layout.diffusion_dir, "train", _crude()) + energon_keys(layout.diffusion_dir, "val",
                                                                                      _crude())
    assert sorted(diffusion) == sorted(want)
    balanced = [s["__key__"] for p in sorted(Path(layout.balanced_dir).glob("*.tar"))
                for s in wds.WebDataset(str(p), shardshuffle=False)]
    assert sorted(balanced) == sorted(want)
    tars = [layout.tar(s) for s in summary.shards if Path(layout.tar(s)).exists()]
    loader = create_image_embedding_dataloader(
        tar_url=tars, num_workers=0, batch_size=4, img_embeddings_url=layout.reordered_img_dir, index_width=2,
        shuffle_shards=False, img_preproc=T.ToTensor(), extra_keys=["__key__"], selection_url=layout.selection_dir)
    assert sorted(k for _, _, keys in loader for k in keys) == sorted(want)
    # the prior loader (text-conditioned: keys from the metadata): the selected rows' embeddings only
    from shardprep.dataloaders import get_reader, make_splits

    reader = get_reader(True, img_url=str(Path(layout.img_emb("x")).parent),
                        meta_url=str(Path(layout.emb_metadata("x")).parent))
    splits = make_splits(True, 8, reader.count, 0.6, 0.2, reader, selection_url=layout.selection_dir)
    rows = np.concatenate([emb.numpy() for split in splits for emb, _ in split])
    emb = {k: e for s in summary.shards if Path(layout.img_emb(s)).exists()
           for k, e in zip(pq.read_table(layout.emb_metadata(s)).column("image_path").to_pylist(),
                           np.load(layout.img_emb(s)))}
    assert sorted(map(bytes, rows.astype(np.float32))) == sorted(bytes(emb[k].astype(np.float32)) for k in want)

    # the report's curation section: histograms, top and bottom images with their scores, kept per rule
    page = Path(layout.report_html).read_text()
    for part in ('id="aesthetic_scores"', 'id="nsfw_scores"', 'id="top_aesthetic"', 'id="bottom_aesthetic"',
                 'id="selection"', f"Selection: {len(want):,} of {len(shards):,} samples kept"):
        assert part in page, part
    best = scores.sort_values("aesthetic_score", ascending=False).iloc[0]
    assert f'{best["key"]}: {best["aesthetic_score"]:.3f}' in page
    pairs = min(8, pq.read_metadata(layout.dedup_table).num_rows)  # duplicates beside the sample kept
    assert ('id="duplicates"' in page) == bool(pairs)
    assert page.count('<figure class="thumb"><img src="data:image/jpeg') == 16 + 2 * pairs  # 8 top, 8 bottom
