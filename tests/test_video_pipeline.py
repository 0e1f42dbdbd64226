"""Images and videos in one dataset, end to end through Dagster: image rows (``source``) and WebVid-style
video rows (``video_source``) become shards of one partition set; video shards go through video_shards
(video2dataset layout) and video_diffusion_samples (causal video latents) into the same energon dataset
as the image diffusion samples, read back by the real megatron-energon with a NeMo-style cooker."""

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds

from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep_dagster.orchestration.runner import run_pipeline
from shardprep_dagster.orchestration.verify import verify_dataset
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config
from tests.fixtures.energon_read import energon_keys
from tests.fixtures.http_server import serve_directory
from tests.fixtures.live_dagster import prepare_home
from tests.fixtures.tiny_nemo import build_tiny_video_autoencoder
from tests.fixtures.videos import make_video_site

VIDEOS = ["h264.mp4", "h264_aac.mp4", "vp9_opus.webm", "rotated.mp4", "soft404.mp4", "missing.mp4"]
GOOD_VIDEOS = 4
MAX_FRAMES = 9  # frames fed to the video autoencoder at most: 1 + 2 * 4 for its temporal compression of 4
IMAGE_SHARDS = ["00000", "00001"]
VIDEO_SHARD = "00002"  # video files' shards come after the image files'


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    home = prepare_home(tmp_path_factory.mktemp("dagster_home"))
    with dg.DagsterInstance.from_config(str(home)) as inst:
        yield inst


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, image_site, tiny_clip_dir, tiny_nemo_dirs):
    tmp = tmp_path_factory.mktemp("video_pipeline")
    make_video_site(str(tmp / "site"))
    base_url, stop = serve_directory(str(tmp / "site"))
    synthetic.make_source_parquets(str(tmp / "images"), image_site[1], n_files=1, rows_per_file=[30],
                                   n_images=120, seed=5)
    (tmp / "videos").mkdir()
    pq.write_table(pa.table({"contentUrl": [f"{base_url}/{n}" for n in VIDEOS],
                             "name": [f"a test video {n}" for n in VIDEOS],
                             "source_id": list(range(len(VIDEOS)))}), tmp / "videos" / "webvid-0.parquet")
    config = write_config(
        tmp / "shardprep.yaml", source=f"{tmp}/images/*.parquet", video_source=f"{tmp}/videos/*.parquet",
        output_root=str(tmp / "out"), samples_per_shard=20, image_size=32, resize_mode="center_crop",
        allow_private_addresses=True, timeout=5, thread_count=8, save_additional_columns=["source_id"],
        clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, tar_chunk_size=10,
        video_url_col="contentUrl", video_caption_col="name", video_size=32, video_frame_rate=12,
        video_thread_count=4, video_autoencoder=build_tiny_video_autoencoder(str(tmp / "video_vae")),
        video_diffusion_frames=MAX_FRAMES, video_diffusion_resolution=32, **nemo_config(tiny_nemo_dirs))
    yield config, Layout(str(tmp / "out"))
    stop()


def _statuses(instance: dg.DagsterInstance, asset: str) -> dict[str, str]:
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=100).records
    out = {}
    for r in records:
        m = r.asset_materialization
        out.setdefault(m.partition, m.metadata["status"].value if "status" in m.metadata else None)
    return out


def test_images_and_videos_share_one_partition_set_and_one_energon_dataset(dataset, instance):
    from megatron.energon import Cooker, DefaultTaskEncoder, basic_sample_keys, stateless

    config, layout = dataset
    summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert summary.ok, summary.failed
    assert summary.shards == [*IMAGE_SHARDS, VIDEO_SHARD]
    ledger = load_ledger(layout)
    assert [ledger.media(k) for k in summary.shards] == ["image", "image", "video"]

    # each asset did its own kind of shard and materialized the other kind as not applicable
    assert _statuses(instance, "image_shards")[VIDEO_SHARD] == "not applicable (video shard)"
    assert _statuses(instance, "video_shards")["00000"] == "not applicable (image shard)"
    assert _statuses(instance, "video_shards")[VIDEO_SHARD] == "written"
    assert not Path(layout.tar(VIDEO_SHARD)).exists() and not Path(layout.video_tar("00000")).exists()
    assert _statuses(instance, "clip_embeddings")[VIDEO_SHARD] == "not applicable (video shard)"

    # the video shard: video2dataset's layout, every input row with a status
    table = pq.read_table(layout.video_parquet(VIDEO_SHARD)).to_pandas()
    assert sorted(set(table["source_id"])) == list(range(len(VIDEOS)))  # every input row has a status
    ok = table[table.status == "success"]
    assert len(set(ok["source_id"])) == GOOD_VIDEOS
    clips = list(wds.WebDataset(layout.video_tar(VIDEO_SHARD), shardshuffle=False))
    assert sorted(s["__key__"] for s in clips) == sorted(ok["key"])
    for s in clips:
        meta = json.loads(s["json"])
        assert {"mp4", "json", "txt"} <= set(s) and meta["height"] <= 32 and meta["framerate"] == 12

    # one energon dataset over image and video latents; a NeMo-style cooker sees T' > 1 for the videos
    seen: dict[str, tuple] = {}

    @stateless
    def cook(sample: dict) -> dict:
        return dict(**basic_sample_keys(sample), pth=sample[".pth"], pickle=sample[".pickle"], json=sample[".json"])

    class NemoLike(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        @stateless
        def encode_sample(self, sample):
            latent, meta, text = sample["pth"], sample["json"], sample["pickle"]
            c, t, h, w = latent.shape
            assert latent.dtype == torch.bfloat16 and text.dtype == np.float16
            # BasicDiffusionTaskEncoder: 2x2 patches in space, 1 in time; T5 padded to 512
            patches = latent.reshape(c, t, h // 2, 2, w // 2, 2).permute(1, 2, 4, 3, 5, 0).reshape(t * h * w // 4, -1)
            assert patches.shape[0] == t * (h // 2) * (w // 2) and text.shape[0] <= 512
            if t > 1:  # the video branch reads these (and aesthetic_score, always)
                assert {"height", "width", "framerate", "num_frames", "aesthetic_score"} <= set(meta)
                assert t == 1 + (meta["num_frames"] - 1) // 4 and meta["num_frames"] <= MAX_FRAMES
            else:
                assert {"image_height", "image_width", "aesthetic_score"} <= set(meta)
            seen[sample["__key__"]] = (t, meta.get("num_frames"))
            return sample

        def batch(self, samples):
            return samples

    keys = energon_keys(layout.diffusion_dir, "train", NemoLike()) + energon_keys(layout.diffusion_dir, "val",
                                                                                 NemoLike())
    assert sorted(keys) == sorted(seen)
    video_keys = {k for k in seen if k in set(ok["key"])}
    assert video_keys == set(ok["key"]) and all(seen[k][0] > 1 for k in video_keys)
    assert any(seen[k][0] == 1 for k in seen if k not in video_keys)  # the image samples are in it too

    # the UI shows a frame strip per clip: the sheet inlined in the materialization, one row per clip
    from PIL import Image

    from shardprep.report.contact_sheet import LINE_HEIGHT, PAD, STRIP_FRAMES

    record = instance.fetch_materializations(dg.AssetKey("video_shards"), limit=100).records
    meta = next(r.asset_materialization.metadata for r in record if r.asset_materialization.partition == VIDEO_SHARD)
    assert meta["contact_sheet"].value.startswith("![contact sheet of shard 00002](data:image/")
    assert meta["clips"].value == len(clips) and meta["clip_seconds"].value > 0
    with Image.open(layout.contact_sheet(VIDEO_SHARD)) as sheet:
        thumb = 64
        assert sheet.size == (STRIP_FRAMES * (thumb + PAD) + PAD,
                              min(len(clips), 12) * (LINE_HEIGHT + 2 * PAD + thumb) + PAD)
        # frames were drawn, and different ones (each test frame has its own colour): the centres of the
        # first and last cells of the first strip differ, and neither is the blank cell's grey
        y = PAD + LINE_HEIGHT + PAD + thumb // 2
        first, last = (sheet.convert("RGB").getpixel((PAD + j * (thumb + PAD) + thumb // 2, y)) for j in (0, 5))
        assert first != last and (235, 235, 235) not in (first, last)

    # the report counts clips and their durations; verify finds every output whole
    report = Path(layout.report_html).read_text()
    assert 'id="video_shards"' in report and 'id="clip_durations"' in report
    assert verify_dataset(config, instance, mark=False).ok
    # `shardprep status` says which shards are which
    from shardprep_dagster.orchestration.status import status

    assert status(config).splitlines()[-1].startswith("shards: 2 image, 1 video. Image shards only: ")


def test_a_rerun_does_nothing_and_a_video_setting_redoes_only_video_outputs(dataset, instance):
    config, layout = dataset
    first = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert first.ok
    again = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert again.ok and again.runs == 0

    image_tars = {k: Path(layout.tar(k)).stat().st_mtime_ns for k in IMAGE_SHARDS if Path(layout.tar(k)).exists()}
    image_latents = {k: Path(layout.diffusion_tar(k)).stat().st_mtime_ns for k in IMAGE_SHARDS}
    text = Path(config).read_text().replace("video_diffusion_frames: 9", "video_diffusion_frames: 5")
    Path(config).write_text(text)
    redo = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert redo.ok
    # the video latents were redone (5 frames at most now), no image output was touched
    for s in wds.WebDataset(layout.diffusion_tar(VIDEO_SHARD), shardshuffle=False):
        assert json.loads(s[".json"])["num_frames"] <= 5
    assert image_tars == {k: Path(layout.tar(k)).stat().st_mtime_ns for k in image_tars}
    assert image_latents == {k: Path(layout.diffusion_tar(k)).stat().st_mtime_ns for k in IMAGE_SHARDS}
