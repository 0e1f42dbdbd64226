"""Video diffusion samples from a video shard: causal video latents with T' = 1 + (T - 1) / tc exactly, for
the three kinds of video autoencoder (diffusers' AutoencoderKLCosmos and AutoencoderKLWan, a Cosmos
TorchScript tokenizer folder), tiny and random, built here; frames cut, resized and cropped as documented;
bad clips recorded, never a crash."""

import io
import json
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds

from shardprep.models.nemo import ModelLoadError, T5TextEncoder
from shardprep.models.video_autoencoders import VideoAutoencoder, frames_to_use
from shardprep.nemo.video_diffusion import crop_size, decode_clip, write_video_diffusion_samples
from shardprep.tars import TarWriter
from tests.fixtures import videos
from tests.fixtures.tiny_nemo import build_tiny_video_autoencoder

X264 = {"preset": "ultrafast", "g": "12"}
MAX_FRAMES = 33
RES = 32
# key -> (frames in the clip, width, height); each becomes a sample of the shard
CLIPS = {"00000000": (48, 64, 48), "00000001": (12, 64, 48), "00000002": (9, 96, 48), "00000003": (1, 48, 64)}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_nemo_dirs):
    root = tmp_path_factory.mktemp("video_vaes")
    vaes = {kind: build_tiny_video_autoencoder(str(root / kind), kind) for kind in ("cosmos_diffusers", "wan",
                                                                                      "cosmos_jit")}
    return vaes, T5TextEncoder(tiny_nemo_dirs["t5"], device="cpu")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A video shard tar as video_shards writes it: the clips above, a broken one, one without caption."""
    url = str(tmp_path_factory.mktemp("video_shard") / "00000.tar")
    with TarWriter(url) as tar:
        for key, (n, w, h) in CLIPS.items():
            data = videos.encode("mp4", "libx264", width=w, height=h, rate=12, n_frames=n, options=X264)
            tar.add(key, {"mp4": data, "json": json.dumps({"key": key, "framerate": 12.0, "aesthetic_score": 5.5}),
                          "txt": f"clip {key} of {n} frames"})
        tar.add("00000004", {"mp4": bytes(range(256)) * 4, "json": "{}", "txt": "garbage bytes"})
        tar.add("00000005", {"mp4": videos.encode("mp4", "libx264", n_frames=9, options=X264), "json": "{}"})
    return url


def test_frames_to_use_is_one_plus_a_multiple_of_the_temporal_compression():
    assert [frames_to_use(n, 33, 4) for n in (0, 1, 2, 4, 5, 8, 9, 12, 33, 48)] == [0, 1, 1, 1, 5, 5, 9, 9, 33, 33]
    assert frames_to_use(48, 17, 8) == 17 and frames_to_use(16, 121, 8) == 9


@pytest.mark.parametrize("kind", ["cosmos_diffusers", "wan", "cosmos_jit"])
def test_latents_have_exactly_the_causal_frame_count(kind, models, shard, tmp_path):
    vaes, t5 = models
    vae = VideoAutoencoder(vaes[kind], device="cpu")
    out = str(tmp_path / "diffusion.tar")
    report = write_video_diffusion_samples(shard, out, t5, vae, resolution=RES, max_frames=MAX_FRAMES, batch_size=3)

    assert report.input_samples == 6 and report.samples == 4
    reasons = {f["key"]: f["reason"] for f in report.failures}
    assert reasons["00000004"].startswith("video decode failed") and reasons["00000005"] == "no .txt caption"
    tc, s = vae.compression.temporal, vae.compression.spatial
    assert tc == 4 and s == (4 if kind == "cosmos_diffusers" else 8)
    samples = {x["__key__"]: x for x in wds.WebDataset(out, shardshuffle=False)}
    assert sorted(samples) == sorted(CLIPS)
    for key, (n, w, h) in CLIPS.items():
        x = samples[key]
        latent = torch.load(io.BytesIO(x[".pth"]))
        meta = json.loads(x[".json"])
        t = frames_to_use(n, MAX_FRAMES, tc)
        _, _, cw, ch = crop_size(w, h, RES, 16)
        assert latent.dtype == torch.bfloat16 and latent.ndim == 4
        assert tuple(latent.shape[1:]) == (1 + (t - 1) // tc, ch // s, cw // s), key
        assert (meta["num_frames"], meta["height"], meta["width"], meta["framerate"]) == (t, ch, cw, 12.0)
        assert meta["aesthetic_score"] == 5.5 and meta["source_key"] == key and meta["caption"] == f"clip {key} of {n} frames"
        assert meta["aspect_ratio"] == pytest.approx(w / h)
        # a 1-frame latent is an image to NeMo's task encoder: it gets the image branch's fields too
        assert ("image_height" in meta) == (t == 1)
        text = pickle.loads(x[".pickle"])
        assert text.dtype == np.float16 and text.ndim == 2 and text.shape[1] == report.text_dim
    assert sorted(report.latent_shapes) == report.latent_shapes and report.frames == sum(
        frames_to_use(n, MAX_FRAMES, tc) for n, _, _ in CLIPS.values())


def test_the_frames_fed_are_the_clips_first_ones_resized_and_center_cropped(shard):
    # the test videos show frame i in colour i: decode back which source frames were fed
    data = videos.encode("mp4", "libx264", width=96, height=48, rate=12, n_frames=20, options=X264)
    clip, rate, w, h = decode_clip(data, max_frames=13, temporal=4, resolution=RES, multiple=16)
    assert (rate, w, h) == (12.0, 96, 48)
    assert tuple(clip.shape) == (3, 13, 32, 64)  # 96x48 -> 64x32: both sides already multiples of 16
    assert float(clip.min()) >= -1.0 and float(clip.max()) <= 1.0
    rgb = ((clip.permute(1, 2, 3, 0).numpy() + 1) * 127.5).round().astype(np.uint8)
    # away from the white mark in the stored top-left corner
    assert [videos.frame_index(f[8:, 16:]) for f in rgb] == list(range(13))

    # 64x48 at resolution 32: 43x32 after the resize, cropped to 32x32 around the centre
    clip, *_ = decode_clip(videos.encode("mp4", "libx264", width=64, height=48, n_frames=5, options=X264),
                           max_frames=33, temporal=4, resolution=RES, multiple=16)
    assert tuple(clip.shape) == (3, 5, 32, 32)


def test_no_surviving_clip_leaves_no_tar(models, tmp_path):
    vaes, t5 = models
    vae = VideoAutoencoder(vaes["wan"], device="cpu")
    bad = str(tmp_path / "bad.tar")
    with TarWriter(bad) as tar:
        tar.add("00000000", {"mp4": b"<html>not found</html>", "txt": "x"})
    out = tmp_path / "out.tar"
    out.write_bytes(b"stale")
    report = write_video_diffusion_samples(bad, str(out), t5, vae, resolution=RES, max_frames=9)
    assert report.samples == 0 and not report.tar_written and not out.exists()
    assert report.failures[0]["reason"].startswith("video decode failed")
    # no input tar at all: nothing written either
    missing = write_video_diffusion_samples(str(tmp_path / "none.tar"), str(out), t5, vae, resolution=RES)
    assert missing.input_samples == 0 and not out.exists()
    with pytest.raises(ValueError, match="resolution must be a positive integer multiple of 16"):
        write_video_diffusion_samples(bad, str(out), t5, vae, resolution=40)


def test_a_wrong_model_is_refused_naming_it(tmp_path, tiny_nemo_dirs):
    with pytest.raises(ModelLoadError, match="encoder.jit"):
        VideoAutoencoder(f"cosmos:{tmp_path / 'missing'}", device="cpu")
    with pytest.raises(ModelLoadError, match="AutoencoderKL; a video autoencoder is cosmos:<dir> or one of"):
        VideoAutoencoder(tiny_nemo_dirs["autoencoder"], device="cpu")  # an image VAE
    vae = VideoAutoencoder(build_tiny_video_autoencoder(str(tmp_path / "wan"), "wan"), device="cpu")
    with pytest.raises(ValueError, match="needs 1 \\+ k \\* 4"):
        vae.encode(torch.zeros(3, 8, 32, 32))
