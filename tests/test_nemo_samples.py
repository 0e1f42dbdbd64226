"""NeMo sample writers: diffusion (DiT) sample tars read by the real Megatron-Energon with a task
encoder reproducing NeMo's BasicDiffusionTaskEncoder, SD precached encodings in NeMo's exact keys,
the tiny local T5/autoencoders they run with, and the process-wide encoder cache."""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from shardprep.keys import compute_key, shard_key
from shardprep.layout import Layout
from shardprep.models import nemo as nemo_models
from shardprep.models.nemo import ClipTextEncoder, ImageAutoencoder, ModelLoadError, T5TextEncoder
from shardprep.nemo.diffusion import aesthetic_score, latent_id, latent_problem, write_diffusion_samples
from shardprep.nemo.precache import IMAGE_KEY, TEXT_KEY, PrecacheError, write_precached_encodings
from tests.fixtures.synthetic import render_image
from tests.fixtures.tiny_nemo import build_tiny_autoencoder, build_tiny_sd_autoencoder, build_tiny_t5

RES = 64  # -> 8x8 latents, 16 DiT patches
OOM = 2
T5_DIM = 32
SHARDS = {0: 6, 1: 5}  # shard id -> samples
BROKEN = compute_key(2, 1, OOM)  # its .jpg is not an image
CAPTIONS = ["a photo of a red cat on a blue sofa", "", "two children playing football in a green park",
            "a vintage car parked in front of a brick building " * 30, "Zebra!", "a bird over the sea"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _image_bytes(i: int, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    render_image(i, 48 + 13 * i, 40 + 7 * (i % 3)).save(buf, format=fmt)  # varied sizes/aspects
    return buf.getvalue()


def make_image_shards(root: Path) -> dict[str, dict]:
    """img2dataset-layout tars (``{key}.jpg/.txt/.json``); returns key -> {caption, aesthetic}."""
    layout = Layout(str(root))
    os.makedirs(layout.images_dir, exist_ok=True)
    truth = {}
    for shard_id, n in SHARDS.items():
        with wds.TarWriter(layout.tar(shard_key(shard_id))) as sink:
            for i in range(n):
                key = compute_key(i, shard_id, OOM)
                caption = CAPTIONS[(i + shard_id) % len(CAPTIONS)]
                meta = {"key": key, "status": "success", "caption": caption, "width": 64, "height": 48}
                if i % 2:
                    meta["aesthetic_score"] = 4.25 + i
                image = b"not an image at all" if key == BROKEN else _image_bytes(10 * shard_id + i)
                sink.write({"__key__": key, "jpg": image, "txt": caption, "json": json.dumps(meta)})
                truth[key] = {"caption": caption, "aesthetic": meta.get("aesthetic_score", 0.0)}
    return truth


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_clip_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("nemo-models")
    return {"t5": build_tiny_t5(str(root / "t5"), d_model=T5_DIM),
            "vae": build_tiny_autoencoder(str(root / "vae16")),
            "sd_vae": build_tiny_sd_autoencoder(str(root / "vae4")),
            "clip": tiny_clip_dir}


@pytest.fixture(scope="module")
def encoders(models):
    return {"t5": T5TextEncoder(models["t5"], device="cpu"), "vae": ImageAutoencoder(models["vae"], device="cpu"),
            "sd_vae": ImageAutoencoder(models["sd_vae"], device="cpu"),
            "clip": ClipTextEncoder(models["clip"], device="cpu")}


@pytest.fixture(scope="module")
def diffusion(tmp_path_factory, encoders):
    root = tmp_path_factory.mktemp("diffusion")
    truth = make_image_shards(root)
    layout = Layout(str(root))
    reports = {shard_key(s): write_diffusion_samples(shard_key(s), layout, encoders["t5"], encoders["vae"],
                                                     resolution=RES, batch_size=4) for s in SHARDS}
    return layout, truth, reports


def _members(tar_path: str) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


# --- tiny models ---------------------------------------------------------------------------------

def test_tiny_models_load_offline_and_t5_tokenizer_round_trips(models):
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel, T5TokenizerFast

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    tok = AutoTokenizer.from_pretrained(models["t5"])
    assert isinstance(tok, T5TokenizerFast)
    text = "A photo of a red cat, 42 times! (Zebra_x) & more."
    ids = tok(text).input_ids
    assert ids[-1] == tok.eos_token_id == 1 and tok.pad_token_id == 0  # T5's layout: </s> appended
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1  # sentinels at the vocabulary's end
    t5 = T5EncoderModel.from_pretrained(models["t5"])
    assert t5.config.d_model == T5_DIM and t5.config.vocab_size == len(tok)
    for name, channels in (("vae", 16), ("sd_vae", 4)):
        vae = AutoencoderKL.from_pretrained(models[name])
        assert vae.config.latent_channels == channels
        with torch.no_grad():
            assert vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.mean.shape == (1, channels, 4, 4)  # 8x down
    assert CLIPTextModel.from_pretrained(models["clip"]).config.max_position_embeddings == 77

    before = {n: os.stat(os.path.join(models["t5"], n)).st_mtime_ns for n in os.listdir(models["t5"])}
    assert build_tiny_t5(models["t5"], d_model=T5_DIM) == models["t5"]  # idempotent: nothing rebuilt
    assert {n: os.stat(os.path.join(models["t5"], n)).st_mtime_ns for n in os.listdir(models["t5"])} == before
    with pytest.raises(ValueError, match="d_model"):
        build_tiny_t5(models["t5"], d_model=30)


# --- encoders ------------------------------------------------------------------------------------

def test_encoder_cache_loads_each_model_once(models):
    nemo_models.clear_cache()
    start = nemo_models.LOAD_COUNT
    a = T5TextEncoder(models["t5"], device="cpu")
    b = T5TextEncoder(models["t5"], device="cpu", max_length=64)
    assert nemo_models.LOAD_COUNT == start + 1 and a.model is b.model
    v1, v2 = ImageAutoencoder(models["vae"], device="cpu"), ImageAutoencoder(models["vae"], device="cpu")
    assert nemo_models.LOAD_COUNT == start + 2 and v1.model is v2.model
    ImageAutoencoder(models["sd_vae"], device="cpu")  # another model is another load
    assert nemo_models.LOAD_COUNT == start + 3
    with pytest.raises(ModelLoadError, match="no-such-model"):
        ImageAutoencoder(str(Path(models["vae"]).parent / "no-such-model"), device="cpu")
    assert nemo_models.LOAD_COUNT == start + 3


def test_t5_encoding_matches_nemo_encode_for_batch(encoders):
    t5 = encoders["t5"]
    texts = ["a photo of a red cat", "", "word " * 600]
    out = t5.encode(texts)
    lengths = [len(t5.tokenizer(t, truncation=True, max_length=512).input_ids) for t in texts]
    assert [o.shape for o in out] == [(n, T5_DIM) for n in lengths] and lengths[1] == 1 and lengths[2] == 512
    assert all(o.dtype == np.float16 for o in out)
    # dropping positions past the length of a max_length-padded run == running the unpadded text
    with torch.no_grad():
        ids = t5.tokenizer(texts[:1], return_tensors="pt").input_ids
        plain = t5.model(input_ids=ids).last_hidden_state[0].numpy()
    np.testing.assert_allclose(out[0].astype(np.float32), plain, atol=2e-3, rtol=2e-3)


# --- diffusion samples ---------------------------------------------------------------------------

def test_diffusion_tars_hold_nemo_members(diffusion, encoders):
    layout, truth, reports = diffusion
    written, home = {}, {}
    for shard, rep in reports.items():
        members = _members(layout.diffusion_tar(shard))
        names = list(members)
        assert all(n.endswith(("..pth", "..pickle", "..json")) for n in names), names
        keys = sorted({n.split(".")[0] for n in names})
        assert names == [f"{k}..{e}" for k in keys for e in ("json", "pickle", "pth")]  # contiguous samples
        assert rep.samples == len(keys) == rep.input_samples - len(rep.failures)
        written.update({k: members for k in keys})
        home.update(dict.fromkeys(keys, shard))
    assert reports["00001"].failures == [{"key": BROKEN, "reason": reports["00001"].failures[0]["reason"]}]
    assert "image decode" in reports["00001"].failures[0]["reason"]
    assert set(written) == set(truth) - {BROKEN}

    tok = encoders["t5"].tokenizer
    for key, members in written.items():
        latent = torch.load(io.BytesIO(members[f"{key}..pth"]), weights_only=True)
        assert latent.dtype == torch.bfloat16 and latent.shape == (16, 1, RES // 8, RES // 8)
        text = pickle.loads(members[f"{key}..pickle"])
        n_tokens = len(tok(truth[key]["caption"], truncation=True, max_length=512).input_ids)
        assert isinstance(text, np.ndarray) and text.dtype == np.float16 and text.shape == (n_tokens, T5_DIM)
        meta = json.loads(members[f"{key}..json"])
        with tarfile.open(layout.tar(home[key])) as tf:
            image = tf.extractfile(f"{key}.jpg").read()
        assert meta == {"image_height": RES, "image_width": RES, "aesthetic_score": truth[key]["aesthetic"],
                        "caption": truth[key]["caption"], "source_key": key,
                        "latent_id": latent_id(image, encoders["vae"].path, RES)}

    # the stored latents are the autoencoder's mean of NeMo-style preprocessing, cast to bf16
    # (re-encoded as the same batch of 4 the writer used, so CPU kernels give identical bits)
    keys = [compute_key(i, 0, OOM) for i in range(4)]
    with tarfile.open(layout.tar("00000")) as tf:
        x = torch.stack([nemo_models.preprocess_image(tf.extractfile(f"{k}.jpg").read(), RES) for k in keys])
    assert x.shape == (4, 3, RES, RES) and -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    expected = encoders["vae"].encode(x, output="mean").to(torch.bfloat16)
    for k, exp in zip(keys, expected):
        assert torch.equal(torch.load(io.BytesIO(written[k][f"{k}..pth"]), weights_only=True)[:, 0], exp)


def test_megatron_energon_reads_diffusion_tars_like_nemo(diffusion, tmp_path):
    """Real `energon prepare` CLI + get_train_dataset/get_loader with NeMo's encode_sample logic."""
    import torch.nn.functional as F
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        SkipSample,
        WorkerConfig,
        basic_sample_keys,
        get_loader,
        get_train_dataset,
        stateless,
    )

    layout, truth, reports = diffusion
    data = tmp_path / "diffusion"
    shutil.copytree(layout.diffusion_dir, data)
    energon = Path(sys.executable).parent / "energon"
    res = subprocess.run([str(energon), "prepare", str(data), "--non-interactive", "--split-ratio", "1,0,0",
                          "--sample-type", "CrudeWebdataset", "--no-progress"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE_ENV})
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((data / ".nv-meta" / ".info.json").read_text())["shard_counts"] == {
        f"{s}.tar": r.samples for s, r in reports.items()}

    skipped = []
    text_pad, patch = 512, 2

    @stateless
    def cook(sample: dict) -> dict:  # NeMo's cook(), made @stateless as energon 7.x requires
        return dict(**basic_sample_keys(sample), json=sample[".json"], pth=sample[".pth"], pickle=sample[".pickle"])

    class NemoDiffusionTaskEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        @stateless
        def encode_sample(self, sample: dict) -> dict:  # BasicDiffusionTaskEncoder.encode_sample, image path
            video_latent = sample["pth"]
            if torch.isnan(video_latent).any() or torch.isinf(video_latent).any() or \
                    torch.max(torch.abs(video_latent)) > 1e3:
                skipped.append(sample["__key__"])
                raise SkipSample()
            info = sample["json"]
            if info["aesthetic_score"] < 0.0:
                skipped.append(sample["__key__"])
                raise SkipSample()
            C, T, H, W = video_latent.shape
            seq_len = T * H * W // patch**2
            # einops 'C (T pt) (H ph) (W pw) -> (T H W) (ph pw pt C)', pt=1, ph=pw=2
            video = video_latent.reshape(C, T, 1, H // patch, patch, W // patch, patch)
            video = video.permute(1, 3, 5, 4, 6, 2, 0).reshape(seq_len, patch * patch * C)
            text = torch.from_numpy(sample["pickle"]).to(torch.bfloat16)
            n = text.shape[0]
            text = text[:text_pad] if n > text_pad else F.pad(text, (0, 0, 0, text_pad - n))
            h, w = info["image_height"], info["image_width"]
            return dict(key=sample["__key__"], video=video, t5_text_embeddings=text,
                        t5_text_mask=torch.ones(n, dtype=torch.bfloat16), latent=video_latent,
                        image_size=torch.tensor([[h, w, h, w]], dtype=torch.bfloat16),
                        latent_shape=torch.tensor([C, T, H, W], dtype=torch.int32))

        def batch(self, samples):
            return samples

    ds = get_train_dataset(str(data), split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=3, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           task_encoder=NemoDiffusionTaskEncoder(), repeat=False)
    seen = []
    for batch in get_loader(ds):
        for s in batch:
            seen.append(s["key"])
            assert s["video"].shape == (16, 64) and s["video"].dtype == torch.bfloat16  # 8x8 latent / 2x2
            assert s["t5_text_embeddings"].shape == (text_pad, T5_DIM)
            assert s["t5_text_embeddings"].dtype == torch.bfloat16
            assert s["latent_shape"].tolist() == [16, 1, 8, 8]
            assert s["image_size"].tolist() == [[RES, RES, RES, RES]]
            # the patchify really is the einops pattern: patch (t,h,w) row holds (ph, pw, pt, C)
            c, ph, pw = 5, 1, 0
            row = (0 * 4 + 2) * 4 + 3  # T=0, H=2, W=3 on the 4x4 patch grid
            assert s["video"][row, (ph * 2 + pw) * 16 + c] == s["latent"][c, 0, 2 * 2 + ph, 3 * 2 + pw]
            n = s["t5_text_mask"].shape[0]
            assert not s["t5_text_embeddings"][n:].any()  # zero padding after the real tokens
    assert skipped == []
    assert Counter(seen) == Counter(set(truth) - {BROKEN})  # every key exactly once


def _poisoned_copy(src: str, dst: str) -> str:
    """A copy of the tiny autoencoder with one NaN bias in its encoder's output conv."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(src)
    with torch.no_grad():
        vae.encoder.conv_out.bias[0] = float("nan")
    vae.save_pretrained(dst)
    return dst


def test_nan_or_huge_latents_are_recorded_failures_and_leave_no_tar(diffusion, encoders, models, tmp_path):
    layout, truth, _ = diffusion
    assert latent_problem(torch.zeros(16, 1, 2, 2)) is None
    assert "NaN/Inf" in latent_problem(torch.tensor([0.0, float("inf")]))
    assert "> 1000" in latent_problem(torch.tensor([1e3 + 8]))
    assert aesthetic_score({"AESTHETIC_SCORE": 6.5}) == 6.5 and aesthetic_score({"aesthetic_score": "x"}) == 0.0

    out = Layout(str(tmp_path))
    shutil.copytree(layout.images_dir, out.images_dir)
    os.makedirs(out.diffusion_dir)
    Path(out.diffusion_tar("00000")).write_bytes(b"stale output of an older run")
    vae = ImageAutoencoder(_poisoned_copy(models["vae"], str(tmp_path / "vae-nan")), device="cpu")
    rep = write_diffusion_samples("00000", out, encoders["t5"], vae, resolution=RES, batch_size=8)
    assert rep.samples == 0 and not rep.tar_written and rep.input_samples == SHARDS[0]
    assert [f["key"] for f in rep.failures] == [compute_key(i, 0, OOM) for i in range(SHARDS[0])]
    assert all("NaN/Inf" in f["reason"] for f in rep.failures)
    assert not os.path.exists(out.diffusion_tar("00000"))  # no empty tar, and the stale one is gone
    assert not [n for n in os.listdir(out.diffusion_dir)]  # no temp files left either


def test_cosmos_autoencoder_spec(tmp_path, encoders):
    with pytest.raises(ModelLoadError, match="encoder.jit"):
        ImageAutoencoder(f"cosmos:{tmp_path / 'missing'}", device="cpu")

    class TinyCausalEncoder(torch.nn.Module):  # Cosmos CV encoders map B x 3 x T x H x W -> (B x 16 x t x h x w,)
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv3d(3, 16, kernel_size=(1, 8, 8), stride=(1, 8, 8))

        def forward(self, x):
            return (self.conv(x),)

    folder = tmp_path / "cosmos"
    folder.mkdir()
    torch.jit.script(TinyCausalEncoder()).save(str(folder / "encoder.jit"))
    vae = ImageAutoencoder(f"cosmos:{folder}", device="cpu")
    lat = vae.encode(torch.zeros(2, 3, RES, RES))
    assert lat.shape == (2, 16, RES // 8, RES // 8)
    with pytest.raises(ValueError, match="no latent distribution"):
        vae.encode(torch.zeros(1, 3, RES, RES), output="parameters")


# --- SD precache ---------------------------------------------------------------------------------

def test_precache_matches_nemo_keys_shapes_and_counts(diffusion, encoders, tmp_path):
    layout, truth, _ = diffusion
    src = layout.tar("00000")  # a "balanced" tar: equal-size chunks of img2dataset samples
    with tarfile.open(src) as tf:
        originals = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    keys = sorted({n.split(".")[0] for n in originals})
    clip, sd = encoders["clip"], encoders["sd_vae"]
    for keep in (False, True):
        out = str(tmp_path / f"precached-{keep}" / "00000.tar")
        rep = write_precached_encodings(src, out, sd, clip, keep_original=keep, resolution=RES, batch_size=4)
        assert rep.samples == len(keys) and rep.tar_written and rep.nonfinite_keys == []
        members = _members(out)
        expected = sorted(f"{k}.{e}" for k in keys for e in (("jpg", "pickle", "txt") if keep else ("pickle",)))
        assert sorted(members) == expected
        if keep:
            assert all(members[n] == originals[n] for n in members if not n.endswith(".pickle"))
        for k in keys:
            enc = pickle.loads(members[f"{k}.pickle"])
            assert set(enc) == {"autoencoderkl_image", "clip-vit-large-patch14_text"} == {IMAGE_KEY, TEXT_KEY}
            img, txt = enc[IMAGE_KEY], enc[TEXT_KEY]
            assert img.dtype == np.float16 and img.shape == (8, RES // 8, RES // 8)  # mean||logvar of 4 channels
            assert txt.dtype == np.float32 and txt.shape == (80, 32)  # 77 tokens zero-padded to a multiple of 8
            assert not txt[77:].any() and txt[:77].any(axis=1).all()
        # read back as NeMo's WebDatasetCommon does (webdataset + pickle handler): one sample per key
        ds = wds.WebDataset(out, shardshuffle=False).decode()
        assert sorted(s["__key__"] for s in ds) == keys

    # values: CLIP text rows are FrozenCLIPEmbedder's (padded to 77, no mask); the image entry is the
    # posterior's parameters (mean||logvar) -- re-encoded as the writer's first batch of 4 (same bits)
    first = keys[:4]
    encs = [pickle.loads(members[f"{k}.pickle"]) for k in first]
    tokens = clip.tokenizer([truth[k]["caption"] for k in first], padding="max_length", max_length=77,
                            truncation=True, return_tensors="pt").input_ids
    x = torch.stack([nemo_models.preprocess_image(originals[f"{k}.jpg"], RES) for k in first])
    with torch.no_grad():
        ref = clip.model(input_ids=tokens).last_hidden_state.numpy()
        dist = sd.model.encode(x).latent_dist
    for i, enc in enumerate(encs):
        np.testing.assert_allclose(enc[TEXT_KEY][:77], ref[i], atol=1e-5)
        np.testing.assert_array_equal(enc[IMAGE_KEY], dist.parameters[i].to(torch.float16).numpy())
        np.testing.assert_array_equal(enc[IMAGE_KEY][:4], dist.mean[i].to(torch.float16).numpy())


def test_precache_refuses_to_drop_a_sample(diffusion, encoders, tmp_path):
    layout, _, _ = diffusion
    out = str(tmp_path / "precached" / "00001.tar")
    with pytest.raises(PrecacheError, match=f"{BROKEN}.*cannot be decoded"):
        write_precached_encodings(layout.tar("00001"), out, encoders["sd_vae"], encoders["clip"], resolution=RES)
    assert not os.path.exists(os.path.dirname(out)) or not os.listdir(os.path.dirname(out))
