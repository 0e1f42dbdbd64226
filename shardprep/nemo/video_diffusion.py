"""NeMo diffusion (DiT) samples of one video shard, beside the image shards' in one energon dataset.

A video2dataset-layout tar (``video_shards``: ``{key}.mp4``/``.webm``, ``.json``, ``.txt`` per clip) ->
a diffusion tar with, per clip (members with NeMo's double dot, as ``shardprep.nemo.diffusion`` writes them):

* ``{key}..pth``: ``torch.save`` of the bfloat16 latent ``[C, T', h, w]`` of a causal video autoencoder
  (``shardprep.models.video_autoencoders``), T' = 1 + (T - 1) / tc for the T frames fed to it;
* ``{key}..pickle``: the numpy float16 T5 states ``[L, d]``, unpadded, as for images;
* ``{key}..json``: what ``BasicDiffusionTaskEncoder``'s video branch reads (``height``, ``width``,
  ``framerate``, ``num_frames`` of the frames fed; ``aesthetic_score``, which it reads for every
  sample), plus ``caption``, ``source_key``, ``aspect_ratio`` (of the clip before the crop) and
  ``duration``; a 1-frame clip (T' = 1) also gets ``image_height``/``image_width``, which the image
  branch reads.

The frames fed: the clip's first ``max_frames`` at most, cut to ``1 + k * tc``; resized (bicubic, while
decoding) so the shorter side is ``resolution``, then center-cropped so both sides are multiples of the
autoencoder's ``side_multiple()`` (its spatial compression times DiT's 2x2 patches). A clip without a
video member or caption, an undecodable one, or one whose latent NeMo would skip is a recorded failure.
No sample, no tar (a stale one is removed); the tar is written atomically.
"""

from __future__ import annotations

import io
import json
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shardprep.encode import encode_tar, finish, input_missing, positive_int
from shardprep.models.video_autoencoders import frames_to_use
from shardprep.nemo.diffusion import aesthetic_score, latent_problem, parse_sample, pth_bytes
from shardprep.tars import TarWriter

if TYPE_CHECKING:
    from shardprep.models.nemo import T5TextEncoder
    from shardprep.models.video_autoencoders import VideoAutoencoder

VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")
_DECODE_THREADS = 2


@dataclass
class VideoDiffusionReport:
    input_samples: int = 0
    samples: int = 0  # written
    failures: list[dict] = field(default_factory=list)  # {"key", "reason"} per clip not written
    latent_shapes: list[list[int]] = field(default_factory=list)  # distinct [C, T', h, w]
    frames: int = 0  # frames encoded, all clips
    text_dim: int | None = None
    tar_written: bool = False
    tar_bytes: int = 0
    seconds: float = 0.0


def crop_size(width: int, height: int, resolution: int, multiple: int) -> tuple[int, int, int, int]:
    """(resized width, resized height, cropped width, cropped height): the shorter side ``resolution``,
    then each side cut down to a multiple of ``multiple`` (never below one)."""
    scale = resolution / min(width, height)
    rw, rh = max(1, round(width * scale)), max(1, round(height * scale))
    return rw, rh, max(multiple, rw // multiple * multiple), max(multiple, rh // multiple * multiple)


def decode_clip(data: bytes, max_frames: int, temporal: int, resolution: int, multiple: int):
    """Encoded clip bytes -> (float32 ``[3, T, H, W]`` in [-1, 1], frames per second, source width,
    source height). T = ``frames_to_use``; frames are scaled by FFmpeg while decoding (a clip never sits
    in memory at its source size) and center-cropped."""
    import av
    import torch

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate) if stream.average_rate else 0.0
        width, height = stream.codec_context.width, stream.codec_context.height
        rw, rh, cw, ch = crop_size(width, height, resolution, multiple)
        frames = []
        for frame in container.decode(stream):
            frames.append(frame.reformat(width=rw, height=rh, format="rgb24", interpolation="BICUBIC").to_ndarray())
            if len(frames) >= max_frames:
                break
    n = frames_to_use(len(frames), max_frames, temporal)
    if n == 0:
        raise ValueError("no decodable frame")
    x0, y0 = (rw - cw) // 2, (rh - ch) // 2
    video = np.stack(frames[:n])[:, y0:y0 + ch, x0:x0 + cw]  # T, H, W, 3 uint8
    clip = torch.from_numpy(video).permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)
    return clip, rate, width, height


def _prepare(sample: dict, url: str, max_frames: int, temporal: int, resolution: int, multiple: int) -> dict:
    """Decode one clip (worker thread); a bad clip becomes a failure record."""
    key, parsed = sample["__key__"], parse_sample(sample, url, VIDEO_EXTS, "video")
    if isinstance(parsed, dict):
        return parsed
    ext, caption, meta = parsed
    try:
        clip, rate, width, height = decode_clip(sample[ext], max_frames, temporal, resolution, multiple)
    except Exception as e:  # noqa: BLE001 - a bad clip is a recorded failure, never a crash
        return {"key": key, "reason": f"video decode failed: {type(e).__name__}: {e}"}
    rate = rate or float(meta.get("framerate") or 0.0)
    return {"key": key, "clip": clip, "caption": caption, "meta": meta, "rate": rate,
            "aspect_ratio": round(width / height, 6) if height else None}


def _json(item: dict, lat_frames: int) -> dict:
    t, h, w = item["fed"]
    rate = round(item["rate"], 6)
    meta = {"caption": item["caption"], "source_key": item["key"], "height": h, "width": w, "framerate": rate,
            "num_frames": t, "duration": round(t / rate, 6) if rate else None,
            "aspect_ratio": item["aspect_ratio"], "aesthetic_score": aesthetic_score(item["meta"])}
    if lat_frames == 1:  # NeMo's image branch reads these for a T' = 1 latent
        meta.update(image_height=h, image_width=w)
    return meta


def write_video_diffusion_samples(in_url: str, out_url: str, t5: "T5TextEncoder", vae: "VideoAutoencoder", *,
                                  resolution: int = 256, max_frames: int = 33,
                                  batch_size: int = 16) -> VideoDiffusionReport:
    """Encode every clip of the video shard tar ``in_url`` into the diffusion tar ``out_url``.

    ``resolution`` must be a multiple of 16. A missing input tar, or no clip surviving, leaves no output
    tar (a stale one is removed). Clips are encoded one at a time (their shapes differ), captions in
    batches of ``batch_size``."""
    import torch

    positive_int("video diffusion: resolution", resolution, multiple=16)
    positive_int("video diffusion: max_frames", max_frames)
    positive_int("video diffusion: batch_size", batch_size)
    start = time.perf_counter()
    report = VideoDiffusionReport()
    if input_missing(in_url, out_url):
        return finish(report, start)
    temporal, multiple = vae.compression.temporal, vae.side_multiple()
    shapes: set[tuple[int, ...]] = set()

    def prepare(sample: dict) -> dict:
        return _prepare(sample, in_url, max_frames, temporal, resolution, multiple)

    def encode_clip(item: dict) -> dict:
        try:
            lat = vae.encode(item["clip"]).to(torch.bfloat16)
        except ValueError as e:  # a shape the autoencoder refused: this clip only
            return {"key": item["key"], "reason": f"autoencoder: {e}"}
        problem = latent_problem(lat)
        if problem is not None:
            return {"key": item["key"], "reason": problem}
        # the frames are not kept while captions wait for a full T5 batch: only their shape
        item["latent"], item["fed"] = lat, tuple(int(d) for d in item.pop("clip").shape[1:])
        return item

    def encode(ready: list[dict], out: TarWriter) -> None:
        texts = t5.encode([it["caption"] for it in ready])
        for it, txt in zip(ready, texts):
            if not np.isfinite(txt).all():
                report.failures.append({"key": it["key"], "reason": "T5 text states have NaN/Inf values"})
                continue
            lat = it["latent"]
            out.add(it["key"], {".json": json.dumps(_json(it, int(lat.shape[1]))), ".pickle": pickle.dumps(txt),
                                ".pth": pth_bytes(lat)})
            report.frames += it["fed"][0]
            shapes.add(tuple(lat.shape))
            report.text_dim = int(txt.shape[1])

    # upcoming clips decode in threads while the autoencoder encodes the current one (as it arrives:
    # clips have different shapes), captions in batches
    done = encode_tar(in_url, out_url, prepare, encode, batch_size=batch_size, threads=_DECODE_THREADS,
                      in_flight=4, failures=report.failures, encode_each=encode_clip)
    report.input_samples, report.samples = done.read, done.written
    report.tar_written, report.tar_bytes = done.written > 0, done.tar_bytes
    report.latent_shapes = [list(s) for s in sorted(shapes)]
    return finish(report, start)
