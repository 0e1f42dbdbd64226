"""Synthetic captions (``captions``): a VLM loaded through transformers' auto classes captions exactly as
transformers itself does (a tiny random-weight BLIP here), a prompt BLIP echoes is stripped, a bad image
is a recorded skip; through Dagster, ``captioner`` puts the asset in the graph, every image shard gets a
row per tar sample, new shards alone are captioned on the next run, and a caption setting redoes the
captions and nothing upstream."""

import io
import os
import warnings
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from shardprep.models.captioner import CaptionerError, load_captioner, normalise
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config
from tests.fixtures.tiny_blip import build_tiny_blip


@pytest.fixture(scope="module")
def blip_dir(tmp_path_factory) -> str:
    return build_tiny_blip(str(tmp_path_factory.mktemp("tiny_blip")))


def _images(n: int):
    return [synthetic.render_image(i, 40 + 7 * i, 56 - 3 * i) for i in range(n)]


def _reference(model_dir: str, images, prompt: str | None, max_new_tokens: int) -> list[str]:
    """transformers' own BLIP captioning, called directly (not through our loader)."""
    import torch
    from transformers import BlipForConditionalGeneration, BlipProcessor

    processor = BlipProcessor.from_pretrained(model_dir)
    model = BlipForConditionalGeneration.from_pretrained(model_dir).eval()
    kwargs = {} if prompt is None else {"text": [prompt] * len(images)}
    with torch.no_grad():
        out = model.generate(**processor(images=images, return_tensors="pt", **kwargs), do_sample=False,
                             max_new_tokens=max_new_tokens)
    return processor.batch_decode(out, skip_special_tokens=True)


def test_captions_are_transformers_own_and_a_prompt_is_stripped(blip_dir):
    images = _images(6)
    captioner = load_captioner(blip_dir, "cpu")
    assert captioner is load_captioner(blip_dir, "cpu")  # once per process per (spec, device)
    assert not captioner.model.training and not captioner.chat
    want = [normalise(t) for t in _reference(blip_dir, images, None, 12)]
    assert captioner.generate(images, None, 12) == want
    assert len(set(want)) > 1 and all(want)  # the images differ, so do their captions
    # with a prompt, BLIP writes the prompt back (lowercased by its tokenizer) first: stripped
    echoed = _reference(blip_dir, images, "A photograph of", 12)
    assert all(t.startswith("a photograph of") for t in echoed)
    got = captioner.generate(images, "A photograph of", 12)
    assert got == [normalise(t[len("a photograph of"):]) for t in echoed]
    # batched as the pipeline batches: the same captions (greedy, per image)
    assert captioner.generate(images[:2], None, 12) + captioner.generate(images[2:], None, 12) == want


def test_a_model_that_cannot_be_loaded_is_named(tmp_path, blip_dir):
    from transformers import BertConfig

    with pytest.raises(CaptionerError, match=r"captioner '.*missing'.*cannot be loaded"):
        load_captioner(str(tmp_path / "missing"), "cpu")
    BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(
        tmp_path / "bert")
    with pytest.raises(CaptionerError, match=r"captioner '.*bert': a 'bert' model is not an image-to-text model"):
        load_captioner(str(tmp_path / "bert"), "cpu")


def test_a_tar_with_bad_images_keeps_a_row_per_sample(tmp_path, blip_dir):
    import webdataset as wds

    from shardprep.curation.captions import COLUMNS, write_captions
    from shardprep.layout import Layout

    layout = Layout(str(tmp_path / "out"))
    os.makedirs(os.path.dirname(layout.tar("00000")))
    images = _images(4)
    encoded = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        encoded.append(buf.getvalue())
    with wds.TarWriter(layout.tar("00000")) as sink:
        sink.write({"__key__": "000000000", "png": encoded[0], "txt": "first"})
        sink.write({"__key__": "000000001", "jpg": b"not an image", "txt": "broken"})
        sink.write({"__key__": "000000002", "txt": "no image"})
        sink.write({"__key__": "000000003", "png": encoded[1]})
        sink.write({"__key__": "000000004", "png": encoded[2], "txt": "fifth"})
    captioner = load_captioner(blip_dir, "cpu")
    report = write_captions("00000", layout, captioner, batch_size=2, prompt=None, max_new_tokens=8, threads=2)
    assert (report.samples, report.captioned, len(report.skipped)) == (5, 3, 2)
    t = pq.read_table(layout.captions("00000"))
    assert t.column_names == list(COLUMNS)
    rows = t.to_pylist()
    assert [r["key"] for r in rows] == [f"00000000{i}" for i in range(5)]  # tar order
    assert [r["original_caption"] for r in rows] == ["first", "broken", "no image", None, "fifth"]
    assert [r["caption"] for r in rows] == [rows[0]["caption"], None, None, *captioner.generate(images[1:3], None, 8)]
    assert rows[0]["caption"] == captioner.generate(images[:1], None, 8)[0]
    assert "image decode failed: UnidentifiedImageError" in rows[1]["skip_reason"]
    assert "no image member" in rows[2]["skip_reason"]
    assert {r["model"] for r in rows} == {blip_dir} and {r["prompt"] for r in rows} == {None}
    # the asset's contact sheet: both captions under each thumbnail, two lines each
    from PIL import Image

    from shardprep.report.contact_sheet import grid_size, render_sheet
    from shardprep_dagster.assets.captions import length_histograms

    sheet = render_sheet([(r["key"], encoded[0], (f"VLM: {r['caption']}", f"src: {r['original_caption']}"))
                          for r in rows[:3]], thumb=64, lines=4)
    assert Image.open(io.BytesIO(sheet)).size == grid_size(3, 64, 4)
    hist = length_histograms(rows)
    assert set(hist) == {"original_caption_length_histogram", "synthetic_caption_length_histogram"}
    assert hist["original_caption_length_histogram"].startswith("| characters | samples |")
    # no tar (nothing downloaded): no file, a stale one removed
    Path(layout.tar("00000")).unlink()
    assert write_captions("00000", layout, None).samples == 0
    assert not Path(layout.captions("00000")).exists()


def _count(instance, asset: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records:
        out[r.partition_key] = out.get(r.partition_key, 0) + 1
    return out


def test_pipeline_captions_new_shards_only_and_redoes_them_on_a_caption_setting(tmp_path, image_site, tiny_clip_dir,
                                                                                blip_dir):
    from shardprep.config import config_from_dict
    from shardprep.layout import Layout
    from shardprep.tars import iter_samples, sample_keys
    from shardprep.verify import verify_shard
    from shardprep_dagster.definitions import build_defs
    from shardprep_dagster.orchestration.runner import run_pipeline

    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=16, n_images=120, seed=3)
    fields = dict(source=f"{src}/*.parquet", output_root=str(tmp_path / "out"), samples_per_shard=8, image_size=32,
                  allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", enable_nemo_text2img=False,
                  enable_nemo_diffusion=False, batch_size=8, captioner=blip_dir, caption_prompt="a photograph of",
                  caption_max_new_tokens=6, caption_batch_size=4)
    layout = Layout(fields["output_root"])
    config = tmp_path / "c.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_defs(write_config(config, **fields)).resolve_asset_graph()
        assert dg.AssetKey("captions") in graph.materializable_asset_keys
        off = build_defs(write_config(tmp_path / "off.yaml", **{**fields, "captioner": None})).resolve_asset_graph()
        assert dg.AssetKey("captions") not in off.materializable_asset_keys
    home = tmp_path / "home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        first = run_pipeline(write_config(config, **fields), instance=instance, progress=False, in_process=True)
        assert first.ok, first.failed
        shards = sorted(p.stem for p in Path(layout.images_dir).glob("*.tar"))
        assert shards == ["00000", "00001"]
        cfg = config_from_dict(dict(fields))
        for shard in shards:
            rows = pq.read_table(layout.captions(shard)).to_pylist()
            assert [r["key"] for r in rows] == sample_keys(layout.tar(shard))  # one row per sample, tar order
            assert all(r["caption"] and r["skip_reason"] is None for r in rows), rows
            txt = {s["__key__"]: s.get("txt", b"").decode() for s in iter_samples(layout.tar(shard))}
            assert [r["original_caption"] or "" for r in rows] == [txt[r["key"]] for r in rows]
            assert any(r["original_caption"] for r in rows)
            assert {r["prompt"] for r in rows} == {"a photograph of"} and {r["model"] for r in rows} == {blip_dir}
            assert verify_shard(layout, cfg, "captions", shard).ok
        assert _count(instance, "captions") == {"00000": 1, "00001": 1}
        meta = instance.fetch_materializations(dg.AssetKey("captions"), limit=10).records[0].asset_materialization.metadata
        assert meta["samples"].value > 0 and "synthetic_caption_length_histogram" in meta
        assert "original_caption_length_histogram" in meta
        assert meta["captions_sheet"].value.startswith("![captions of shard")
        mtimes = {s: os.stat(layout.captions(s)).st_mtime_ns for s in shards}

        # a new source file: its shards, and only they, are captioned
        synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=8, n_images=120, seed=9,
                                       prefix="more")
        second = run_pipeline(str(config), instance=instance, progress=False, in_process=True)
        assert second.ok, second.failed
        assert _count(instance, "captions") == {"00000": 1, "00001": 1, "00002": 1}
        assert {s: os.stat(layout.captions(s)).st_mtime_ns for s in shards} == mtimes
        assert len(pq.read_table(layout.captions("00002"))) == len(sample_keys(layout.tar("00002")))

        # a caption setting: every shard captioned again, nothing downloaded or embedded again
        downloads, embeds = _count(instance, "image_shards"), _count(instance, "clip_embeddings")
        third = run_pipeline(write_config(config, **{**fields, "caption_max_new_tokens": 3}), instance=instance,
                             progress=False, in_process=True)
        assert third.ok, third.failed
        assert _count(instance, "captions") == {"00000": 2, "00001": 2, "00002": 2}
        assert _count(instance, "image_shards") == downloads and _count(instance, "clip_embeddings") == embeds
        # a speed-only setting: nothing
        fourth = run_pipeline(write_config(config, **{**fields, "caption_max_new_tokens": 3, "caption_batch_size": 2}),
                              instance=instance, progress=False, in_process=True)
        assert fourth.ok and fourth.runs == 0

        # a takedown takes the sample's caption row out too (the file restamped: verify still passes)
        from shardprep.takedown.apply import takedown_shard

        gone = sample_keys(layout.tar("00002"))[0]
        report = takedown_shard(layout, "00002", "image", [{"key": gone, "url": "", "kind": "key", "value": gone,
                                                            "list": "test", "reason": "test"}])
        assert report.artifacts["captions"] == 1
        rows = pq.read_table(layout.captions("00002")).to_pylist()
        assert gone not in {r["key"] for r in rows} and len(rows) == len(sample_keys(layout.tar("00002")))
        assert verify_shard(layout, cfg, "captions", "00002").ok
