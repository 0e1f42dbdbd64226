"""Synthetic images, broken files, a local HTTP server and URL parquets, for the demo, tests and benchmarks.

Everything is deterministic for a given seed. ``serve_directory`` serves a folder on 127.0.0.1 with
a few extra endpoints that real sites have too: slow responses, redirects, slowly dripped bodies
and an ``X-Robots-Tag: noai`` header.
"""

from __future__ import annotations

import http.server
import io
import os
import struct
import threading
import zlib
from functools import partial
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFilter

DEFAULT_SIZES = ((320, 240), (256, 256), (640, 480), (200, 300), (500, 200), (128, 96))
IMAGES_DIR = "images"
# broken files, relative to the served folder
TRUNCATED = "broken/truncated.jpg"
NOT_AN_IMAGE = "broken/not_an_image.jpg"
BOMB = "broken/bomb.png"
BROKEN_KINDS = ("missing", "not_image", "truncated")  # what make_source_parquets mixes in by default


def image_name(i: int) -> str:
    """File name of synthetic image ``i``: every 7th is a PNG with alpha, the others JPEG."""
    return f"{IMAGES_DIR}/{i:06d}.png" if i % 7 == 3 else f"{IMAGES_DIR}/{i:06d}.jpg"


def render_image(i: int, width: int, height: int) -> Image.Image:
    """A deterministic, photo-like RGB image: sky/ground gradient, soft shapes, fine noise."""
    rng = np.random.default_rng(i)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    top, bottom = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    tilt = rng.uniform(-0.3, 0.3)
    t = np.clip(y + tilt * (x - 0.5), 0, 1)
    arr = (1 - t) * top + t * bottom + np.zeros((height, width, 3), np.float32)
    img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(0.05, 0.35) * width, rng.uniform(0.05, 0.35) * height
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        box = [cx - rx, cy - ry, cx + rx, cy + ry]
        if rng.random() < 0.6:
            draw.ellipse(box, fill=color)
        else:
            draw.rectangle(box, fill=color)
    img = img.filter(ImageFilter.GaussianBlur(radius=max(1.0, min(width, height) / 150)))
    noise = rng.standard_normal((height, width, 3), dtype=np.float32)
    noise *= 6
    noise += np.asarray(img, np.float32)
    return Image.fromarray(np.clip(noise, 0, 255, out=noise).astype(np.uint8))


def _with_alpha(img: Image.Image) -> Image.Image:
    # a radial alpha: opaque centre, transparent corners (exercises compositing on white)
    w, h = img.size
    yy, xx = np.mgrid[0:h, 0:w]
    d = np.hypot((xx - w / 2) / (w / 2), (yy - h / 2) / (h / 2))
    alpha = (255 * np.clip(1.2 - d, 0, 1)).astype(np.uint8)
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


def write_image_files(directory: str, n: int, sizes=DEFAULT_SIZES, seed: int = 0) -> list[str]:
    """Write ``n`` images under ``directory`` (names from ``image_name``); returns the relative names."""
    names = []
    for i in range(n):
        name = image_name(i)
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        w, h = sizes[(i + seed) % len(sizes)]
        img = render_image(seed * 1_000_003 + i, w, h)
        if name.endswith(".png"):
            _with_alpha(img).save(path, "PNG")
        else:
            img.save(path, "JPEG", quality=90)
        names.append(name)
    return names


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def bomb_png(width: int = 50_000, height: int = 50_000) -> bytes:
    """A tiny PNG whose header claims ``width x height`` pixels (a decompression bomb by its header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    idat = zlib.compress(b"\x00" * 1024)  # far too little data; never meant to be decoded
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def write_broken_files(directory: str, seed: int = 0) -> dict[str, str]:
    """Write the broken files; returns ``{kind: relative name}`` (``missing`` names no file: a 404)."""
    os.makedirs(os.path.join(directory, "broken"), exist_ok=True)
    buf = io.BytesIO()
    render_image(seed + 999_999, 320, 240).save(buf, "JPEG", quality=90)
    whole = buf.getvalue()
    with open(os.path.join(directory, TRUNCATED), "wb") as f:
        f.write(whole[: len(whole) * 2 // 3])  # a download cut short
    with open(os.path.join(directory, NOT_AN_IMAGE), "wb") as f:
        f.write(b"<html><body>this is not an image</body></html>\n")
    with open(os.path.join(directory, BOMB), "wb") as f:
        f.write(bomb_png())
    return {"missing": "missing/does_not_exist.jpg", "not_image": NOT_AN_IMAGE, "truncated": TRUNCATED, "bomb": BOMB}


def make_demo_site(directory: str, n_images: int = 120, seed: int = 0, sizes=DEFAULT_SIZES) -> list[str]:
    """Images plus broken files in one folder, ready for ``serve_directory``; returns the image names."""
    names = write_image_files(directory, n_images, sizes=sizes, seed=seed)
    write_broken_files(directory, seed=seed)
    return names


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files plus test endpoints:

    ``/slow/<path>``      waits ``slow_seconds`` before answering (longer than a test's timeout);
    ``/drip/<path>``      sends the headers at once, then the body one byte every 0.2 s;
    ``/redirect?to=URL``  302 to URL;  ``/loop/<n>``  redirects to ``/loop/<n+1>`` forever;
    ``/noai/<path>``      serves the file with ``X-Robots-Tag: noai``.
    """

    protocol_version = "HTTP/1.1"  # keep-alive, as real image hosts do (clients reuse connections)
    timeout = 60  # idle kept-alive connections are closed eventually
    slow_seconds = 30.0
    stop_event: threading.Event

    def log_message(self, format, *args):  # noqa: A002 - quiet server
        pass

    def _wait(self, seconds: float) -> bool:
        return not self.stop_event.wait(seconds)  # False once the server is stopping

    def do_GET(self):  # noqa: N802 - http.server's name
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        self._extra_headers = {}  # one handler serves every request of a kept-alive connection
        try:
            if path.startswith("/slow/"):
                if self._wait(self.slow_seconds):
                    self.path = path[len("/slow"):]
                    super().do_GET()
            elif path.startswith("/drip/"):
                self._drip(path[len("/drip"):])
            elif path == "/redirect":
                self._redirect(parse_qs(parts.query).get("to", ["/"])[0])
            elif path.startswith("/loop/"):
                n = int(path.rsplit("/", 1)[-1] or 0)
                self._redirect(f"/loop/{n + 1}")
            elif path.startswith("/noai/"):
                self.path = path[len("/noai"):]
                self._extra_headers = {"X-Robots-Tag": "noai"}
                super().do_GET()
            else:
                super().do_GET()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeouts in tests do exactly that)

    def end_headers(self):
        for k, v in getattr(self, "_extra_headers", {}).items():
            self.send_header(k, v)
        super().end_headers()

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _drip(self, rel: str) -> None:
        full = os.path.join(self.directory, rel.lstrip("/"))
        if not os.path.isfile(full):
            self.send_error(404, "File not found")
            return
        with open(full, "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        for b in data:
            if not self._wait(0.2):
                return
            self.wfile.write(bytes([b]))
            self.wfile.flush()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def serve_directory(path: str, host: str = "127.0.0.1", slow_seconds: float = 30.0, port: int = 0):
    """Serve ``path`` over HTTP on ``port`` (0: a free one) in a daemon thread; returns ``(base_url, stop)``.

    ``base_url`` has no trailing slash. ``stop()`` shuts the server down and releases the port;
    requests still sleeping in ``/slow`` or ``/drip`` are cut short.
    """
    stop_event = threading.Event()
    handler = type("Handler", (_Handler,), {"slow_seconds": slow_seconds, "stop_event": stop_event})
    server = _Server((host, port), partial(handler, directory=os.path.abspath(path)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name=f"shardprep-http-{server.server_port}", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host

    def stop() -> None:
        stop_event.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return f"http://{shown}:{server.server_port}", stop


def source_rows(base_url: str, n_rows: int, *, n_images: int | None = None, broken_share: float = 0.0,
                broken_kinds=BROKEN_KINDS, seed: int = 0, start: int = 0) -> dict[str, list]:
    """Columns ``url``, ``caption``, ``source_id`` for rows ``start..start+n_rows``.

    Row ``i`` points at ``image_name(i % n_images)``; a ``broken_share`` of rows (chosen by the
    seed) point at broken URLs instead, cycling through ``broken_kinds``. Some captions are
    ``None`` and some non-ASCII, as in real data.
    """
    rng = np.random.default_rng(seed)
    broken = {"missing": "missing/does_not_exist.jpg", "not_image": NOT_AN_IMAGE, "truncated": TRUNCATED,
              "bomb": BOMB, "timeout": "slow/" + image_name(0)}
    urls, captions = [], []
    k = 0
    for i in range(start, start + n_rows):
        if broken_share > 0 and rng.random() < broken_share:
            kind = broken_kinds[k % len(broken_kinds)]
            k += 1
            rel = f"missing/{i}.jpg" if kind == "missing" else broken[kind]
        else:
            rel = image_name(i % n_images if n_images else i)
        urls.append(f"{base_url.rstrip('/')}/{rel}")
        if i % 11 == 5:
            captions.append(None)
        elif i % 13 == 7:
            captions.append(f"ein Foto Nr. {i}: Straße, café, 東京")
        else:
            captions.append(f"a synthetic photo number {i}")
    return {"url": urls, "caption": captions, "source_id": list(range(start, start + n_rows))}


def make_source_parquets(out_dir: str, base_url: str, n_files: int, rows_per_file: int | list[int], *,
                         n_images: int | None = None, broken_share: float = 0.1,
                         broken_kinds=BROKEN_KINDS, seed: int = 0, prefix: str = "part") -> list[str]:
    """Write ``n_files`` parquet files ``{prefix}-{i:05d}.parquet`` (``url``, ``caption``, ``source_id``)
    of ``rows_per_file`` rows each (or a list: one count per file).

    ``n_images``: how many images the served site has (``make_demo_site``'s ``n_images``); rows
    cycle over them. Returns the file paths, sorted.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    counts = rows_per_file if isinstance(rows_per_file, list) else [rows_per_file] * n_files
    if len(counts) != n_files:
        raise ValueError(f"rows_per_file has {len(counts)} counts for {n_files} files")
    for f in range(n_files):
        cols = source_rows(base_url, counts[f], n_images=n_images, broken_share=broken_share,
                           broken_kinds=broken_kinds, seed=seed * 7919 + f, start=sum(counts[:f]))
        table = pa.table({"url": pa.array(cols["url"], pa.string()),
                          "caption": pa.array(cols["caption"], pa.string()),
                          "source_id": pa.array(cols["source_id"], pa.int64())})
        path = os.path.join(out_dir, f"{prefix}-{f:05d}.parquet")
        pq.write_table(table, path)
        paths.append(path)
    return paths
