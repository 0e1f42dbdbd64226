"""One decode per image for every pixel model of a run (``shardprep.pixels``, ``assets.pixels``): CLIP, LAION's
watermark detector and the captioner fed from one decode give what their own paths give (captions the same,
embeddings and pwatermark within their fast paths' tolerance, equal where the decode is the one their own
path makes), a bad image is still a recorded skip for each; through Dagster, with all three configured,
each image is decoded once per run and every shard gets all three assets."""

import io
import os
import re
import warnings
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from shardprep import pixels
from shardprep.curation.captions import caption_tar
from shardprep.embeddings import write_clip_embeddings
from shardprep.layout import Layout
from shardprep.models.captioner import load_captioner
from shardprep.models.clip import ImageSpec, load_clip_encoder
from shardprep.models.watermark import load_watermark_model, score_watermarks
from shardprep.storage import read_npy
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config
from tests.fixtures.tiny_blip import build_tiny_blip
from tests.test_watermark import detector_files  # noqa: F401 - the calibrated random-weight detector fixture

PROMPT, TOKENS = "a photograph of", 6


@pytest.fixture(scope="module")
def blip_dir(tmp_path_factory) -> str:
    return build_tiny_blip(str(tmp_path_factory.mktemp("tiny_blip")))


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _same_reasons(records: list[dict], field: str) -> list[dict]:
    """``records`` with the object addresses PIL names in its messages left out (two decodes, two objects)."""
    return [{**r, field: r[field] and re.sub(r" at 0x[0-9a-f]+", "", r[field])} for r in records]


SMALL = [0, 1, 2, 6]  # rows whose images no model DCT-reduces: the same pixels whichever path decodes them


def _write_tar(layout: Layout, shard: str) -> list[dict]:
    """A shard tar of small and big images, PNG, JPEG and grey, one that is not an image, a truncated one, a
    sample without an image and one without a caption."""
    import webdataset as wds

    big = _encoded(synthetic.render_image(7, 1600, 1200), "JPEG")
    samples = [
        {"png": _encoded(synthetic.render_image(1, 60, 48), "PNG"), "txt": "a small png"},
        {"jpg": _encoded(synthetic.render_image(2, 100, 90), "JPEG"), "txt": "a small jpeg"},
        {"jpg": _encoded(synthetic.render_image(3, 120, 100).convert("L"), "JPEG"), "txt": "grey"},
        {"jpg": big, "txt": "a big photo"},
        {"jpg": b"not an image", "txt": "broken"},
        {"jpg": big[: len(big) // 3], "txt": "truncated"},
        {"png": _encoded(synthetic.render_image(4, 70, 50).convert("RGBA"), "PNG"), "txt": "alpha"},
        {"txt": "no image"},
        {"jpg": _encoded(synthetic.render_image(5, 900, 700), "JPEG"), "txt": "a mid photo"},
        {"jpg": _encoded(synthetic.render_image(6, 640, 480), "JPEG")},  # no caption: CLIP skips it, not the others
    ]
    os.makedirs(os.path.dirname(layout.tar(shard)), exist_ok=True)
    with wds.TarWriter(layout.tar(shard)) as sink:
        for i, s in enumerate(samples):
            sink.write({"__key__": f"{shard}{i:04d}", **s, "json": {"i": i}})
    return samples


def test_one_pass_gives_what_the_three_paths_give(tmp_path, tiny_clip_dir, detector_files, blip_dir):  # noqa: F811
    _, pt, _ = detector_files
    encoder = load_clip_encoder(f"hf_clip:{tiny_clip_dir}", "cpu")
    detector = load_watermark_model(pt, "cpu")
    captioner = load_captioner(blip_dir, "cpu")
    alone, shared = Layout(str(tmp_path / "alone")), Layout(str(tmp_path / "shared"))
    samples = _write_tar(alone, "00000")
    _write_tar(shared, "00000")
    tar = alone.tar("00000")
    with_image = sum(any(e in s for e in ("jpg", "png")) for s in samples)

    # today's three paths, each decoding every image
    clip_report = write_clip_embeddings("00000", alone, encoder, batch_size=4)
    watermark = score_watermarks(tar, detector, batch_size=3, threads=2)
    rows = caption_tar(tar, captioner, batch_size=2, prompt=PROMPT, max_new_tokens=TOKENS, threads=2)

    before = pixels.DECODES
    one = pixels.PixelPass(detector=detector, watermark_batch=3, captioner=captioner, caption_batch=2, prompt=PROMPT,
                           max_new_tokens=TOKENS)
    report = write_clip_embeddings("00000", shared, encoder, batch_size=4, pixels=one)
    assert pixels.DECODES - before == with_image  # one decode per image, for the three models

    # captions: the same rows (the captioner gets the full image, as its own path gives it)
    assert _same_reasons(one.caption_rows, "skip_reason") == _same_reasons(rows, "skip_reason")
    assert [r["caption"] is None for r in rows] == [False, False, False, False, True, True, False, True, False, False]
    # pwatermark: the same keys, skips and NaNs; equal where the decode is the detector's own (to float
    # rounding: in the pass the detector runs with CLIP's torch threads, another conv blocking), within the
    # detector's DCT-scaling tolerance where more pixels were kept for the captioner
    got = one.watermark_scores()
    assert got.keys == watermark.keys and got.model == pt
    assert _same_reasons(got.skipped, "reason") == _same_reasons(watermark.skipped, "reason")
    assert [s["key"][-1] for s in got.skipped] == ["4", "5", "7"]
    np.testing.assert_array_equal(np.isnan(got.pwatermark), np.isnan(watermark.pwatermark))
    np.testing.assert_allclose(got.pwatermark[SMALL], watermark.pwatermark[SMALL], atol=5e-5)
    np.testing.assert_allclose(got.pwatermark, watermark.pwatermark, atol=0.02)
    # CLIP: the same rows, skips and metadata; equal embeddings for the small images, the big ones within
    # the fast preprocess's tolerance
    assert _same_reasons(report.skipped, "reason") == _same_reasons(clip_report.skipped, "reason")
    assert report.samples == clip_report.samples == 6
    assert pq.read_table(shared.emb_metadata("00000")).equals(pq.read_table(alone.emb_metadata("00000")))
    a, b = (read_npy(lay.img_emb("00000")).astype(np.float32) for lay in (alone, shared))
    np.testing.assert_array_equal(read_npy(shared.text_emb("00000")), read_npy(alone.text_emb("00000")))
    kept = [0, 1, 2, 3, 6, 8]  # the rows CLIP embeds (8: the mid photo)
    small_rows = [kept.index(i) for i in SMALL if i in kept]
    np.testing.assert_allclose(b[small_rows], a[small_rows], atol=1e-3)  # float16 storage
    assert (np.sum(a * b, axis=1) > 0.995).all()


def test_the_decode_keeps_what_every_model_needs():
    """The DCT reduction is the least of the consumers' (PIL keeps both sides >= the largest request), none
    with a consumer that takes the full image; a non-JPEG is never reduced."""
    spec = ImageSpec(224, (224, 224), (0.5,) * 3, (0.5,) * 3, round_offsets=True)  # ViT-B/32's
    big = _encoded(synthetic.render_image(9, 1600, 1200), "JPEG")
    clip_only = pixels.Consumers(clip=spec)
    both = pixels.Consumers(clip=spec, watermark=True)
    wm_only = pixels.Consumers(watermark=True)
    assert pixels.draft_request(clip_only, "JPEG", 1600, 1200) == (596, 448)
    assert pixels.draft_request(both, "JPEG", 1600, 1200) == (596, 448)  # CLIP needs more than 256
    assert pixels.draft_request(wm_only, "JPEG", 1600, 1200) == (256, 256)
    assert pixels.draft_request(pixels.Consumers(clip=spec, watermark=True, full=True), "JPEG", 1600, 1200) is None
    assert pixels.draft_request(both, "PNG", 1600, 1200) is None
    assert pixels.draft_request(both, "JPEG", 800, 600) is None  # CLIP decodes it whole: so does everyone
    assert pixels.decode(big, both).rgb.size == (800, 600)  # CLIP's own 1/2 (models.clip._decode_crop)
    assert pixels.decode(big, wm_only).rgb.size == (400, 300)  # the detector's own 1/4
    # with CLIP's own scale the crop is CLIP's own, bit for bit
    from shardprep.models.clip import decode_for_clip

    np.testing.assert_array_equal(pixels.clip_crop(pixels.decode(big, both), spec), decode_for_clip(big, spec))
    # decoded whole for the captioner: CLIP and the detector resize from box reductions to their own scales
    whole = pixels.decode(big, pixels.Consumers(clip=spec, watermark=True, full=True))
    assert whole.rgb.size == (1600, 1200)
    reduced: dict = {}
    assert pixels.source_for(whole, (256, 256), reduced).size == (400, 300)
    assert pixels.source_for(whole, (596, 448), reduced).size == (800, 600)
    assert set(reduced) == {2, 4} and pixels.source_for(whole, (256, 256), reduced) is reduced[4]
    assert pixels.clip_crop(whole, spec, reduced).shape == (224, 224, 3)
    with pytest.raises(Exception, match="cannot identify image file"):
        pixels.decode(b"not an image", both)


def _count(instance, asset: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records:
        out[r.partition_key] = out.get(r.partition_key, 0) + 1
    return out


def _separate_decodes(monkeypatch) -> dict[str, int]:
    """Counts of the images each model's own path decodes (its decode function wrapped)."""
    from shardprep.curation import captions
    from shardprep.models import clip, watermark

    counts = {"clip": 0, "watermark": 0, "captions": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(clip, "_decode_crop", counted("clip", clip._decode_crop))
    monkeypatch.setattr(watermark, "decode_for_watermark", counted("watermark", watermark.decode_for_watermark))
    monkeypatch.setattr(captions, "_decode", counted("captions", captions._decode))
    return counts


@pytest.mark.parametrize("following", [True, False], ids=["follower", "clip_step"])
def test_pipeline_decodes_each_image_once_for_clip_watermark_and_captions(tmp_path, image_site, tiny_clip_dir,
                                                                         detector_files, blip_dir,  # noqa: F811
                                                                         monkeypatch, following):
    """With the download's follower embedding the shards (``assets.follow``), or without it (the device busy:
    the clip step embeds them), the one pass makes the three assets' outputs."""
    from shardprep.config import config_from_dict
    from shardprep.tars import iter_samples
    from shardprep.verify import verify_shard
    from shardprep_dagster.orchestration.runner import run_pipeline

    monkeypatch.setenv("SHARDPREP_DEVICE_LOCK_DIR", str(tmp_path / "device-locks"))  # the CPU "device" our own
    if not following:
        from shardprep_dagster.assets import follow

        monkeypatch.setattr(follow, "_follows", lambda context: False)
    _, pt, _ = detector_files
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=16, n_images=120, seed=4)
    fields = dict(source=f"{src}/*.parquet", output_root=str(tmp_path / "out"), samples_per_shard=8, image_size=32,
                  allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", enable_nemo_text2img=False,
                  enable_nemo_diffusion=False, batch_size=8, watermark_model=pt, captioner=blip_dir,
                  caption_prompt=PROMPT, caption_max_new_tokens=TOKENS, caption_batch_size=4)
    layout = Layout(fields["output_root"])
    config = tmp_path / "c.yaml"
    separate = _separate_decodes(monkeypatch)
    home = tmp_path / "home"
    home.mkdir()
    with warnings.catch_warnings(), dg.instance_for_test(temp_dir=str(home)) as instance:
        warnings.simplefilter("ignore")
        before = pixels.DECODES
        first = run_pipeline(write_config(config, **fields), instance=instance, progress=False, in_process=True)
        assert first.ok, first.failed
        shards = sorted(p.stem for p in Path(layout.images_dir).glob("*.tar"))
        assert shards == ["00000", "00001"]
        images = sum(1 for s in shards for _ in iter_samples(layout.tar(s)))
        # one decode per image in the run, for the three models together
        assert pixels.DECODES - before == images and separate == {"clip": 0, "watermark": 0, "captions": 0}
        cfg = config_from_dict(dict(fields))
        for asset in ("clip_embeddings", "image_scores", "captions"):
            assert _count(instance, asset) == {"00000": 1, "00001": 1}, asset
            for shard in shards:
                assert verify_shard(layout, cfg, asset, shard).ok, (asset, shard)
        for asset in ("image_scores", "captions"):  # its own step reports the figures of the shared pass
            meta = instance.fetch_materializations(dg.AssetKey(asset), limit=1).records[0].asset_materialization.metadata
            assert meta["decoded"].value == "once, with clip_embeddings" and meta["samples"].value > 0, asset
        for record in instance.fetch_materializations(dg.AssetKey("clip_embeddings"), limit=10).records:
            meta = record.asset_materialization.metadata
            assert meta["decode_shared_with"].value == "image_scores, captions"
            assert ("embedded" in meta) == following  # the follower's figures, or the clip step's own
        meta = instance.fetch_materializations(dg.AssetKey("image_scores"), limit=1).records[0].asset_materialization.metadata
        assert "pwatermark_histogram" in meta and meta["watermark_skipped"].value == 0
        for shard in shards:
            scores = pq.read_table(layout.scores(shard)).to_pandas()
            assert scores["pwatermark"].notna().all() and len(scores) > 0
            rows = pq.read_table(layout.captions(shard)).to_pylist()
            assert all(r["caption"] and r["prompt"] == PROMPT for r in rows)

        # a caption setting alone: captions again by their own step (one decode each), nothing else decoded
        before = pixels.DECODES
        second = run_pipeline(write_config(config, **{**fields, "caption_max_new_tokens": 3}), instance=instance,
                              progress=False, in_process=True)
        assert second.ok, second.failed
        assert _count(instance, "captions") == {"00000": 2, "00001": 2}
        assert _count(instance, "clip_embeddings") == _count(instance, "image_scores") == {"00000": 1, "00001": 1}
        assert pixels.DECODES == before and separate == {"clip": 0, "watermark": 0, "captions": images}
