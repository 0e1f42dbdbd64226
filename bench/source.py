"""A realistic download source for the benchmarks, cached under ``bench/work/``.

Images: photo-like JPEGs (``tests.fixtures.synthetic.render_image``: gradient, soft shapes, sensor-like
noise, so they compress like photos, not like flat test cards) whose long side is log-uniform in
200–2,500 px (median ≈ 700 px, like web photos), common aspect ratios, JPEG quality 75–95, a third
with an EXIF block, a few greyscale, and every 7th a PNG with an alpha channel (long side ≤ 900).
Rows cycle over the unique images; about 5 % of rows are broken (404, not an image, truncated).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

ASPECTS = (4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4, 2 / 3)
BROKEN = ("missing", "not_image", "truncated")


def _spec(i: int, seed: int) -> dict:
    rng = np.random.default_rng(seed * 100_003 + i)
    png = i % 7 == 3
    long_side = math.exp(rng.uniform(math.log(200), math.log(900 if png else 2500)))
    aspect = ASPECTS[int(rng.integers(len(ASPECTS)))]
    w, h = (long_side, long_side / aspect) if aspect >= 1 else (long_side * aspect, long_side)
    kind = "png" if png else ("grey" if i % 31 == 11 else "jpg")
    return {"i": i, "w": max(16, int(w)), "h": max(16, int(h)), "kind": kind,
            "quality": int(rng.integers(75, 96)), "exif": (not png) and i % 3 == 0}


def image_name(spec: dict) -> str:
    return f"images/{spec['i']:06d}.{'png' if spec['kind'] == 'png' else 'jpg'}"


def _render(args) -> int:
    directory, spec, seed = args
    from PIL import Image

    from tests.fixtures.synthetic import _with_alpha, render_image

    img = render_image(seed * 1_000_003 + spec["i"], spec["w"], spec["h"])
    path = os.path.join(directory, image_name(spec))
    if spec["kind"] == "png":
        _with_alpha(img).save(path, "PNG", compress_level=6)
    else:
        if spec["kind"] == "grey":
            img = img.convert("L")
        kw = {}
        if spec["exif"]:
            exif = Image.Exif()
            exif.update({0x010F: "BenchCam", 0x0110: "Model 7", 0x0132: "2024:05:01 12:00:00",
                         0x0112: 1, 0x011A: 72.0, 0x011B: 72.0, 0x0131: "shardprep-bench"})
            kw["exif"] = exif.tobytes()
        img.save(path, "JPEG", quality=spec["quality"], **kw)
    return os.path.getsize(path)


def make_site(directory: str, n_unique: int, seed: int = 0, workers: int = 2) -> dict:
    """Render the images (once: a stamp records what the folder holds); returns a summary."""
    stamp = os.path.join(directory, "site.json")
    params = {"n_unique": n_unique, "seed": seed, "version": 2}
    if os.path.exists(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info.get("params") == params:
            return info
    from tests.fixtures.synthetic import write_broken_files

    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    specs = [_spec(i, seed) for i in range(n_unique)]
    t0 = time.time()
    with ProcessPoolExecutor(workers) as pool:
        sizes = list(pool.map(_render, [(directory, s, seed) for s in specs], chunksize=4))
    write_broken_files(directory, seed=seed)
    px = [s["w"] * s["h"] for s in specs]
    info = {"params": params, "specs": specs, "bytes": int(sum(sizes)), "seconds": time.time() - t0,
            "median_long_side": float(np.median([max(s["w"], s["h"]) for s in specs])),
            "mean_megapixels": float(np.mean(px)) / 1e6,
            "png": sum(s["kind"] == "png" for s in specs), "grey": sum(s["kind"] == "grey" for s in specs),
            "exif": sum(s["exif"] for s in specs)}
    with open(stamp, "w") as f:
        json.dump(info, f)
    return info


def make_url_parquet(path: str, base_url: str, site: dict, n_rows: int, broken_share: float = 0.05,
                     seed: int = 0) -> dict:
    """``url``, ``caption``, ``source_id`` rows cycling over the site's images, some broken."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.fixtures.synthetic import NOT_AN_IMAGE, TRUNCATED

    rng = np.random.default_rng(seed)
    specs = site["specs"]
    urls, caps = [], []
    broken = 0
    for r in range(n_rows):
        if rng.random() < broken_share:
            kind = BROKEN[broken % len(BROKEN)]
            broken += 1
            rel = {"missing": f"missing/{r}.jpg", "not_image": NOT_AN_IMAGE, "truncated": TRUNCATED}[kind]
        else:
            rel = image_name(specs[r % len(specs)])
        urls.append(f"{base_url}/{rel}")
        caps.append(f"a photo number {r} of a scene with {r % 17} things" if r % 23 != 5 else None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"url": pa.array(urls, pa.string()), "caption": pa.array(caps, pa.string()),
                             "source_id": pa.array(range(n_rows), pa.int64())}), path)
    return {"rows": n_rows, "broken": broken}


class Server:
    """``tests.fixtures.http_server.serve_directory`` in its own process (its CPU is not the harness's GIL).
    ``command``: another server of ``directory`` (appended to it) that prints its base URL and leaves when
    its stdin ends (``bench/experiments/static_server.js``)."""

    def __init__(self, directory: str, command: list[str] | None = None):
        code = ("import sys, time\nfrom tests.fixtures.http_server import serve_directory\n"
                "url, stop = serve_directory(sys.argv[1])\nprint(url, flush=True)\n"
                "sys.stdin.read()\nstop()\n")
        self.proc = subprocess.Popen([*(command or [sys.executable, "-c", code]), directory], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise RuntimeError(f"bench HTTP server did not start (got {self.url!r})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_index_tars(directory: str, n_shards: int, samples_per_shard: int, seed: int = 0) -> list[str]:
    """``n_shards`` img2dataset-layout tars (``{key}.jpg/.json/.txt``, unique keys) for the index
    benchmark; the payloads are random bytes of JPEG-like sizes (indexing reads headers only).
    Written once; returns the tar names."""
    import io
    import tarfile

    from shardprep.keys import compute_key, oom_sample_per_shard

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    oom = oom_sample_per_shard(samples_per_shard)
    names = []
    for shard in range(n_shards):
        name = f"{shard:05d}.tar"
        names.append(name)
        path = os.path.join(directory, name)
        if os.path.exists(path):
            continue
        tmp = path + ".tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(samples_per_shard):
                key = compute_key(i, shard, oom, 5)
                members = {"jpg": rng.bytes(int(rng.integers(2_000, 6_000))),
                           "json": json.dumps({"key": key, "status": "success"}).encode(),
                           "txt": f"caption {key}".encode()}
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mode, info.mtime = len(data), 0o444, 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    return names
