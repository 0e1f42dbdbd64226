"""The caption each sample trains with (``train_caption``, ``training_text``): synthetic, or both (half by
key), written into the image tar's json with every other member kept byte for byte; the NeMo diffusion
samples keep their latents when only the text changes; through Dagster, the balanced tars' .txt, the real
energon loader's CaptioningSample and the NeMo T5 states carry the synthetic captions, and changing
train_caption re-runs only what depends on the text."""

import io
import json
import os
import pickle
import tarfile
import warnings
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from shardprep.config import ConfigError, config_from_dict
from shardprep.layout import Layout
from shardprep.training_text import choose, takes_synthetic, write_training_text
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config
from tests.fixtures.tiny_blip import build_tiny_blip
from tests.test_watermark import detector_files  # noqa: F401 - the module's fixture, shared


@pytest.fixture(scope="module")
def blip_dir(tmp_path_factory) -> str:
    return build_tiny_blip(str(tmp_path_factory.mktemp("tiny_blip")))


def test_the_choice_per_mode():
    keys = [f"{i:09d}" for i in range(400)]
    assert all(choose(k, "src", "vlm", "synthetic") == ("vlm", "synthetic") for k in keys)
    assert all(choose(k, "src", "vlm", "original") == ("src", "original") for k in keys)
    # no synthetic caption (the captioner skipped the image): the original, whatever the mode
    assert choose(keys[0], "src", None, "synthetic") == ("src", "original")
    both = [choose(k, "src", "vlm", "both")[1] for k in keys]
    assert 160 < both.count("synthetic") < 240  # about half, by key alone...
    assert both == [choose(k, "other", "text", "both")[1] for k in keys]  # ...whatever the texts
    assert [takes_synthetic(k, "both") for k in keys] == [s == "synthetic" for s in both]
    with pytest.raises(ValueError, match="train_caption must be one of"):
        choose(keys[0], "a", "b", "mixed")
    with pytest.raises(ConfigError, match=r"'train_caption': 'synthetic' needs 'captioner'"):
        config_from_dict({"source": "/s/*.parquet", "output_root": "/o", "train_caption": "synthetic"})


def _tar_members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def test_the_json_gains_the_choice_and_nothing_else_changes(tmp_path):
    from shardprep.verify import verify_training_text

    layout = Layout(str(tmp_path))
    os.makedirs(os.path.dirname(layout.tar("00000")))
    keys = [f"00000{i:04d}" for i in range(6)]
    with wds.TarWriter(layout.tar("00000")) as sink:
        for i, key in enumerate(keys):
            meta = {"url": f"http://x/{i}.jpg", "caption": f"alt text {i}", "key": key, "status": "success"}
            sink.write({"__key__": key, "jpg": synthetic.render_image(i, 20, 20).tobytes(),
                        "txt": f"alt text {i}", "json": json.dumps(meta, indent=4)})
    before = _tar_members(layout.tar("00000"))
    os.makedirs(layout.captions_dir)
    # the captioner skipped the third sample (no caption) and has no row for the last
    pq.write_table(pa.table({"key": keys[:5], "caption": ["vlm 0", "vlm 1", None, "vlm 3", "vlm 4"],
                             "original_caption": [f"alt text {i}" for i in range(5)]}), layout.captions("00000"))

    report = write_training_text("00000", layout, "synthetic")
    assert (report.samples, report.synthetic, report.without_synthetic, report.jsons_rewritten) == (6, 4, 2, 6)
    after = _tar_members(layout.tar("00000"))
    assert list(after) == list(before)  # member order kept
    assert {n: b for n, b in after.items() if not n.endswith(".json")} == {
        n: b for n, b in before.items() if not n.endswith(".json")}  # every other member byte for byte
    samples = {s["__key__"]: s for s in wds.WebDataset(layout.tar("00000"), shardshuffle=False).decode()}
    trained = {k: s["json"]["train_caption"] for k, s in samples.items()}
    assert trained == {keys[0]: "vlm 0", keys[1]: "vlm 1", keys[2]: "alt text 2", keys[3]: "vlm 3",
                       keys[4]: "vlm 4", keys[5]: "alt text 5"}
    assert samples[keys[0]]["json"]["caption"] == "alt text 0" and samples[keys[0]]["txt"] == "alt text 0"
    assert samples[keys[0]]["json"]["synthetic_caption"] == "vlm 0"
    assert samples[keys[2]]["json"]["train_caption_source"] == "original"
    assert samples[keys[0]]["json"]["url"] == "http://x/0.jpg"  # the source's fields kept
    rows = pq.read_table(layout.training_text("00000")).to_pylist()
    assert [(r["key"], r["train_caption"]) for r in rows] == list(trained.items())
    assert verify_training_text(layout, "00000").ok

    # the same choice again: nothing rewritten; another mode: the jsons follow it
    assert write_training_text("00000", layout, "synthetic").jsons_rewritten == 0
    both = write_training_text("00000", layout, "both")
    assert both.synthetic == sum(takes_synthetic(k, "both") for k in keys[:5] if k != keys[2])
    assert verify_training_text(layout, "00000").ok
    # a tar changed behind the parquet's back is found
    write_training_text("00000", layout, "synthetic")
    pq.write_table(pq.read_table(layout.training_text("00000")).slice(1), layout.training_text("00000"))
    assert not verify_training_text(layout, "00000").ok


def test_diffusion_samples_keep_their_latents_when_only_the_text_changes(tmp_path, tiny_nemo_dirs):
    from shardprep.models.nemo import ImageAutoencoder, T5TextEncoder
    from shardprep.nemo.diffusion import write_diffusion_samples

    layout = Layout(str(tmp_path))
    os.makedirs(os.path.dirname(layout.tar("00000")))
    keys = [f"00000{i:04d}" for i in range(5)]
    with wds.TarWriter(layout.tar("00000")) as sink:
        for i, key in enumerate(keys):
            buf = io.BytesIO()
            synthetic.render_image(i, 40, 40).save(buf, "JPEG")
            sink.write({"__key__": key, "jpg": buf.getvalue(), "txt": f"alt text {i}",
                        "json": json.dumps({"caption": f"alt text {i}", "key": key})})
    t5 = T5TextEncoder(tiny_nemo_dirs["t5"], device="cpu")
    vae = ImageAutoencoder(tiny_nemo_dirs["autoencoder"], device="cpu")
    first = write_diffusion_samples("00000", layout, t5, vae, resolution=32, batch_size=2)
    assert first.samples == 5 and first.latents_reused == 0
    old = _tar_members(layout.diffusion_tar("00000"))

    os.makedirs(layout.captions_dir)
    pq.write_table(pa.table({"key": keys, "caption": [f"a synthetic caption number {i}" for i in range(5)]}),
                   layout.captions("00000"))
    write_training_text("00000", layout, "synthetic")
    calls = []
    encode = vae.encode
    vae.encode = lambda *a, **k: calls.append(len(a[0])) or encode(*a, **k)  # count the images encoded
    try:
        second = write_diffusion_samples("00000", layout, t5, vae, resolution=32, batch_size=2, synthetic_text=True)
    finally:
        del vae.encode
    assert second.samples == 5 and second.latents_reused == 5 and calls == []
    assert second.latent_shape == first.latent_shape
    new = _tar_members(layout.diffusion_tar("00000"))
    for key in keys:
        assert new[f"{key}..pth"] == old[f"{key}..pth"]  # the very latent, not encoded again
        want = t5.encode([f"a synthetic caption number {int(key[-4:])}"])[0]
        assert (pickle.loads(new[f"{key}..pickle"]) == want).all()
        assert json.loads(new[f"{key}..json"])["caption"] == f"a synthetic caption number {int(key[-4:])}"
    # a changed image is encoded again (its latent id differs); rebuild encodes all
    third = write_diffusion_samples("00000", layout, t5, vae, resolution=32, batch_size=2, synthetic_text=True,
                                    reuse_latents=False)
    assert third.latents_reused == 0 and third.samples == 5


def _count(instance, asset: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records:
        out[r.partition_key] = out.get(r.partition_key, 0) + 1
    return out


def _energon_captions(dataset_dir: str) -> dict[str, str]:
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    out = {}
    for split in ("train", "val"):
        ds = get_train_dataset(dataset_dir, split_part=split, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                               batch_size=1, shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False)
        for batch in get_loader(ds):
            assert type(batch).__name__ == "CaptioningSample"
            out.update({k.split("/")[-1]: c for k, c in zip(batch.__key__, batch.caption)})
    return out


def test_pipeline_trains_on_synthetic_captions_and_a_new_choice_redoes_only_the_text(
        tmp_path, image_site, tiny_clip_dir, tiny_nemo_dirs, blip_dir, detector_files):  # noqa: F811
    """The issue's whole config: watermark_model, captioner and train_caption: synthetic."""
    from shardprep import pixels
    from shardprep.tars import iter_samples, sample_keys
    from shardprep.verify import verify_shard
    from shardprep_dagster.definitions import build_defs
    from shardprep_dagster.orchestration.runner import run_pipeline

    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=16, n_images=120, seed=5)
    fields = dict(source=f"{src}/*.parquet", output_root=str(tmp_path / "out"), samples_per_shard=8, image_size=32,
                  allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=8, tar_chunk_size=4,
                  captioner=blip_dir, caption_max_new_tokens=6, caption_batch_size=4, train_caption="synthetic",
                  watermark_model=detector_files[1],
                  **nemo_config(tiny_nemo_dirs))
    layout = Layout(fields["output_root"])
    config = tmp_path / "c.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_defs(write_config(config, **fields)).resolve_asset_graph()
        assert dg.AssetKey("training_text") in graph.get(dg.AssetKey("diffusion_samples")).parent_keys
        off = build_defs(write_config(tmp_path / "off.yaml", **{**fields, "train_caption": "original"}))
        off = off.resolve_asset_graph()
        # off: not in the graph, and no asset waits on it
        assert dg.AssetKey("training_text") not in off.materializable_asset_keys
        assert all(dg.AssetKey("training_text") not in off.get(k).parent_keys for k in off.materializable_asset_keys)
    home = tmp_path / "home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        decodes = pixels.DECODES
        first = run_pipeline(write_config(config, **fields), instance=instance, progress=False, in_process=True)
        assert first.ok, first.failed
        shards = sorted(p.stem for p in Path(layout.images_dir).glob("*.tar"))
        assert shards == ["00000", "00001"]
        # CLIP, the watermark detector and the captioner from one decode of each image
        assert pixels.DECODES - decodes == sum(len(sample_keys(layout.tar(s))) for s in shards)
        for shard in shards:
            scores = pq.read_table(layout.scores(shard)).column("pwatermark").to_pylist()
            assert scores and all(0.0 <= p <= 1.0 for p in scores)
        cfg = config_from_dict(dict(fields))
        synthetic_of = {}
        for shard in shards:
            caps = {r["key"]: r["caption"] for r in pq.read_table(layout.captions(shard)).to_pylist()}
            assert all(caps.values())
            synthetic_of.update(caps)
            for s in iter_samples(layout.tar(shard)):
                meta = json.loads(s["json"])
                assert meta["synthetic_caption"] == meta["train_caption"] == caps[s["__key__"]]
                assert s["txt"].decode() == (meta["caption"] or "")  # the img2dataset .txt stays the source's
            for artifact in ("training_text", "image_shards", "diffusion_samples"):
                assert verify_shard(layout, cfg, artifact, shard).ok, artifact
        # the report: both caption lengths over the same bins, and samples with both captions
        page = Path(layout.report_html).read_text()
        assert 'id="synthetic_caption_lengths"' in page and 'id="original_caption_lengths"' in page
        first_key = next(iter(synthetic_of))
        assert 'id="captions"' in page and f"VLM: {synthetic_of[first_key]}" in page
        # balanced tars: every .txt the synthetic caption
        balanced = {s["__key__"]: s["txt"].decode() for t in sorted(Path(layout.balanced_dir).glob("*.tar"))
                    for s in iter_samples(str(t))}
        assert balanced and all(balanced[k] == synthetic_of[k] for k in balanced)
        # the real energon loader: CaptioningSample.caption is the synthetic caption
        got = _energon_captions(layout.images_dir)
        assert got and all(got[k] == synthetic_of[k] for k in got)
        # the DALLE2 prior: text-conditioned, the metadata's captions; else the text embeddings, both of the
        # synthetic captions, row for row with the image embeddings
        import numpy as np

        from shardprep.dataloaders import get_reader
        from shardprep.models.clip import load_clip_encoder

        img_dir = str(Path(layout.img_emb("x")).parent)
        reader = get_reader(True, img_url=img_dir, meta_url=str(Path(layout.train_text_metadata("x")).parent))
        read = {}
        for _, meta in reader(batch_size=100, start=0, end=reader.count, show_progress=False):
            read.update(zip(meta["image_path"], meta["caption"]))
        assert read and read == {k: synthetic_of[k] for k in read} and reader.count == len(read)
        _, text_reader = get_reader(False, img_url=img_dir, txt_url=str(Path(layout.train_text_emb("x")).parent))
        rows = np.concatenate([e for e, _ in text_reader(batch_size=100, start=0, end=text_reader.count,
                                                           show_progress=False)])
        keys = [k for shard in shards for k in pq.read_table(layout.emb_metadata(shard)).column("image_path").to_pylist()]
        want = load_clip_encoder(f"hf_clip:{tiny_clip_dir}", "cpu").encode_texts([synthetic_of[k] for k in keys])
        assert rows.shape == want.shape and np.allclose(rows.astype(np.float32), want.astype(np.float32), atol=2e-3)
        # NeMo diffusion samples: the caption and the T5 states of the synthetic caption
        from shardprep.models.nemo import T5TextEncoder

        t5 = T5TextEncoder(tiny_nemo_dirs["t5"], device="cpu")
        for shard in shards:
            for s in iter_samples(layout.diffusion_tar(shard)):
                key = s["__key__"]
                assert json.loads(s[".json"])["caption"] == synthetic_of[key]
                assert pickle.loads(s[".pickle"]).shape == t5.encode([synthetic_of[key]])[0].shape
        # ... and read through energon as NeMo's DiffusionDataModule reads them (its cook(), @stateless)
        import torch
        from megatron.energon import (
            Cooker,
            DefaultTaskEncoder,
            WorkerConfig,
            basic_sample_keys,
            get_loader,
            get_train_dataset,
            stateless,
        )

        @stateless
        def cook(sample: dict) -> dict:
            return dict(**basic_sample_keys(sample), json=sample[".json"], pth=sample[".pth"], pickle=sample[".pickle"])

        class Cooked(DefaultTaskEncoder):
            cookers = [Cooker(cook)]

            def batch(self, samples):
                return samples

        cooked = {}
        for split in ("train", "val"):
            ds = get_train_dataset(layout.diffusion_dir, split_part=split, batch_size=2, shuffle_buffer_size=None,
                                   worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                                   max_samples_per_sequence=None, task_encoder=Cooked(), repeat=False)
            for batch in get_loader(ds):
                for sample in batch:
                    assert isinstance(sample["pth"], torch.Tensor)
                    cooked[sample["__key__"].split("/")[-1]] = sample["json"]["caption"]
        assert cooked and cooked == {k: synthetic_of[k] for k in cooked}
        counts = {a: _count(instance, a) for a in ("image_shards", "clip_embeddings", "captions", "training_text",
                                                    "diffusion_samples")}
        assert counts["training_text"] == {"00000": 1, "00001": 1}
        pth = {s["__key__"]: s[".pth"] for shard in shards for s in iter_samples(layout.diffusion_tar(shard))}

        # both: only the text-dependent outputs run again, and no image is encoded again
        second = run_pipeline(write_config(config, **{**fields, "train_caption": "both"}), instance=instance,
                              progress=False, in_process=True)
        assert second.ok, second.failed
        for a in ("image_shards", "clip_embeddings", "captions"):
            assert _count(instance, a) == counts[a], a
        assert _count(instance, "training_text") == {"00000": 2, "00001": 2}
        assert _count(instance, "diffusion_samples") == {k: v + 1 for k, v in counts["diffusion_samples"].items()}
        meta = instance.fetch_materializations(dg.AssetKey("diffusion_samples"), limit=1).records[0]
        assert meta.asset_materialization.metadata["latents_reused"].value > 0
        after = {s["__key__"]: s for shard in shards for s in iter_samples(layout.diffusion_tar(shard))}
        assert {k: s[".pth"] for k, s in after.items()} == pth
        from shardprep.training_text import takes_synthetic

        for key, s in after.items():
            want = synthetic_of[key] if takes_synthetic(key, "both") else json.loads(
                next(x for x in iter_samples(layout.tar(key[:5])) if x["__key__"] == key)["json"])["caption"]
            assert json.loads(s[".json"])["caption"] == want
        got = _energon_captions(layout.images_dir)
        assert {k for k in got if got[k] == synthetic_of[k]} and {k for k in got if got[k] != synthetic_of[k]}

        # back to the original captions: the training outputs follow, still without a download
        third = run_pipeline(write_config(config, **{**fields, "train_caption": "original"}), instance=instance,
                             progress=False, in_process=True)
        assert third.ok, third.failed
        assert _count(instance, "image_shards") == counts["image_shards"]
        got = _energon_captions(layout.images_dir)
        originals = {s["__key__"]: s["txt"].decode() for shard in shards for s in iter_samples(layout.tar(shard))}
        assert got and all(got[k] == originals[k] for k in got)
        balanced = {s["__key__"]: s["txt"].decode() for t in sorted(Path(layout.balanced_dir).glob("*.tar"))
                    for s in iter_samples(str(t))}
        assert all(balanced[k] == originals[k] for k in balanced)
        for shard in shards:
            for s in iter_samples(layout.diffusion_tar(shard)):
                assert json.loads(s[".json"])["caption"] == originals[s["__key__"]] and s[".pth"] == pth[s["__key__"]]

        # a takedown takes the sample out of the training text and the prior's text rows too
        from shardprep.takedown.apply import takedown_shard

        gone = sample_keys(layout.tar("00000"))[0]
        rows_before = pq.read_metadata(layout.train_text_metadata("00000")).num_rows
        report = takedown_shard(layout, "00000", "image", [{"key": gone, "url": "", "kind": "key", "value": gone,
                                                            "list": "test", "reason": "test"}])
        assert report.artifacts["training_text"] == 1
        assert gone not in pq.read_table(layout.training_text("00000")).column("key").to_pylist()
        meta = pq.read_table(layout.train_text_metadata("00000"))
        assert meta.num_rows == rows_before - 1 and gone not in meta.column("image_path").to_pylist()
        assert np.load(layout.train_text_emb("00000")).shape[0] == meta.num_rows
