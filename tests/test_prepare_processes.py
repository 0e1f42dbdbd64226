"""CLIP samples prepared in worker processes (``shardprep.prepare_pool``, the GPU path) give the very files
that threads give, skips and errors included; the pool is started once and reused; a worker that dies
fails the shard clearly instead of hanging. On CPU, forced with ``prepare_processes``."""

import io
import json
import os
import pickle
import random
import re
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from shardprep import embeddings, prepare_pool
from shardprep.clip_samples import ShardReadError
from shardprep.embeddings import write_clip_embeddings
from shardprep.keys import compute_key
from shardprep.layout import Layout
from shardprep.models import clip as clip_models
from tests.test_embeddings import OOM, _jpg, _png, _write_tar, make_shards

PROCESSES = 2


@pytest.fixture(scope="module")
def encoder(tiny_clip_dir):
    yield clip_models.load_clip_encoder(f"hf_clip:{tiny_clip_dir}", device="cpu")
    prepare_pool.shutdown()  # later test modules of this session need no idle workers


def _big_jpg(seed: int) -> bytes:
    """A photo-sized JPEG: decoded at reduced DCT scale and resized by OpenCV (the other resize path)."""
    arr = np.random.default_rng(seed).integers(0, 256, (384, 512, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _mixed_tar(root: Path, shard: int = 2) -> list[str]:
    """Good samples around an undecodable image, a sample without caption, a non-UTF-8 caption, a PNG and
    large JPEGs; returns the keys."""
    rng = random.Random(7)
    keys = [compute_key(i, shard, OOM) for i in range(11)]
    samples = [
        {"__key__": keys[0], "jpg": _jpg(rng), "txt": b"fine", "json": b'{"url": "u0", "n": {"a": 1}}'},
        {"__key__": keys[1], "jpg": b"\xff\xd8 not really a jpeg", "txt": b"broken", "json": b'{"url": "u1"}'},
        {"__key__": keys[2], "jpg": _jpg(rng), "json": b'{"url": "u2"}'},  # no caption
        {"__key__": keys[3], "png": _png(), "txt": b"png works", "json": b'{"url": "u3"}'},
        {"__key__": keys[4], "jpg": _big_jpg(4), "txt": "große Ansicht".encode(), "json": b'{"url": "u4"}'},
        {"__key__": keys[5], "jpg": _jpg(rng), "txt": b"\xff\xfe not utf-8", "json": b'{"url": "u5"}'},
        {"__key__": keys[6], "txt": b"no image at all", "json": b'{"url": "u6"}'},
    ] + [{"__key__": k, "jpg": _big_jpg(i) if i % 2 else _jpg(rng), "txt": f"caption {i} ".encode() * (i * 5),
          "json": json.dumps({"url": f"u{i}"}).encode()} for i, k in enumerate(keys[7:], 7)]
    (root / "images").mkdir(parents=True, exist_ok=True)
    _write_tar(root / "images" / f"{shard:05d}.tar", samples)
    return keys


def _outputs(layout: Layout, shard: str, text: bool = True):
    img = Path(layout.img_emb(shard)).read_bytes()
    txt = Path(layout.text_emb(shard)).read_bytes() if text else None
    return img, txt, pd.read_parquet(layout.emb_metadata(shard))


def _both(tmp_path: Path, encoder, make, shard: str, **kw):
    """(threads, processes): (report, outputs) of the same tar written both ways."""
    got = []
    for mode, processes in (("threads", 0), ("processes", PROCESSES)):
        root = tmp_path / mode
        make(root)
        layout = Layout(str(root))
        report = write_clip_embeddings(shard, layout, encoder, prepare_processes=processes, **kw)
        got.append((report, _outputs(layout, shard, kw.get("enable_text", True))))
    return got


def _assert_same(threads, processes):
    (rt, (img_t, txt_t, df_t)), (rp, (img_p, txt_p, df_p)) = threads, processes
    assert rp.samples == rt.samples > 0
    # PIL's message names its BytesIO by address, which differs from process to process
    assert [{**s, "reason": re.sub(r"0x[0-9a-f]+", "0x", s["reason"])} for s in rp.skipped] == \
        [{**s, "reason": re.sub(r"0x[0-9a-f]+", "0x", s["reason"])} for s in rt.skipped]
    assert img_p == img_t and txt_p == txt_t  # the npy files, byte for byte
    pd.testing.assert_frame_equal(df_p, df_t)


@pytest.mark.parametrize("batch_size", [4, 64])
def test_processes_write_what_threads_write(tmp_path, encoder, batch_size):
    threads, processes = _both(tmp_path, encoder, make_shards, "00000", batch_size=batch_size)
    _assert_same(threads, processes)
    assert threads[0].samples == 9 and not threads[0].skipped


def test_skips_are_the_same(tmp_path, encoder):
    keys = []
    threads, processes = _both(tmp_path, encoder, lambda root: keys.extend(_mixed_tar(root)), "00002",
                               batch_size=3)
    _assert_same(threads, processes)
    assert {s["key"] for s in processes[0].skipped} == {keys[1], keys[2], keys[5], keys[6]}
    assert processes[1][2]["image_path"].tolist() == [keys[i] for i in (0, 3, 4, 7, 8, 9, 10)]

    # images only: the caption-less sample is embedded too
    threads, processes = _both(tmp_path / "notext", encoder, _mixed_tar, "00002", batch_size=3, enable_text=False)
    _assert_same(threads, processes)
    assert processes[0].samples == 8


def test_bad_json_raises_naming_the_tar_and_key(tmp_path, encoder):
    rng = random.Random(3)
    keys = [compute_key(i, 0, OOM) for i in range(6)]
    samples = [{"__key__": k, "jpg": _jpg(rng), "txt": b"c", "json": b'{"ok": 1}'} for k in keys]
    samples[4]["json"] = b"{not json"
    (tmp_path / "images").mkdir()
    _write_tar(tmp_path / "images" / "00000.tar", samples)
    with pytest.raises(ShardReadError, match=rf"00000\.tar: sample '{keys[4]}': \.json is not valid JSON"):
        write_clip_embeddings("00000", Layout(str(tmp_path)), encoder, batch_size=2, prepare_processes=PROCESSES)
    samples[4]["json"] = b"[1, 2]"
    _write_tar(tmp_path / "images" / "00000.tar", samples)
    with pytest.raises(ShardReadError, match=rf"sample '{keys[4]}': \.json must hold an object"):
        write_clip_embeddings("00000", Layout(str(tmp_path)), encoder, batch_size=2, prepare_processes=PROCESSES)
    # the pool survives a shard's error
    make_shards(tmp_path)
    assert write_clip_embeddings("00000", Layout(str(tmp_path)), encoder, prepare_processes=PROCESSES).samples == 9


def test_the_pool_is_reused_across_shards(tmp_path, encoder):
    make_shards(tmp_path)
    layout = Layout(str(tmp_path))
    write_clip_embeddings("00000", layout, encoder, batch_size=4, prepare_processes=PROCESSES)
    pids = prepare_pool.worker_pids()
    assert len(pids) == PROCESSES and os.getpid() not in pids
    write_clip_embeddings("00001", layout, encoder, batch_size=8, prepare_processes=PROCESSES)
    write_clip_embeddings("00000", layout, encoder, batch_size=4, prepare_processes=PROCESSES)
    assert prepare_pool.worker_pids() == pids


def _wait_until(cond, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_killed_worker_fails_the_shard_clearly(tmp_path, encoder, monkeypatch):
    rng = random.Random(11)
    samples = [{"__key__": compute_key(i, 0, OOM), "jpg": _jpg(rng), "txt": b"c", "json": b"{}"} for i in range(60)]
    (tmp_path / "images").mkdir()
    _write_tar(tmp_path / "images" / "00000.tar", samples)
    layout = Layout(str(tmp_path))
    write_clip_embeddings("00000", layout, encoder, batch_size=4, prepare_processes=PROCESSES)  # the pool runs
    victim = prepare_pool.worker_pids()[0]
    pool = prepare_pool._POOL[0]
    read = embeddings.iter_samples

    def killing(url):  # the parent reads the tar: a worker is killed once steps were sent to the pool
        for i, sample in enumerate(read(url)):
            if i == 20:
                os.kill(victim, signal.SIGKILL)
                # the executor notices a dead worker once no result is pending: the tar's reading pauses
                # until then, so the rest of the shard cannot outrun it
                _wait_until(lambda: pool.executor._broken)
            yield sample

    monkeypatch.setattr(embeddings, "iter_samples", killing)
    with pytest.raises(prepare_pool.PrepareWorkerError, match=r"shard 00000 .*00000\.tar.*worker process.*died"):
        write_clip_embeddings("00000", layout, encoder, batch_size=4, prepare_processes=PROCESSES)
    monkeypatch.setattr(embeddings, "iter_samples", read)
    # the next shard gets a fresh pool
    assert write_clip_embeddings("00000", layout, encoder, batch_size=4, prepare_processes=PROCESSES).samples == 60
    pids = prepare_pool.worker_pids()
    assert len(pids) == PROCESSES and victim not in pids

    # a worker that dies between shards: the next shard starts a fresh pool rather than failing
    pool = prepare_pool._POOL[0]
    os.kill(pids[1], signal.SIGKILL)
    _wait_until(lambda: not pool.healthy())  # until the kernel has the whole process down (waitable)
    assert write_clip_embeddings("00000", layout, encoder, batch_size=4, prepare_processes=PROCESSES).samples == 60
    assert not set(prepare_pool.worker_pids()) & set(pids)


def test_how_many_processes(encoder, monkeypatch):
    class Gpu:
        device, fast_preprocess = "cuda", True

    monkeypatch.delenv(prepare_pool.PROCESSES_ENV, raising=False)
    assert prepare_pool.processes_for(encoder, None) == 0  # CPU: threads, unless asked
    assert prepare_pool.processes_for(encoder, 3) == 3
    assert prepare_pool.processes_for(encoder.exact(), 3) == 0  # the per-image preprocess stays in threads
    assert prepare_pool.processes_for(Gpu(), None) == max(1, len(os.sched_getaffinity(0)) - 2)
    monkeypatch.setenv(prepare_pool.PROCESSES_ENV, "0")
    assert prepare_pool.processes_for(Gpu(), None) == 0
    monkeypatch.setenv(prepare_pool.PROCESSES_ENV, "5")
    assert prepare_pool.processes_for(Gpu(), None) == 5 and prepare_pool.processes_for(Gpu(), 1) == 1
    for bad in ("-1", "many"):
        monkeypatch.setenv(prepare_pool.PROCESSES_ENV, bad)
        with pytest.raises(ValueError, match=prepare_pool.PROCESSES_ENV):
            prepare_pool.processes_for(Gpu(), None)
    with pytest.raises(ValueError, match="prepare_processes"):
        prepare_pool.processes_for(encoder, -2)


def test_all_clip_tokenizers_travel(encoder):
    """all_clip's openai/hf_clip tokenizer is a local closure: sent as the clip.tokenize call it makes."""
    assert encoder.tokenizer.__qualname__ == "load_hf_clip.<locals>.tokenizer"
    with pytest.raises(Exception):
        pickle.dumps(encoder.tokenizer)
    portable = pickle.loads(pickle.dumps(prepare_pool.portable_tokenizer(encoder.tokenizer)))
    texts = ["a photo", "ünïcode  caption", "word " * 200]  # the last one is truncated to 77 tokens
    assert all((portable([t]) == encoder.tokenizer([t])).all() for t in texts)


def test_no_room_in_dev_shm_prepares_in_threads(tmp_path, encoder, monkeypatch, caplog):
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare_pool.os, "posix_fallocate", full)
    make_shards(tmp_path)
    # a step size no earlier test used, so the pool needs new buffers
    report = write_clip_embeddings("00000", Layout(str(tmp_path)), encoder, batch_size=5, prepare_processes=PROCESSES)
    assert report.samples == 9 and "no room for two shared buffers of 5 images" in caplog.text
