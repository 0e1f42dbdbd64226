"""Per-core limits: each engine's work through the tightest single-thread loop (issue 22, item 2).

The same inputs as the engine's pair, read into memory before the clock starts; no network, no
threads, no output tars or parquet, no start-up. One such loop per process on ``processes`` cores at
once (as the engines use the cores), each timed by its own CPU clock; the limit is items per
CPU-second over the loops. An engine's rate per CPU-second against this is the share of the work's
own cost that it spends on the work: what is left is its I/O, threads, bookkeeping and start-up.

Where the work is one library chain with nothing to choose (CLIP: decode, resize, crop, normalise,
tokenise, the model; video: PyAV decode and x264 encode per clip) the loop calls the engine's own
per-item functions on in-memory inputs; the image loop is written apart (simplejpeg + OpenCV, the
fastest libraries measured for that work, and the engine's PNG decoder), as is the index loop (an mmap
header walk, SQLite rows).
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor


def _parts(part, shares: list, processes: int) -> list:
    """``part(share)`` for each share, ``processes`` at once."""
    with ProcessPoolExecutor(processes) as pool:  # fork: the caller has imported nothing heavy
        return list(pool.map(part, shares))


def _in_processes(part, shares: list, processes: int) -> tuple[int, float]:
    """``part(share)`` -> (items, loop CPU seconds) for each share, ``processes`` at once; summed."""
    done = _parts(part, shares, processes)
    return sum(n for n, _ in done), sum(c for _, c in done)


def _timed(s: dict, items: int, cpu: float, t0: float) -> dict:
    return {"items": items, "loop_cpu_seconds": cpu, "work_seconds": time.perf_counter() - t0,
            "per_cpu_second": items / cpu if cpu else float("nan"), "processes": s.get("processes", 1)}


def _tar_samples(path: str) -> list[dict]:
    """The samples of a webdataset tar with a ``jpg`` (``{"__key__", ext: bytes}``), read before the clock."""
    from shardprep.tars import iter_samples

    return [s for s in iter_samples(path) if "jpg" in s]


# ------------------------------------------------------------------------------ download + resize


def _images_part(args) -> tuple[int, float, float]:
    """One core's share of the image limit: (images, CPU seconds of the loop alone, CPU seconds of a second
    loop over the same bytes doing only what the rows' other columns need: sha256 and EXIF)."""
    files, image_size, resize_mode, quality = args
    import cv2
    import numpy as np
    import simplejpeg

    from shardprep import allocator
    from shardprep.images import resize as R
    from shardprep.images.png import decode_png
    from shardprep.images.shards import _exif_json

    assert resize_mode == "border", "the limit loop does the bench's resize_mode (border) only"
    cv2.setNumThreads(1)
    allocator.keep_freed_memory()  # as the engine does
    cache: dict[str, bytes] = {}
    datas = []
    for f in files:  # read before the clock starts: no I/O in the loop
        if f not in cache:
            with open(f, "rb") as fh:
                cache[f] = fh.read()
        datas.append(cache[f])
    lanczos, params = cv2.INTER_LANCZOS4, [cv2.IMWRITE_JPEG_QUALITY, quality]
    R._antialiased(np.zeros((4, 4, 3), np.uint8), 2, 2)  # its first call outside the clock
    c0 = time.process_time()
    for data in datas:
        if data[:2] == b"\xff\xd8":  # JPEG: libjpeg-turbo DCT-scaled decode, the engine's reduction rule
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            grey = colorspace == "Gray"
            r, _ = R._plan_reduction((w, h), "JPEG", "L" if grey else "RGB", resize_mode, image_size)
            img = simplejpeg.decode_jpeg(data, "GRAY" if grey else "BGR", min_height=-(-h // r),
                                         min_width=-(-w // r), min_factor=r)
        else:  # PNG with alpha: the engine's PNG decode (OpenCV's for what it does not take), composite on white
            img = decode_png(data)
            if img is None:
                img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
            h, w = img.shape[:2]
            if img.ndim == 3 and img.shape[2] == 4:
                img = R._composite_on_white(img)
        scale = image_size / max(h, w)
        nh, nw = R._target(h, w, scale)
        # the engine's fast_decode downscale (antialiased bilinear), lanczos up as img2dataset
        img = R._antialiased(img, nw, nh) if scale < 1 else cv2.resize(img, (nw, nh), interpolation=lanczos)
        img = R._pad_white(img, image_size)
        cv2.imencode(".jpg", img, params)
    pixels = time.process_time() - c0
    if datas:
        _exif_json(datas[0])  # exifread's import, outside the clock
    c0 = time.process_time()
    for data in datas:  # the parquet's sha256 and exif columns (img2dataset's defaults compute both)
        hashlib.sha256(data).hexdigest()
        _exif_json(data)
    return len(datas), pixels, time.process_time() - c0


def images_limit(s: dict) -> dict:
    """The same input images (the rows that name one of the site's images, in row order) through
    DCT-scaled decode as the engine plans it, the engine's antialiased downscale (lanczos up) to
    img2dataset's size, white border,
    JPEG encode at the same quality; no EXIF or hash. Then, timed apart and reported beside the limit (not
    in it), a second loop over the same bytes: the sha256 and EXIF that the rows' parquet columns carry."""
    import pyarrow.parquet as pq

    urls = pq.read_table(s["parquet"], columns=["url"]).column("url").to_pylist()
    prefix = s["base_url"] + "/images/"
    files = [os.path.join(s["site_dir"], "images", u[len(prefix):]) for u in urls if u.startswith(prefix)]
    p = s["processes"]
    t0 = time.perf_counter()
    done = _parts(_images_part, [(files[i::p], s["image_size"], s["resize_mode"], s["encode_quality"])
                                 for i in range(p)], p)
    items, cpu, row_cpu = (sum(x[i] for x in done) for i in range(3))
    # the limit is the pixels' loop alone; with the hash and EXIF is information beside it (bench/IMAGES.md)
    return {**_timed(s, items, cpu, t0), "images": items, "hash_exif_cpu_seconds": row_cpu,
            "with_hash_exif_per_cpu_second": items / (cpu + row_cpu) if cpu + row_cpu else float("nan")}


# ------------------------------------------------------------------------------ CLIP embeddings


def _clip_part(args) -> tuple[int, float]:
    tars, model, batch_size = args
    import numpy as np
    import torch

    from shardprep.models.clip import load_clip_encoder

    torch.set_num_threads(1)
    encoder = load_clip_encoder(model, device="cpu")
    samples = [s for t in tars for s in _tar_samples(t)]
    buffer = encoder.new_image_buffer(batch_size)
    c0 = time.process_time()
    for i in range(0, len(samples), batch_size):
        batch = samples[i:i + batch_size]
        for slot, sample in enumerate(batch):  # decode, resize, crop, normalise into the batch
            encoder.prepare_image(sample["jpg"], out=buffer[slot])
        tokens = encoder.tokenizer([s.get("txt", b"").decode() for s in batch])
        img, txt = encoder.encode_step(buffer[:len(batch)], tokens)
        np.asarray(img), np.asarray(txt)
    return len(samples), time.process_time() - c0


def clip_limit(s: dict) -> dict:
    """The pair's tars' samples: decode, resize, centre crop and normalise into a batch (the reference
    preprocess's pixels), tokenise the captions, image and text towers, L2 norm, float16: one torch
    thread, batches of ``batch_size``."""
    tars = [os.path.join(s["root"], "images", f"{name}.tar") for name in s["shards"]]
    p = s["processes"]
    t0 = time.perf_counter()
    items, cpu = _in_processes(_clip_part, [(tars[i::p], s["model"], s["batch_size"]) for i in range(p)], p)
    return _timed(s, items, cpu, t0)


# ------------------------------------------------------------------------------ decoder dataloader


def _loader_part(args) -> tuple[int, float]:
    tars, img_emb, text_emb, index_width, batch_size = args
    import io

    import numpy as np
    import torch
    import torchvision.transforms as T
    from PIL import Image

    torch.set_num_threads(1)
    to_tensor = T.ToTensor()
    cache: dict[str, list] = {}
    work = []
    for tar in tars:  # the tars and their embedding files in memory; a repeated tar is read once
        if tar not in cache:
            shard = os.path.basename(tar)[:-4]
            img = np.load(os.path.join(img_emb, f"img_emb_{shard}.npy"))
            txt = np.load(os.path.join(text_emb, f"text_emb_{shard}.npy"))
            cache[tar] = [(s, img, txt) for s in _tar_samples(tar)]
        work.extend(cache[tar])
    c0 = time.process_time()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        images, img_rows, txt_rows, captions = [], [], [], []
        for sample, img, txt in batch:  # what a training step receives: pixels, both embeddings, caption
            with Image.open(io.BytesIO(sample["jpg"])) as im:
                images.append(to_tensor(im.convert("RGB")))
            row = int(sample["__key__"][-index_width:])
            img_rows.append(img[row])
            txt_rows.append(txt[row])
            captions.append(sample["txt"].decode())
        torch.stack(images), torch.from_numpy(np.stack(img_rows)), torch.from_numpy(np.stack(txt_rows))
    return len(work), time.process_time() - c0


def loader_limit(s: dict) -> dict:
    """One epoch's samples (the listed tars, repeats included): PIL decode, ``ToTensor``, the embedding
    rows by key, the caption, collated into batches; one thread, data in memory, no worker processes."""
    p = s["workers"]
    tars = s["tars"]
    t0 = time.perf_counter()
    items, cpu = _in_processes(_loader_part, [(tars[i::p], s["img_emb"], s["text_emb"], s["index_width"],
                                                s["batch_size"]) for i in range(p)], p)
    return _timed(s | {"processes": p}, items, cpu, t0)


# ------------------------------------------------------------------------------ energon index


def _walk_headers(data: bytes) -> tuple[list[int], list[str], list[tuple], int]:
    """(sample offsets, keys, parts, end) of a plain ustar webdataset tar in memory, each header's
    checksum verified (as tarfile, so energon, does; the exact sum of an ASCII block through Adler-32)."""
    offsets: list[int] = []
    keys: list[str] = []
    parts: list[tuple] = []
    pos, n, last = 0, len(data), None
    while pos + 512 <= n:
        header = data[pos:pos + 512]
        if header[0] == 0:  # end-of-archive block
            break
        stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
        if not header.isascii() or (zlib.adler32(header) & 0xFFFF) - 1 - sum(header[148:156]) + 256 != stored:
            raise ValueError(f"bad header checksum at {pos}")
        name = header[:100].split(b"\0", 1)[0].decode()
        size = int(header[124:136].split(b"\0", 1)[0] or b"0", 8)
        key, _, ext = name.partition(".")
        if key != last:
            offsets.append(pos)
            keys.append(key)
            last = key
        parts.append((len(keys) - 1, ext, pos + 512, size))
        pos += 512 + (size + 511) // 512 * 512
    return offsets, keys, parts, pos


def index_limit(s: dict) -> dict:
    """The same tars: every header walked and its checksum verified, samples grouped by key, the offsets
    written as ``.tar.idx`` and the sample and part rows inserted into energon's SQLite schema, one
    transaction; one thread in one process, as our index runs."""
    import shutil
    import sqlite3
    import struct
    import tempfile

    from shardprep.energon.sqlite_index import create_indexes, create_schema

    out = tempfile.mkdtemp(prefix="index-limit-", dir=s.get("tmp"))
    try:
        db = sqlite3.connect(os.path.join(out, "index.sqlite"))
        create_schema(db)
        t0 = time.perf_counter()
        c0 = time.process_time()
        samples = 0
        for tar_id, name in enumerate(s["tars"]):
            with open(os.path.join(s["src"], name), "rb") as f:
                offsets, keys, parts, end = _walk_headers(f.read())  # small members: one read beats a seek each
            offsets.append(end)
            with open(os.path.join(out, name + ".idx"), "wb") as f:
                f.write(struct.pack(f"{len(offsets)}Q", *offsets))
            db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?)",
                           [(tar_id, k, i, offsets[i], offsets[i + 1] - offsets[i]) for i, k in enumerate(keys)])
            db.executemany("INSERT INTO sample_parts VALUES (?, ?, ?, ?, ?)", [(tar_id, *p) for p in parts])
            samples += len(keys)
        create_indexes(db)
        db.commit()
        db.close()
        cpu = time.process_time() - c0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return _timed(s | {"processes": 1}, samples, cpu, t0)


# ------------------------------------------------------------------------------ video shards


def _video_part(args) -> tuple[int, float]:
    files, spans, clip_length, preset, crf = args
    from shardprep.video.clips import VideoSpec, transcode

    spec = VideoSpec(clip_length=clip_length, preset=preset, crf=crf, threads=1)
    datas = []
    for f in files:
        with open(f, "rb") as fh:
            datas.append(fh.read())
    clips = 0
    c0 = time.process_time()
    for data, span in zip(datas, spans):
        clips += len(transcode(data, spec, span).clips)
    return clips, time.process_time() - c0


def video_limit(s: dict) -> dict:
    """The served videos (the rows' files, in row order; dead URLs have none): PyAV decode and x264
    encode of every clip at the pair's preset and CRF, FFmpeg on one thread; no download, no tar."""
    import pyarrow.parquet as pq

    rows = pq.read_table(s["parquet"], columns=["contentUrl", "clips"]).to_pylist()
    prefix = s["base_url"] + "/"
    found = [(os.path.join(s["site_dir"], r["contentUrl"][len(prefix):]), r["clips"]) for r in rows
             if r["contentUrl"].startswith(prefix)
             and os.path.exists(os.path.join(s["site_dir"], r["contentUrl"][len(prefix):]))]
    p = s["processes"]
    shares = [([f for f, _ in found[i::p]], [[tuple(x) for x in c] for _, c in found[i::p]], s["clip_length"],
               s["preset"], s["crf"]) for i in range(p)]
    t0 = time.perf_counter()
    items, cpu = _in_processes(_video_part, shares, p)
    return _timed(s, items, cpu, t0)
