"""Synthetic captions (``captions``): a VLM loaded through transformers' auto classes captions exactly as
transformers itself does (tiny random-weight BLIP and Qwen2-VL here: batches of a chat VLM left-padded),
a prompt BLIP echoes is stripped, a bad image is a recorded skip; through Dagster, ``captioner`` puts the
asset in the graph, every image shard gets a row per tar sample, new shards alone are captioned on the
next run, and a caption setting redoes the captions and nothing upstream. Video shards: a clip is
captioned from a strip of evenly spaced frames in one user turn (a one-image model records why not)."""

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
    # BLIP's processor per image in the decode threads (``prepare``): the batch call's pixels, the same captions
    assert captioner.per_image
    prepared = [captioner.prepare(im) for im in images]
    batch = captioner.processor(images=images, return_tensors="np")["pixel_values"]
    assert all((p == row).all() for p, row in zip(prepared, batch, strict=True))
    assert captioner.generate(prepared, None, 12) == want
    assert captioner.generate(prepared, "A photograph of", 12) == got


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


# -- chat VLMs (a tiny random-weight Qwen2-VL), and video clips from a frame strip -----------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from tests.fixtures.tiny_qwen2vl import build_tiny_qwen2vl

    return build_tiny_qwen2vl(str(tmp_path_factory.mktemp("tiny_qwen2vl")))


def _chat_reference(model_dir: str, conversations: list[list], prompt: str, max_new_tokens: int) -> list[str]:
    """transformers' own chat-VLM captioning, called directly, one conversation at a time: the images of
    each (one, or a clip's frames) then ``prompt`` as the user turn, through the processor's chat
    template; greedy; the input ids cut off the output."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    out = []
    for images in conversations:
        messages = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                                 {"type": "text", "text": prompt}]}]
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        out.extend(processor.batch_decode(ids[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return [normalise(t) for t in out]


def _shaped_images(n: int):
    # different shapes: 1 to 4 image tokens each in the tiny Qwen2-VL, so a batch is padded
    return [synthetic.render_image(i, 30 + 12 * (i % 4), 70 - 12 * (i % 4)) for i in range(n)]


def test_a_chat_vlm_captions_as_transformers_does_batched_left_padded(qwen_dir):
    captioner = load_captioner(qwen_dir, "cpu")
    assert captioner.chat and captioner.multi_image
    assert type(captioner.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert captioner.processor.tokenizer.padding_side == "left"
    images = _shaped_images(5)
    # its processor sees the whole batch (patch grids of several sizes): prepare leaves the image as it is
    assert not captioner.per_image and captioner.prepare(images[0]) is images[0]
    want = _chat_reference(qwen_dir, [[im] for im in images], "Describe this image.", 10)
    assert len(set(want)) > 1 and all(want)
    # the default prompt is "Describe this image."; one batch of different lengths, padded on the left
    mask = captioner._inputs(images, None)["attention_mask"]
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 1).all()
    assert captioner.generate(images, None, 10) == want
    assert captioner.generate(images, "Describe this image.", 10) == want
    assert [captioner.generate([im], None, 10)[0] for im in images] == want
    # another prompt goes through the template as the user's text
    asked = _chat_reference(qwen_dir, [[im] for im in images[:2]], "What is this?", 10)
    assert captioner.generate(images[:2], "What is this?", 10) == asked


def _clip(n_frames: int, width: int = 64, height: int = 48, fmt: str = "mp4") -> bytes:
    from tests.fixtures import videos

    codec = "libx264" if fmt == "mp4" else "libvpx-vp9"
    return videos.encode(fmt, codec, width=width, height=height, rate=12, n_frames=n_frames,
                         options={"preset": "ultrafast", "g": "12"} if fmt == "mp4" else {"deadline": "realtime"})


def _all_frames(data: bytes) -> list:
    import av

    with av.open(io.BytesIO(data)) as container:
        return [f.to_image() for f in container.decode(video=0)]


def test_a_frame_strip_is_evenly_spaced_frames(tmp_path):
    import numpy as np

    from shardprep.video.strips import frame_strip, strip_indices
    from tests.fixtures.videos import frame_index

    assert strip_indices(12, 4) == [1, 4, 7, 10] and strip_indices(48, 4) == [6, 18, 30, 42]
    assert strip_indices(3, 4) == [0, 1, 2] and strip_indices(1, 4) == [0] and strip_indices(0, 4) == []
    for fmt in ("mp4", "webm"):  # webm: no frame count in its index, counted from the packets
        strip = frame_strip(_clip(12, fmt=fmt), 4)
        assert [frame_index(np.asarray(im)[16:, 16:]) for im in strip] == [1, 4, 7, 10], fmt
        assert all(im.mode == "RGB" and im.size == (64, 48) for im in strip)
    assert len(frame_strip(_clip(2), 4)) == 2  # fewer frames than asked: all of them
    with pytest.raises(Exception, match="not a video file"):
        frame_strip(bytes(range(256)) * 4, 4)


def _video_shard(layout, shard: str, clips: dict) -> None:
    from shardprep.tars import TarWriter

    os.makedirs(os.path.dirname(layout.video_tar(shard)), exist_ok=True)
    with TarWriter(layout.video_tar(shard)) as tar:
        for key, members in clips.items():
            tar.add(key, members)


def test_video_clips_are_captioned_from_a_frame_strip_in_one_user_turn(tmp_path, qwen_dir):
    from shardprep.curation.captions import COLUMNS, write_captions
    from shardprep.layout import Layout
    from shardprep.verify import verify_captions

    layout = Layout(str(tmp_path / "out"))
    # the first two clips, captioned in one call, have frames of 4 and 2 image tokens: padded on the left
    good = {"000020000_00": _clip(12), "000020000_01": _clip(24, 80, 48), "000020001_00": _clip(16, 48, 64)}
    _video_shard(layout, "00002", {
        "000020000_00": {"mp4": good["000020000_00"], "txt": "first clip", "json": "{}"},
        "000020000_01": {"mp4": good["000020000_01"], "txt": "second clip", "json": "{}"},
        "000020000_02": {"mp4": bytes(range(256)) * 4, "txt": "broken", "json": "{}"},
        "000020000_03": {"txt": "no video", "json": "{}"},
        "000020001_00": {"mp4": good["000020001_00"], "json": "{}"},
    })
    captioner = load_captioner(qwen_dir, "cpu")
    # 8 images per call at 4 frames: 2 clips per call
    report = write_captions("00002", layout, captioner, batch_size=8, max_new_tokens=8, threads=2, media="video",
                            video_frames=4)
    assert (report.samples, report.captioned, len(report.skipped)) == (5, 3, 2)
    rows = pq.read_table(layout.captions("00002")).to_pylist()
    assert list(rows[0]) == list(COLUMNS)
    assert [r["key"] for r in rows] == ["000020000_00", "000020000_01", "000020000_02", "000020000_03",
                                        "000020001_00"]  # tar order
    assert [r["original_caption"] for r in rows] == ["first clip", "second clip", "broken", "no video", None]
    # transformers' own call with the clip's frames (the middles of 4 equal parts) as the images of one turn
    strips = [[frames[i] for i in (1, 4, 7, 10)] for frames in [_all_frames(good["000020000_00"])]]
    strips += [[_all_frames(good["000020000_01"])[i] for i in (3, 9, 15, 21)],
               [_all_frames(good["000020001_00"])[i] for i in (2, 6, 10, 14)]]
    grids = captioner.processor.image_processor(images=[strips[0][0], strips[1][0]])["image_grid_thw"]
    assert grids[0].prod() != grids[1].prod()
    want = _chat_reference(qwen_dir, strips, "Describe this video.", 8)
    assert [rows[i]["caption"] for i in (0, 1, 4)] == want and len(set(want)) > 1
    assert [r["caption"] for r in rows[2:4]] == [None, None]
    assert "video decode failed: VideoError: not a video file" in rows[2]["skip_reason"]
    assert "no video member" in rows[3]["skip_reason"]
    assert {r["model"] for r in rows} == {qwen_dir} and {r["prompt"] for r in rows} == {None}
    assert verify_captions(layout, "00002").ok
    # a prompt given is the video's question too; fewer frames: a shorter strip
    write_captions("00002", layout, captioner, batch_size=8, prompt="What is this?", max_new_tokens=8, threads=2,
                   media="video", video_frames=2)
    rows = pq.read_table(layout.captions("00002")).to_pylist()
    frames = _all_frames(good["000020000_00"])
    assert rows[0]["caption"] == _chat_reference(qwen_dir, [[frames[3], frames[9]]], "What is this?", 8)[0]
    assert rows[0]["prompt"] == "What is this?"
    # no video tar: no file, a stale one removed
    Path(layout.video_tar("00002")).unlink()
    assert write_captions("00002", layout, None, media="video").samples == 0
    assert not Path(layout.captions("00002")).exists() and verify_captions(layout, "00002").ok


def test_a_one_image_captioner_leaves_video_clips_uncaptioned_with_a_reason(tmp_path, blip_dir):
    from shardprep.curation.captions import write_captions
    from shardprep.layout import Layout
    from shardprep.models.captioner import CaptionerError

    layout = Layout(str(tmp_path / "out"))
    _video_shard(layout, "00001", {"000010000_00": {"mp4": _clip(6), "txt": "a clip"},
                                   "000010001_00": {"mp4": b"broken", "txt": "broken"}})
    captioner = load_captioner(blip_dir, "cpu")
    assert not captioner.multi_image
    with pytest.raises(CaptionerError, match="one image per caption"):
        captioner.generate_strips([_shaped_images(2)])
    report = write_captions("00001", layout, captioner, media="video", threads=1)
    assert (report.samples, report.captioned) == (2, 0)
    rows = pq.read_table(layout.captions("00001")).to_pylist()
    assert [r["original_caption"] for r in rows] == ["a clip", "broken"] and {r["caption"] for r in rows} == {None}
    assert {r["skip_reason"] for r in rows} == {
        f"captioner {blip_dir} takes one image per caption: video clips are not captioned"}


def test_pipeline_captions_a_video_shard_through_dagster(tmp_path, tiny_clip_dir, qwen_dir, blip_dir):
    """A video-only dataset: the captions asset captions every clip of its video shard from frame strips
    and verify passes; with a one-image captioner, its status says video captions are unsupported."""
    import pyarrow as pa

    from shardprep.config import config_from_dict
    from shardprep.layout import Layout
    from shardprep.tars import sample_keys
    from shardprep.verify import verify_shard
    from shardprep_dagster.orchestration.runner import run_pipeline
    from tests.fixtures.http_server import serve_directory

    site = tmp_path / "site"
    site.mkdir()
    (site / "a.mp4").write_bytes(_clip(24))
    (site / "b.mp4").write_bytes(_clip(12, 48, 64))
    base_url, stop = serve_directory(str(site))
    try:
        (tmp_path / "videos").mkdir()
        pq.write_table(pa.table({"contentUrl": [f"{base_url}/a.mp4", f"{base_url}/b.mp4", f"{base_url}/none.mp4"],
                                 "name": ["video a", "video b", "missing"]}), tmp_path / "videos" / "v.parquet")
        fields = dict(source=None, video_source=f"{tmp_path}/videos/*.parquet", output_root=str(tmp_path / "out"),
                      allow_private_addresses=True, timeout=5, video_url_col="contentUrl", video_caption_col="name",
                      video_size=32, video_frame_rate=12, clip_model=f"hf_clip:{tiny_clip_dir}",
                      enable_nemo_text2img=False, enable_nemo_diffusion=False, captioner=qwen_dir,
                      caption_max_new_tokens=4, caption_video_frames=3)
        layout = Layout(fields["output_root"])
        home = tmp_path / "home"
        home.mkdir()
        with dg.instance_for_test(temp_dir=str(home)) as instance:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                summary = run_pipeline(write_config(tmp_path / "c.yaml", **fields), instance=instance, progress=False,
                                       in_process=True)
            assert summary.ok, summary.failed
            (shard,) = summary.shards
            rows = pq.read_table(layout.captions(shard)).to_pylist()
            assert [r["key"] for r in rows] == sample_keys(layout.video_tar(shard)) and len(rows) == 2
            assert all(r["caption"] and r["skip_reason"] is None for r in rows), rows
            assert sorted(r["original_caption"] for r in rows) == ["video a", "video b"]
            assert verify_shard(layout, config_from_dict(dict(fields)), "captions", shard, media="video").ok
            meta = instance.fetch_materializations(dg.AssetKey("captions"), limit=1).records[0]
            meta = meta.asset_materialization.metadata
            assert meta["status"].value == "written" and meta["media"].value == "video"
            assert meta["captioned"].value == 2 and meta["captions_sheet"].value.startswith("![captions of shard")
            # a one-image captioner: the clips are captioned again (a caption setting), each row with the reason
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                again = run_pipeline(write_config(tmp_path / "c.yaml", **{**fields, "captioner": blip_dir}),
                                     instance=instance, progress=False, in_process=True)
            assert again.ok, again.failed
            rows = pq.read_table(layout.captions(shard)).to_pylist()
            assert len(rows) == 2 and {r["caption"] for r in rows} == {None}
            assert {r["skip_reason"] for r in rows} == {f"captioner {blip_dir} takes one image per caption: video "
                                                        "clips are not captioned"}
            meta = instance.fetch_materializations(dg.AssetKey("captions"), limit=1).records[0]
            assert "video captions unsupported" in meta.asset_materialization.metadata["status"].value
            # a takedown takes the clip's caption row out too (restamped: verify still passes)
            from shardprep.takedown.apply import takedown_shard

            gone = rows[0]["key"]
            report = takedown_shard(layout, shard, "video", [{"key": gone, "url": "", "kind": "key", "value": gone,
                                                              "list": "test", "reason": "test"}])
            assert report.artifacts["captions"] == 1
            rows = pq.read_table(layout.captions(shard)).to_pylist()
            assert [r["key"] for r in rows] == sample_keys(layout.video_tar(shard)) and gone not in {r["key"] for r in rows}
            assert verify_shard(layout, config_from_dict(dict(fields)), "captions", shard, media="video").ok
    finally:
        stop()
