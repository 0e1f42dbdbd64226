"""CLIP embeddings in clip-retrieval's layout, checked against the real clip-retrieval inference and
read back by the real embedding-reader; per-shard reordering for DALLE2; the tiny local CLIP."""

import io
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import webdataset as wds
from PIL import Image

from shardprep.clip_samples import ShardReadError
from shardprep.embeddings import write_clip_embeddings
from shardprep.keys import compute_key, index_of_key, oom_sample_per_shard, shard_key
from shardprep.layout import Layout
from shardprep.models import clip as clip_models
from shardprep.reorder import ReorderError, reorder_array, reorder_embeddings
from shardprep.tars import TarReadError
from tests.fixtures.embedding_checks import assert_close_rows

SAMPLES_PER_SHARD = 20
OOM = oom_sample_per_shard(SAMPLES_PER_SHARD)  # 2 digits of in-shard index
# shard id -> in-shard indices that succeeded, in (shuffled) completion order, with holes
SHARDS = {0: [7, 0, 3, 12, 5, 1, 19, 9, 14], 1: [4, 2, 11, 0, 8, 16, 6]}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
               "TOKENIZERS_PARALLELISM": "false"}


def _jpg(rng: random.Random, size=(64, 48)) -> bytes:
    arr = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _meta(key: str, caption: str, i: int) -> dict:
    # img2dataset's json key order; a nested field on some samples exercises json_normalize
    meta = {"caption": caption, "url": f"http://127.0.0.1/img/{key}.jpg", "key": key, "status": "success",
            "error_message": None, "width": 64, "height": 48, "original_width": 128 + i,
            "original_height": 96, "exif": "{}", "sha256": f"{i:064x}"}
    if i % 3 == 0:
        meta["extra"] = {"source": "synthetic", "rank": i}
    return meta


def _write_tar(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path)) as sink:
        for s in samples:
            sink.write(s)


def make_shards(root: Path, shards=SHARDS, seed: int = 0) -> dict[str, dict]:
    """img2dataset-layout tars under ``root/images``; returns key -> {caption, meta} for each sample."""
    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    truth = {}
    for shard_id, indices in shards.items():
        samples = []
        for idx in indices:
            key = compute_key(idx, shard_id, OOM, 5)
            caption = f"a photo of thing {shard_id}-{idx} ünïcode"
            meta = _meta(key, caption, idx)
            truth[key] = {"caption": caption, "meta": meta}
            samples.append({"__key__": key, "jpg": _jpg(rng), "txt": caption.encode(),
                            "json": json.dumps(meta, indent=4).encode()})
        _write_tar(root / "images" / f"{shard_key(shard_id)}.tar", samples)
    return truth


@pytest.fixture(scope="module")
def encoder(tiny_clip_dir):
    return clip_models.load_clip_encoder(f"hf_clip:{tiny_clip_dir}", device="cpu")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two img2dataset-layout tars; returns (layout, truth)."""
    root = tmp_path_factory.mktemp("ours")
    return Layout(str(root)), make_shards(root)


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory, tiny_clip_dir, shards):
    """Starts the real clip-retrieval inference on the same tars in a subprocess (it spawns helper
    processes, each importing clip_retrieval for ~10 s), so it runs while the other tests do."""
    layout, _ = shards
    work = tmp_path_factory.mktemp("clip-retrieval")
    out = work / "out"
    first, last = shard_key(min(SHARDS)), shard_key(max(SHARDS))
    args = dict(input_dataset=f"{layout.images_dir}/{{{first}..{last}}}.tar", output_folder=str(out),
                input_format="webdataset", clip_model=f"hf_clip:{tiny_clip_dir}", num_prepro_workers=1,
                output_partition_count=len(SHARDS), enable_metadata=True, use_jit=False, batch_size=4,
                enable_wandb=False)
    code = f"from clip_retrieval.clip_inference.main import main\nmain(**{args!r})\n"
    log = open(work / "log.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **OFFLINE_ENV},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    yield proc, out, log
    if proc.poll() is None:  # its own process group: stops the helpers it spawned too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def embedded(oracle_run, shards, encoder):
    """The same two shards written by shardprep; returns (layout, truth, reports)."""
    layout, truth = shards
    reports = {s: write_clip_embeddings(shard_key(s), layout, encoder, batch_size=4) for s in SHARDS}
    return layout, truth, reports


@pytest.fixture(scope="module")
def oracle(oracle_run):
    proc, out, log = oracle_run
    rc = proc.wait(timeout=300)
    log.seek(0)
    assert rc == 0, log.read()[-5000:]
    return out


def _load(path) -> np.ndarray:
    return np.load(str(path), allow_pickle=False)


def _rows_by_key(folder: Path, part: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    keys = pd.read_parquet(folder / "metadata" / f"metadata_{part}.parquet")["image_path"].tolist()
    img = _load(folder / "img_emb" / f"img_emb_{part}.npy")
    txt = _load(folder / "text_emb" / f"text_emb_{part}.npy")
    return {k: (img[i], txt[i]) for i, k in enumerate(keys)}


def _cos(a, b) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_images_and_captions_really_differ(embedded):
    # guards against a constant output passing the comparisons above
    layout, _, _ = embedded
    img = _load(layout.img_emb("00000")).astype(np.float32)
    txt = _load(layout.text_emb("00000")).astype(np.float32)
    assert np.abs(img - img[0]).max() > 1e-2 and np.abs(txt - txt[0]).max() > 1e-2
    assert np.abs(img - txt).max() > 1e-2


def test_embedding_reader_reads_our_output(embedded, encoder):
    from embedding_reader import EmbeddingReader

    layout, truth, _ = embedded
    root = Path(layout.embeddings_dir)
    reader = EmbeddingReader(str(root / "img_emb"), file_format="parquet_npy",
                             meta_columns=["image_path", "caption"], metadata_folder=str(root / "metadata"))
    total = sum(len(v) for v in SHARDS.values())
    assert reader.count == total and reader.dimension == encoder.dim == 32
    seen = {}
    for emb, meta in reader(batch_size=5, show_progress=False):
        for row, (key, caption) in zip(emb, meta[["image_path", "caption"]].itertuples(index=False)):
            seen[key] = (row, caption)
    assert set(seen) == set(truth)
    # alignment: the reader's embedding for a key is the one we computed for that key's image
    images = {}
    for shard_id in SHARDS:
        for sample in wds.WebDataset(layout.tar(shard_key(shard_id)), shardshuffle=False):
            images[sample["__key__"]] = Image.open(io.BytesIO(sample["jpg"]))
    keys = sorted(images)
    direct = encoder.encode_images([images[k] for k in keys])
    for k in keys:
        assert seen[k][1] == truth[k]["caption"]
    assert_close_rows([seen[k][0] for k in keys], direct)


def test_missing_or_empty_tar_writes_nothing(tmp_path, encoder):
    layout = Layout(str(tmp_path))
    report = write_clip_embeddings("00003", layout, encoder)
    assert report.samples == 0 and not (tmp_path / "embeddings").exists()
    # an empty tar (img2dataset writes one when a whole shard failed) also clears stale outputs
    make_shards(tmp_path, {3: [1, 2]})
    assert write_clip_embeddings("00003", layout, encoder).samples == 2
    _write_tar(tmp_path / "images" / "00003.tar", [])
    assert write_clip_embeddings("00003", layout, encoder).samples == 0
    assert [p for p in (tmp_path / "embeddings").rglob("*") if p.is_file()] == []


def test_bad_samples_are_recorded_skips(tmp_path, encoder):
    rng = random.Random(5)
    keys = [compute_key(i, 2, OOM) for i in range(4)]
    samples = [
        {"__key__": keys[0], "jpg": _jpg(rng), "txt": b"fine", "json": b'{"url": "u0"}'},
        {"__key__": keys[1], "jpg": b"\xff\xd8 not really a jpeg", "txt": b"broken", "json": b'{"url": "u1"}'},
        {"__key__": keys[2], "jpg": _jpg(rng), "json": b'{"url": "u2"}'},  # no caption
        {"__key__": keys[3], "png": _png(), "txt": b"png works", "json": b'{"url": "u3"}'},
    ]
    (tmp_path / "images").mkdir()
    _write_tar(tmp_path / "images" / "00002.tar", samples)
    layout = Layout(str(tmp_path))
    report = write_clip_embeddings("00002", layout, encoder, batch_size=2)
    assert report.samples == 2
    assert {s["key"] for s in report.skipped} == {keys[1], keys[2]}
    assert any("decode" in s["reason"] for s in report.skipped if s["key"] == keys[1])
    df = pd.read_parquet(layout.emb_metadata("00002"))
    assert df["image_path"].tolist() == [keys[0], keys[3]] and df["url"].tolist() == ["u0", "u3"]
    assert _load(layout.img_emb("00002")).shape == (2, 32)

    # without captions and enable_text=False: image embeddings only, no caption column
    report = write_clip_embeddings("00002", layout, encoder, enable_text=False)
    assert report.samples == 3 and not Path(layout.text_emb("00002")).exists()
    assert "caption" not in pd.read_parquet(layout.emb_metadata("00002")).columns


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGBA", (40, 30), (10, 200, 30, 128)).save(buf, format="PNG")
    return buf.getvalue()


def test_captionless_dataset_with_text_enabled_fails_clearly(tmp_path, encoder):
    rng = random.Random(1)
    (tmp_path / "images").mkdir()
    _write_tar(tmp_path / "images" / "00000.tar",
               [{"__key__": compute_key(i, 0, OOM), "jpg": _jpg(rng), "json": b"{}"} for i in range(2)])
    with pytest.raises(ShardReadError, match=r"shard 00000.*enable_text"):
        write_clip_embeddings("00000", Layout(str(tmp_path)), encoder)


def test_truncated_tar_fails_naming_the_file(tmp_path, encoder):
    make_shards(tmp_path, {0: [0, 1, 2]})
    tar = tmp_path / "images" / "00000.tar"
    tar.write_bytes(tar.read_bytes()[:1500])
    with pytest.raises(TarReadError, match="00000.tar"):
        write_clip_embeddings("00000", Layout(str(tmp_path)), encoder)


# --- reordering for DALLE2's decoder loader -------------------------------------------------------

def test_reorder_array_places_rows_by_key_index():
    rng = np.random.default_rng(0)
    rows, width = 30, 3
    present = rng.permutation(25)[:17]  # shuffled, with holes, and the last rows all missing
    keys = [f"00004{i:03d}" for i in present]
    emb = rng.normal(size=(len(keys), 8)).astype(np.float16)
    out = reorder_array(emb, keys, rows, width)
    assert out.shape == (rows, 8) and out.dtype == np.float16
    for j, k in enumerate(keys):
        np.testing.assert_array_equal(out[index_of_key(k, width)], emb[j])
    holes = sorted(set(range(rows)) - set(int(i) for i in present))
    assert holes[-5:] == [25, 26, 27, 28, 29]
    assert not out[holes].any()


def test_reorder_array_rejects_bad_keys():
    emb = np.ones((2, 4), np.float16)
    with pytest.raises(ReorderError, match=r"shard 00007.*'0000710'.*'0000810'.*index 10"):
        reorder_array(emb, ["0000710", "0000810"], 20, 2, shard="00007")
    with pytest.raises(ReorderError, match=r"shard 00007.*'0000725'.*beyond.*20 rows"):
        reorder_array(emb, ["0000701", "0000725"], 20, 2, shard="00007")
    with pytest.raises(ReorderError, match=r"'abc'"):
        reorder_array(emb, ["0000701", "abc"], 20, 2, shard="00007")
    with pytest.raises(ReorderError, match="2 embeddings but 1 keys"):
        reorder_array(emb, ["0000701"], 20, 2, shard="00007")


def test_reorder_embeddings_for_dalle2(embedded):
    layout, _, _ = embedded
    for shard_id, indices in SHARDS.items():
        s = shard_key(shard_id)
        report = reorder_embeddings(s, layout, rows=SAMPLES_PER_SHARD, index_width=OOM)
        assert report.samples == len(indices) and report.holes == SAMPLES_PER_SHARD - len(indices)
        keys = pd.read_parquet(layout.emb_metadata(s))["image_path"].tolist()
        for src, dst in ((layout.img_emb(s), layout.reordered_img(s)), (layout.text_emb(s), layout.reordered_text(s))):
            emb, out = _load(src), _load(dst)
            assert out.shape == (SAMPLES_PER_SHARD, emb.shape[1]) and out.dtype == np.float16
            for j, k in enumerate(keys):
                np.testing.assert_array_equal(out[index_of_key(k, OOM)], emb[j])
            holes = sorted(set(range(SAMPLES_PER_SHARD)) - set(indices))
            assert not out[holes].any() and np.abs(out[indices]).sum(axis=1).min() > 0
    # DALLE2's loader int()-parses every name in the folder: only our npy files may be there
    assert sorted(os.listdir(layout.reordered_img_dir)) == ["img_emb_00000.npy", "img_emb_00001.npy"]
    assert sorted(os.listdir(layout.reordered_text_dir)) == ["text_emb_00000.npy", "text_emb_00001.npy"]
    for name in os.listdir(layout.reordered_img_dir):
        int(name.split("_")[-1].split(".")[0])


def test_reorder_errors_and_empty_shard(tmp_path, embedded):
    layout, _, _ = embedded
    # rows smaller than the shard's largest index: a clear error naming shard and key
    with pytest.raises(ReorderError, match=r"shard 00000: key '0000012' has index 12, beyond"):
        reorder_embeddings("00000", layout, rows=10, index_width=OOM)
    # a shard without embeddings (0 successes) gets no file, and a stale one is removed
    empty = Layout(str(tmp_path))
    Path(empty.reordered_img("00005")).parent.mkdir(parents=True)
    Path(empty.reordered_img("00005")).write_bytes(b"stale")
    report = reorder_embeddings("00005", empty, rows=SAMPLES_PER_SHARD, index_width=OOM)
    assert report.samples == 0 and os.listdir(empty.reordered_img_dir) == []


# --- the encoder ----------------------------------------------------------------------------------

def test_encoder_loads_once_per_spec(tiny_clip_dir):
    clip_models.clear_encoder_cache()
    before = clip_models.LOAD_COUNT
    a = clip_models.load_clip_encoder(f"hf_clip:{tiny_clip_dir}")
    b = clip_models.load_clip_encoder(f"hf_clip:{tiny_clip_dir}", device="auto")
    assert a is b and clip_models.LOAD_COUNT == before + 1
    assert a.device == "cpu"  # this machine has no GPU: "auto" falls back to CPU
    texts = a.encode_texts(["a red square", "a blue circle", "a red square"])
    assert texts.dtype == np.float16 and texts.shape == (3, 32)
    np.testing.assert_array_equal(texts[0], texts[2])
    assert np.abs(texts[0].astype(np.float32) - texts[1]).max() > 1e-3
    with pytest.raises(ValueError, match="device"):
        clip_models.load_clip_encoder(f"hf_clip:{tiny_clip_dir}", device="tpu")


def test_tiny_clip_is_deterministic_and_idempotent(tmp_path, tiny_clip_dir):
    import clip
    from transformers import CLIPProcessor

    from tests.fixtures.tiny_clip import build_tiny_clip

    other = build_tiny_clip(str(tmp_path / "again"))
    assert (Path(other) / "model.safetensors").read_bytes() == (Path(tiny_clip_dir) / "model.safetensors").read_bytes()
    mtime = os.path.getmtime(Path(other) / "model.safetensors")
    assert build_tiny_clip(other) == other and os.path.getmtime(Path(other) / "model.safetensors") == mtime
    # the HF tokenizer saved with it agrees with OpenAI's clip.tokenize (what hf_clip: uses)
    tok = CLIPProcessor.from_pretrained(tiny_clip_dir).tokenizer
    for text in ["a photo of a cat", "Héllo, wörld!! 123 <b>x</b>", "don't stop"]:
        ref = clip.tokenize([text])[0]
        assert tok(text)["input_ids"] == ref[ref > 0].tolist()


# --- the oracle: real clip-retrieval on the same tars (last: it ran in the background meanwhile) ---

def test_matches_clip_retrieval(embedded, oracle):
    layout, truth, reports = embedded
    ours = Path(layout.embeddings_dir)
    # same folders and file stems; the partition suffix is our shard name (partition P = P-th tar)
    for folder in ("img_emb", "text_emb", "metadata"):
        assert (oracle / folder).is_dir() and (ours / folder).is_dir()
    assert sorted(os.listdir(oracle / "img_emb")) == ["img_emb_0.npy", "img_emb_1.npy"]
    assert sorted(os.listdir(ours / "img_emb")) == ["img_emb_00000.npy", "img_emb_00001.npy"]
    assert sorted(os.listdir(ours / "text_emb")) == ["text_emb_00000.npy", "text_emb_00001.npy"]
    assert sorted(os.listdir(ours / "metadata")) == ["metadata_00000.parquet", "metadata_00001.parquet"]

    for p, shard_id in enumerate(sorted(SHARDS)):
        s = shard_key(shard_id)
        theirs_df = pd.read_parquet(oracle / "metadata" / f"metadata_{p}.parquet")
        ours_df = pd.read_parquet(layout.emb_metadata(s))
        # identical metadata: columns, their order, values, and rows (both in tar order)
        assert list(ours_df.columns) == list(theirs_df.columns)
        assert list(ours_df.columns[:2]) == ["image_path", "caption"] and "extra.rank" in ours_df.columns
        pd.testing.assert_frame_equal(ours_df, theirs_df)
        assert ours_df["image_path"].tolist() == [compute_key(i, shard_id, OOM) for i in SHARDS[shard_id]]
        assert reports[shard_id].samples == len(SHARDS[shard_id]) and reports[shard_id].dim == 32

        theirs_rows = _rows_by_key(oracle, str(p))
        ours_rows = _rows_by_key(ours, s)
        assert set(ours_rows) == set(theirs_rows)
        for key, (img, txt) in ours_rows.items():
            t_img, t_txt = theirs_rows[key]
            assert img.dtype == t_img.dtype == np.float16
            assert _cos(txt, t_txt) > 0.999
            np.testing.assert_allclose(txt.astype(np.float32), t_txt.astype(np.float32), atol=2e-3)
        # images: fast preprocessing resizes with OpenCV, clip-retrieval with PIL (close, not equal)
        keys = sorted(ours_rows)
        assert_close_rows([ours_rows[k][0] for k in keys], [theirs_rows[k][0] for k in keys])
        for arr in (_load(layout.img_emb(s)), _load(layout.text_emb(s))):
            assert arr.dtype == np.float16 and arr.shape == (len(SHARDS[shard_id]), 32)
            np.testing.assert_allclose(np.linalg.norm(arr.astype(np.float32), axis=1), 1.0, atol=2e-3)
        assert reports[shard_id].nan_count == 0 and abs(reports[shard_id].norm_min - 1) < 2e-3
