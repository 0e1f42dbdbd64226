"""Where the download engine's CPU goes beyond the per-core limit's work (issue 22): experiments,
not part of `make bench` (their findings are in bench/IMAGES.md).

    python bench/experiments/engine_overheads.py split [--reps 2]
    python bench/experiments/engine_overheads.py event-loop [--reps 3]
    python bench/experiments/engine_overheads.py pair [--reps 3] [--sides threads,one-process,inline-2] [--server node]
    python bench/experiments/engine_overheads.py downscale
    python bench/experiments/engine_overheads.py one-shards [--reps 4] --sides threads,torch-kernel
    python bench/experiments/engine_overheads.py switches

All use the benchmark site (``bench/source.py``: 240 images, 10,000 URL rows with 5% broken) served from
its own process, and write under ``bench/work/experiments``.

``split``: in one warm process, CPU milliseconds per successful image of (a) ``resize_image`` (the engine's
decode/resize/encode, ``fast_decode``) over the shard's images read into memory, on one thread; (b) the
same on two threads (the GIL shared, both cores busy); (c) ``write_image_shard`` on the 10,000 rows over
HTTP. (c) - (b) is what the engine spends beyond that work: HTTP, sha256, EXIF, the writer, the threads.

``event-loop``: the question whether taking the downloads off 32 threads saves CPU. A prototype fetches
every URL on one ``selectors`` thread (plain HTTP/1.1 keep-alive to the one bench host; nothing of
``fetch``'s guard, redirects, robots or limits) and hands the bodies to the engine's decode threads,
sha256 included there; the other side is the engine as it is, robots.txt off on both. Sides alternate;
each line is one shard, its process's CPU and context switches. ``one-shards``: the same alternation
for any two sides (``--sides``); ``torch-kernel`` is the engine with torch's antialiased kernel, its
downscale until ``downscale.c``, swapped back in (torch imported at the first downscale, as it was).

``pair``: the same two sides in the images pair's own configuration (``drivers.images_ours``: 20,000 rows,
two processes forked from a light parent, one 10,000-row shard each, both cores busy), each run set against
the limit loop (``limits.images_limit``) measured right before and right after it: the share of the limit the
bench reports, robots.txt off on both sides. ``--sides threads,one-process``: the engine against both shards
run on two threads of one process (one import of everything, half the threads); ``inline-N``: N download
threads a shard, each decoding its own images (no hand-off to the decode threads); ``batch-downloads``: the download
threads under ``SCHED_BATCH`` (woken by a socket, they wait for the scheduler's tick instead of preempting a
decode thread); ``opencv-png``: the engine before ``images/png.py``, every PNG decoded by OpenCV. ``--server node``: the site
served by ``static_server.js`` (Node's HTTP server, files held in memory: ~0.15 CPU-ms a request against ~0.4
for the Python fixture's), to see whether the server's share of the two cores holds the engine back.

``switches``: one shard, and per group of its threads (the download threads, the decode threads, the writer)
the context switches a row and the CPU seconds, read from ``/proc`` while it runs.

``downscale``: the engine's downscale (``resize._antialiased``: ``downscale.c``, written so that a download
process never imports torch, 1.15-2.4 CPU-s) against torch's antialiased kernel, which it replaced, and
the OpenCV candidates tried before it. The site's JPEGs that are downscaled, as the engine hands them to its
downscale (``resize._plan_reduction``'s DCT-scaled decode, the target size from the original's), through
each candidate on one thread: CPU ms an image, and PSNR against torch's kernel and against OpenCV's area
resize (img2dataset's filter).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from functools import partial
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]
WORK = os.path.join(BENCH, "work", "experiments")
ROWS = 10_000


def _settings(out: str, **extra) -> dict:
    """The experiments' dataset settings (the images pair's), writing under ``out``."""
    return {"source": os.path.join(WORK, "urls.parquet"), "output_root": out, "url_col": "url",
            "caption_col": "caption", "save_additional_columns": ["source_id"], "samples_per_shard": ROWS,
            "image_size": 256, "resize_mode": "border", "encode_quality": 95, "thread_count": 32, "timeout": 10,
            "allow_private_addresses": True, **extra}


def _config(out: str, **extra):
    from shardprep.config import config_from_dict

    return config_from_dict(_settings(out, **extra))


def _write_shard(cfg):
    from shardprep.images.shards import write_image_shard
    from shardprep.layout import Layout
    from shardprep.sources import read_rows

    shutil.rmtree(cfg.output_root, ignore_errors=True)
    return write_image_shard(read_rows(cfg.source, 0, ROWS), 0, cfg, Layout(cfg.output_root))


# ------------------------------------------------------------------------------------------------ split


def split(base_url: str, reps: int) -> None:
    import pyarrow.parquet as pq

    from shardprep.images.resize import resize_image

    prefix = base_url + "/images/"
    files: dict[str, bytes] = {}
    datas = []
    for u in pq.read_table(os.path.join(WORK, "urls.parquet"), columns=["url"]).column("url").to_pylist():
        if u.startswith(prefix):
            path = os.path.join(WORK, "site", "images", u[len(prefix):])
            if path not in files:
                with open(path, "rb") as f:
                    files[path] = f.read()
            datas.append(files[path])
    kw = dict(image_size=256, resize_mode="border", encode_quality=95, fast_decode=True)

    def loop(threads: int) -> float:
        def part(ds):
            for d in ds:
                resize_image(d, **kw)
        c = time.process_time()
        workers = [threading.Thread(target=part, args=(datas[i::threads],)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return 1000 * (time.process_time() - c) / len(datas)

    cfg = _config(os.path.join(WORK, "split-out"))

    def engine() -> float:
        c = time.process_time()
        r = _write_shard(cfg)
        return 1000 * (time.process_time() - c) / r.successes

    engine()  # warm: imports, torch, the server's page cache
    for _ in range(reps):
        print(json.dumps({"ms_per_image": {"one_thread": round(loop(1), 3), "two_threads": round(loop(2), 3),
                                           "engine": round(engine(), 3), "two_threads_again": round(loop(2), 3),
                                           "one_thread_again": round(loop(1), 3)}}), flush=True)


# ------------------------------------------------------------------------------------------- event loop

_HEAD_END = re.compile(rb"\r\n\r\n")
_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")


def _loop_downloads(work, items, threads, pool, shard, then, then_threads):
    """Stands in for ``shards.shard_downloads``: the outcomes in row order, every download on one thread,
    the decodes on the engine's number of decode threads."""
    from concurrent.futures import ThreadPoolExecutor

    from shardprep.images.shards import _Outcome

    decode = partial(ThreadPoolExecutor(then_threads).submit, then)
    items = list(items)
    futures = [Future() for _ in items]
    host = urlsplit(items[0])
    rows = iter(range(len(items)))

    def connect(sel, conn) -> None:
        sock = socket.create_connection((host.hostname, host.port))
        sock.setblocking(False)
        conn["sock"] = sock
        sel.register(sock, selectors.EVENT_READ, conn)

    def ask(sel, conn) -> None:
        i = next(rows, None)
        if i is None:
            sel.unregister(conn["sock"])
            conn["sock"].close()
            return
        u = urlsplit(items[i])
        conn.update(i=i, buf=bytearray(), end=None, head=None)
        conn["sock"].sendall(f"GET {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept-Encoding: identity\r\n\r\n"
                             .encode())

    def run() -> None:
        sel = selectors.DefaultSelector()
        for _ in range(threads):
            conn: dict = {}
            connect(sel, conn)
            ask(sel, conn)
        while sel.get_map():
            for key, _ in sel.select(1.0):
                conn = key.data
                try:
                    data = conn["sock"].recv(1 << 20)
                except BlockingIOError:
                    continue
                conn["buf"] += data
                if conn["head"] is None:
                    m = _HEAD_END.search(conn["buf"])
                    if not m:
                        continue
                    conn["head"] = bytes(conn["buf"][:m.end()])
                    conn["end"] = m.end() + int(_LENGTH.search(conn["head"]).group(1))
                if len(conn["buf"]) < conn["end"]:
                    continue
                status = int(conn["head"].split(None, 2)[1])
                body = bytes(conn["buf"][len(conn["head"]):conn["end"]])
                futures[conn["i"]].set_result(decode(body, None) if status == 200 else
                                              _Outcome("failed_to_download", f"HTTP Error {status}"))
                if b"\r\nconnection: close" in conn["head"].lower():  # the server's 404s
                    sel.unregister(conn["sock"])
                    conn["sock"].close()
                    connect(sel, conn)
                ask(sel, conn)

    threading.Thread(target=run, daemon=True).start()
    for f in futures:
        outcome = f.result()
        yield outcome.result() if isinstance(outcome, Future) else outcome


def _use_event_loop() -> None:
    """Swap the prototype in for this process's engine."""
    from shardprep.images import shards as S

    decode = S._decode

    def hash_then_decode(data, digest, **kw):  # the engine's sha256, moved off the (absent) download threads
        return decode(data, hashlib.sha256(data).hexdigest(), **kw)

    S._decode = hash_then_decode
    S.shard_downloads = _loop_downloads


def _batch_downloads() -> None:
    """The download threads under SCHED_BATCH: a download thread woken by its socket no longer preempts a
    running decode thread, it waits for the scheduler's tick (the decode threads keep their caches)."""
    from shardprep.images import shards as S

    process_one, batched = S._process_one, threading.local()

    def in_batch(url, **kw):
        if not getattr(batched, "done", False):  # this thread only (a Linux task), at its first download
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            batched.done = True
        return process_one(url, **kw)

    S._process_one = in_batch


def _opencv_png() -> None:
    """The engine before ``images/png.py``: every PNG decoded by OpenCV."""
    from shardprep.images import resize

    resize.decode_png = lambda data: None


def _decode_inline() -> None:
    """Each download thread decodes its own image (no hand-off to the decode threads)."""
    from shardprep.images import shards as S
    from shardprep.ordered import Handoff

    shard_downloads = S.shard_downloads

    def inline(work, items, threads, pool, shard, then, then_threads):
        def work_and_decode(url):
            outcome = work(url)
            return then(*outcome.args) if isinstance(outcome, Handoff) else outcome
        return shard_downloads(work_and_decode, items, threads, pool, shard)

    S.shard_downloads = inline


def _torch_downscale(img, w: int, h: int):
    """The engine's downscale until ``downscale.c``: the op torch's ``interpolate(antialias=True)`` calls,
    writing into an HWC array; torch imported at the first call."""
    import numpy as np
    import torch

    planes = img[:, :, np.newaxis] if img.ndim == 2 else img
    src = torch.from_numpy(np.ascontiguousarray(planes)).permute(2, 0, 1).unsqueeze(0)
    out = np.empty((h, w, planes.shape[2]), np.uint8)
    torch._C._nn._upsample_bilinear2d_aa(src, [h, w], False, None, None,
                                         out=torch.from_numpy(out).permute(2, 0, 1).unsqueeze(0))
    return out if img.ndim == 3 else out[:, :, 0]


def one_shard(side: str) -> None:
    """One shard in this (fresh) process; prints its CPU and context switches."""
    if side == "event-loop":
        _use_event_loop()
    elif side == "torch-kernel":
        from shardprep.images import resize

        resize._antialiased = _torch_downscale
    elif side == "opencv-png":
        _opencv_png()
    t0 = time.perf_counter()
    r = _write_shard(_config(os.path.join(WORK, f"{side}-out"), respect_robots_txt=False))
    cpu = time.process_time()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"side": side, "successes": r.successes, "wall": round(time.perf_counter() - t0, 1),
                      "cpu": round(cpu, 2), "per_cpu_second": round(r.successes / cpu, 1),
                      "voluntary_switches": ru.ru_nvcsw, "involuntary_switches": ru.ru_nivcsw}), flush=True)


def thread_switches() -> None:
    """One shard in this process, its threads' context switches and CPU by group (the download threads,
    the decode threads, the writer): read from /proc every 0.2 s, each thread's last reading kept."""
    import collections

    last: dict[int, tuple] = {}
    done = threading.Event()

    def read() -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
                with open(f"/proc/self/task/{tid}/stat") as f:
                    ticks = f.read().rsplit(")", 1)[1].split()[11:13]  # utime, stime
            except OSError:
                continue  # ended meanwhile
            group = names.get(tid, last.get(tid, ("other",))[0]).split("_")[0]
            last[tid] = (group, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]),
                         int(ticks[0]) / os.sysconf("SC_CLK_TCK"), int(ticks[1]) / os.sysconf("SC_CLK_TCK"))

    def watch() -> None:
        while not done.wait(0.2):
            read()

    watcher = threading.Thread(target=watch, name="watcher")
    watcher.start()
    r = _write_shard(_config(os.path.join(WORK, "switches-out"), respect_robots_txt=False))
    done.set()
    watcher.join()
    groups: dict = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0.0])
    for group, *values in last.values():
        g = groups[group]
        g[0] += 1
        for k, v in enumerate(values, 1):
            g[k] += v
    print(json.dumps({"successes": r.successes, "cpu": round(time.process_time(), 2), "groups": {
        name: {"threads": g[0], "voluntary_per_row": round(g[1] / ROWS, 2), "involuntary_per_row": round(g[2] / ROWS, 2),
               "user_s": round(g[3], 2), "system_s": round(g[4], 2)} for name, g in sorted(groups.items())}}), flush=True)


def one_shard_pairs(reps: int, sides: list[str]) -> None:
    for rep in range(reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            subprocess.run([sys.executable, __file__, "one-shard", side], check=True)


# ------------------------------------------------------------------------------------ the pair's configuration

PAIR_ROWS = 20_000  # the images pair's source: 2 shards of 10,000 rows, one per process


def _pair_shard(args) -> dict:
    """``drivers._ours_shard`` in a worker of the pair's pool, with the prototype swapped in when asked."""
    side, job = args
    if side == "event-loop":
        _use_event_loop()
    elif side.startswith("inline-"):
        _decode_inline()
    elif side == "batch-downloads":
        _batch_downloads()
    elif side == "opencv-png":
        _opencv_png()
    from drivers import _ours_shard

    return _ours_shard(job)


def pair_side(side: str) -> None:
    """The images pair's side of ours as ``drivers.images_ours`` runs it (two processes forked from a parent
    that imported nothing heavy, one 10,000-row shard each; ``one-process``: the two shards on two threads of
    this process); prints the successes and the CPU seconds of the whole process tree."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    cfg = _settings(os.path.join(WORK, f"pair-{side}"), source=os.path.join(WORK, "pair-urls.parquet"),
                    respect_robots_txt=False)
    if side.startswith("inline-"):  # inline-N: N download threads a shard, each decoding its own images
        cfg["thread_count"] = int(side.split("-")[1])
    shutil.rmtree(cfg["output_root"], ignore_errors=True)
    jobs = [(side, (cfg["source"], off, ROWS, k, cfg)) for k, off in enumerate(range(0, PAIR_ROWS, ROWS))]
    if side == "one-process":
        pool = ThreadPoolExecutor(2)  # two shard writers in one process
    else:
        pool = ProcessPoolExecutor(2, mp_context=mp.get_context("fork"))
    with pool:
        successes = sum(r["successes"] for r in pool.map(_pair_shard, jobs))
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    print(json.dumps({"successes": successes, "cpu": cpu}), flush=True)


def pair(base_url: str, site: dict, reps: int, sides: list[str]) -> None:
    """Two ``sides`` (default: ``threads``, the engine, against ``event-loop``, the prototype) in the pair's own
    configuration, each run set against the limit loop (``limits.images_limit``) measured right before and
    right after it."""
    import statistics

    from limits import images_limit
    from source import make_url_parquet

    make_url_parquet(os.path.join(WORK, "pair-urls.parquet"), base_url, site, PAIR_ROWS)
    cfg = _settings("")
    limit_settings = {"parquet": os.path.join(WORK, "pair-urls.parquet"), "base_url": base_url,
                      "site_dir": os.path.join(WORK, "site"), "processes": 2,
                      **{k: cfg[k] for k in ("image_size", "resize_mode", "encode_quality")}}
    shares: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            before = images_limit(limit_settings)
            out = subprocess.run([sys.executable, __file__, "pair-side", side], check=True, capture_output=True,
                                 text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            after = images_limit(limit_settings)
            rate = run["successes"] / run["cpu"]
            limit = (before["per_cpu_second"] + after["per_cpu_second"]) / 2
            full = (before["with_hash_exif_per_cpu_second"] + after["with_hash_exif_per_cpu_second"]) / 2
            shares[side].append(rate / limit)
            print(json.dumps({"side": side, "successes": run["successes"], "cpu": round(run["cpu"], 1),
                              "per_cpu_second": round(rate, 1),
                              "limit": [round(before["per_cpu_second"], 1), round(after["per_cpu_second"], 1)],
                              "share_of_limit": round(shares[side][-1], 3),
                              "hash_exif_ms": round(500 * (before["hash_exif_cpu_seconds"] / before["items"]
                                                           + after["hash_exif_cpu_seconds"] / after["items"]), 3),
                              "share_with_hash_exif": round(rate / full, 3)}), flush=True)
    print(json.dumps({side: round(statistics.median(v), 3) for side, v in shares.items()}), flush=True)


# ---------------------------------------------------------------------------------------------------------


def _site(server_kind: str = "python") -> tuple[object, str, dict]:
    from source import Server, make_site, make_url_parquet

    site = make_site(os.path.join(WORK, "site"), 240)
    node = ["node", os.path.join(HERE, "static_server.js")] if server_kind == "node" else None
    server = Server(os.path.join(WORK, "site"), command=node)
    make_url_parquet(os.path.join(WORK, "urls.parquet"), server.url, site, ROWS)
    return server, server.url, site


def downscale() -> None:
    import glob

    import cv2
    import numpy as np

    from shardprep.images.resize import _antialiased, _decode_jpeg, _header, _plan_reduction, _target

    cv2.setNumThreads(1)
    size, images = 256, []
    for path in sorted(glob.glob(os.path.join(WORK, "site", "images", "*.jpg"))):
        with open(path, "rb") as f:
            data = f.read()
        (width, height), fmt, mode = _header(data)
        if max(width, height) <= size:
            continue  # not downscaled
        # what the engine hands its downscale (border mode): the DCT-scaled decode, the original's target size
        img = _decode_jpeg(data, *_plan_reduction((width, height), fmt, mode, "border", size))
        if img is not None:
            new_h, new_w = _target(height, width, size / max(width, height))
            images.append((img, new_w, new_h))

    def area(img, w, h):
        return cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA)

    def integer_area_then_bilinear(img, w, h):
        k = img.shape[1] // w
        if k >= 2:
            img = cv2.resize(img, (img.shape[1] // k, img.shape[0] // k), interpolation=cv2.INTER_AREA)
        return cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)

    def box_blurs_then_bilinear(img, w, h):
        k = max(1, round(img.shape[1] / w))
        if k > 1:
            img = cv2.blur(cv2.blur(img, (k, k)), (k, k))
        return cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)

    def psnr(a, b) -> float:
        mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
        return 99.0 if mse == 0 else float(10 * np.log10(255 ** 2 / mse))

    torch_out = [_torch_downscale(*x) for x in images]  # (torch imported here, outside the timing)
    area_out = [area(*x) for x in images]
    for fn in (_antialiased, _torch_downscale, area, integer_area_then_bilinear, box_blurs_then_bilinear) * 2:
        t = time.process_time()
        out = [fn(*x) for x in images]
        ms = (time.process_time() - t) / len(images) * 1e3
        vs_torch = [psnr(o, r) for o, r in zip(out, torch_out)]
        vs_area = [psnr(o, r) for o, r in zip(out, area_out)]
        print(json.dumps({"downscale": fn.__name__, "images": len(images), "ms_per_image": round(ms, 3),
                          "psnr_vs_torch": [round(min(vs_torch), 1), round(float(np.median(vs_torch)), 1)],
                          "psnr_vs_area": [round(min(vs_area), 1), round(float(np.median(vs_area)), 1)]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("split", "event-loop", "one-shards", "pair", "downscale", "switches", "one-shard",
                                    "pair-side"))
    p.add_argument("side", nargs="?")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--sides", default="threads,event-loop", help="sides: threads, event-loop, one-process, inline-N, batch-downloads, opencv-png (pair); threads, "
                   "event-loop, torch-kernel, opencv-png (one-shards)")
    p.add_argument("--server", choices=("python", "node"), default="python",
                   help="what serves the site: the tests' Python fixture (as make bench does) or static_server.js")
    a = p.parse_args()
    if a.what == "one-shard":
        one_shard(a.side)
        return
    if a.what == "pair-side":
        pair_side(a.side)
        return
    os.chdir(ROOT)  # the server's process imports tests.fixtures from here
    os.makedirs(WORK, exist_ok=True)
    server, url, site = _site(a.server)
    try:
        if a.what == "split":
            split(url, a.reps)
        elif a.what == "downscale":
            downscale()
        elif a.what == "pair":
            pair(url, site, a.reps, a.sides.split(","))
        elif a.what == "one-shards":
            one_shard_pairs(a.reps, a.sides.split(","))
        elif a.what == "switches":
            thread_switches()
        else:
            one_shard_pairs(a.reps, ["threads", "event-loop"])
    finally:
        server.close()


if __name__ == "__main__":
    main()
