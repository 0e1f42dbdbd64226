"""The video benchmark's source: H.264 mp4 files with real motion (a textured scene panning and a
moving bright object over it, so the encoder has work to do, unlike flat test patterns), a couple of
them with AAC audio, served over HTTP; and a WebVid-style parquet naming them (plus two dead URLs)."""

from __future__ import annotations

import json
import os

import numpy as np


def _texture(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A smooth random RGB scene twice as wide as the frame (it pans across it)."""
    coarse = rng.integers(0, 256, size=(height // 8 + 2, width // 4 + 2, 3)).astype(np.float32)
    rows = np.linspace(0, coarse.shape[0] - 1.001, height)
    cols = np.linspace(0, coarse.shape[1] - 1.001, 2 * width)
    r0, c0 = rows.astype(int), cols.astype(int)
    fr, fc = (rows - r0)[:, None, None], (cols - c0)[None, :, None]
    a, b = coarse[r0][:, c0], coarse[r0][:, c0 + 1]
    c, d = coarse[r0 + 1][:, c0], coarse[r0 + 1][:, c0 + 1]
    smooth = (a * (1 - fc) + b * fc) * (1 - fr) + (c * (1 - fc) + d * fc) * fr
    return np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)


def _video(path: str, width: int, height: int, seconds: float, rate: int, audio: bool, seed: int) -> None:
    import av

    rng = np.random.default_rng(seed)
    scene = _texture(width, height, rng)
    n = int(seconds * rate)
    with av.open(path, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23", "g": str(2 * rate)}
        sound = out.add_stream("aac", rate=48000) if audio else None
        for i in range(n):
            x = int((width - 1) * i / max(1, n - 1))
            frame = scene[:, x:x + width].copy()
            cy, cx = int(height * (0.3 + 0.4 * np.sin(i / 9))), int(width * i / n)
            frame[max(0, cy - 12):cy + 12, max(0, cx - 12):cx + 12] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
        if sound is not None:
            from tests.fixtures.videos import _silence

            _silence(out, sound, seconds)


def make_video_site(directory: str, n_videos: int, seconds: float, width: int = 640, height: int = 360,
                    rate: int = 24) -> list[str]:
    """Write (once: the folder's manifest says with which parameters) ``n_videos`` mp4 files; returns
    their names."""
    params = {"n": n_videos, "seconds": seconds, "width": width, "height": height, "rate": rate, "version": 1}
    manifest = os.path.join(directory, "manifest.json")
    names = [f"video-{i:04d}.mp4" for i in range(n_videos)]
    if os.path.exists(manifest):
        with open(manifest) as f:
            if json.load(f) == params:
                return names
    os.makedirs(directory, exist_ok=True)
    for i, name in enumerate(names):
        _video(os.path.join(directory, name), width, height, seconds, rate, audio=i % 10 == 0, seed=i)
    with open(manifest, "w") as f:
        json.dump(params, f)
    return names


def make_video_parquet(path: str, base_url: str, names: list[str], seconds: float) -> int:
    """WebVid-style rows (``contentUrl``, ``name``, ``videoid``, ``clips`` = the whole video as one span),
    the videos plus two URLs that answer 404; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    urls = [f"{base_url.rstrip('/')}/{n}" for n in names] + [f"{base_url.rstrip('/')}/gone-{i}.mp4" for i in range(2)]
    pq.write_table(pa.table({
        "contentUrl": urls,
        "name": [f"a panning shot number {i}" for i in range(len(urls))],
        "videoid": list(range(len(urls))),
        "clips": [[[0.0, float(seconds)]] for _ in urls],
    }), path)
    return len(urls)
