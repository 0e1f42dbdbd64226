"""Download, resize and write one img2dataset-compatible webdataset shard.

Per shard (``shard = shard_key(shard_id)``) under ``Layout.images_dir``:

* ``{shard}.tar``: per successful sample ``{key}.{jpg|png|webp}``, ``{key}.json``, ``{key}.txt``
  (with a caption column), members sorted by extension, USTAR headers as webdataset 0.2's
  ``TarWriter`` writes them. Not written at all when no sample succeeded.
* ``{shard}.parquet``: one row per input row, img2dataset's columns and types.
* ``{shard}_stats.json``: img2dataset's fields; written last, it marks the shard complete.

Differences from img2dataset, by design: samples and parquet rows are in key order (not download
completion order), so a shard's content is deterministic; a shard without successes has no tar; with
``respect_robots_txt`` (the default), a URL its site's robots.txt disallows is not fetched
(``failed_to_download``, ``robots.txt disallows``: ``shardprep.robots``); requests to one host are
limited in number and rate for all processes of the machine, or of every machine sharing one Redis
(``shardprep.politeness``).

A shard stopped part way (an interrupt while downloading, or its download pool aborted because the
process is stopping: ``shardprep.fetch``) writes nothing, neither tar nor parquet nor stats; the
downloads in flight are abandoned at once, and the next run fetches all its rows again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from shardprep import allocator, arrow_lists, politeness, robots
from shardprep.config import DatasetConfig
from shardprep.fetch import AbortablePool, DownloadsAborted, abandoned_shard, default_deadline, fetch, make_pool
from shardprep.images.resize import resize_image
from shardprep.keys import compute_key, shard_key
from shardprep.layout import Layout
from shardprep.ordered import Handoff, ordered_map
from shardprep.sample_json import dumps_indented
from shardprep.storage import atomic_write, remove
from shardprep.takedown.lists import REMOVED, TakedownSet, takedown_set
from shardprep.tars import TarWriter

HASH_COLUMN = "sha256"  # img2dataset's default compute_hash; the column is named after it


@dataclass
class ShardReport:
    shard: str
    count: int
    successes: int
    failed_to_download: int
    failed_to_resize: int
    status_dict: dict[str, int] = field(default_factory=dict)
    tar_bytes: int = 0
    seconds: float = 0.0
    tar_written: bool = False


@dataclass
class _Outcome:
    status: str
    error: str | None = None
    image: bytes | None = None
    width: int | None = None
    height: int | None = None
    original_width: int | None = None
    original_height: int | None = None
    exif: str | None = None
    sha256: str | None = None


def input_columns(cfg: DatasetConfig) -> list[tuple[str, str]]:
    """(source column, output name) in img2dataset's order: additional columns, caption, url."""
    cols = [(c, c) for c in cfg.save_additional_columns]
    if cfg.caption_col is not None:
        cols.append((cfg.caption_col, "caption"))
    cols.append((cfg.url_col, "url"))
    return cols


def output_schema(input_schema: pa.Schema, extract_exif: bool = True) -> pa.Schema:
    """img2dataset's parquet schema: the input columns, then its status and size columns."""
    schema = input_schema
    for name, typ in (("key", pa.string()), ("status", pa.string()), ("error_message", pa.string()),
                      ("width", pa.int32()), ("height", pa.int32()),
                      ("original_width", pa.int32()), ("original_height", pa.int32())):
        schema = schema.append(pa.field(name, typ))
    if extract_exif:
        schema = schema.append(pa.field("exif", pa.string()))
    return schema.append(pa.field(HASH_COLUMN, pa.string()))


def _exifread():
    """exifread (img2dataset's dependency, ExifRead-nocycle), its logger quietened once; ``None`` if missing.
    (``Logger.setLevel`` clears every logger's cache under the logging lock: not once per image.)"""
    global _EXIFREAD
    if _EXIFREAD is False:
        try:
            import exifread
        except ImportError:
            exifread = None
        logging.getLogger("exifread").setLevel(logging.CRITICAL)
        _EXIFREAD = exifread
    return _EXIFREAD


_EXIFREAD: Any = False  # not imported yet


def _exif_json(data: bytes) -> str | None:
    """EXIF as img2dataset stores it (exifread's tag names); ``None`` when absent or exifread is missing."""
    exifread = _exifread()
    if exifread is None:
        return None
    try:
        tags = exifread.process_file(io.BytesIO(data), details=False)
        return json.dumps({k: str(v).strip() for k, v in tags.items() if v is not None})
    except Exception:  # noqa: BLE001 - unreadable EXIF is no reason to drop the image (img2dataset: None)
        return None


TAKEN_DOWN = object()  # the URL of a row a takedown list names: never requested


def _process_one(url: Any, *, download: Callable, taken_down_hashes: frozenset = frozenset()) -> _Outcome | Handoff:
    """Download one URL (in a download thread): its bytes and their sha256 handed on to ``_decode`` on the
    shard's decode threads (``ordered.ordered_map``'s second stage), or the failure at once.

    The decode threads, one per core, take the downloads in the order they arrive: at most that many
    full-size images are decoded at once (memory), the cores are not oversubscribed by dozens of threads
    decoding together, and a download thread never waits for a core. When download threads took turns at
    the decode themselves (a semaphore of one slot per core), each image cost a thread that slept on the
    slot and a wake-up to hand it over, ~13 voluntary context switches a row in all."""
    if url is TAKEN_DOWN:
        return _Outcome("failed_to_download", REMOVED)
    fetched = download(url)
    if fetched.error is not None:
        return _Outcome("failed_to_download", fetched.error)
    data = fetched.data
    digest = hashlib.sha256(data).hexdigest()
    if digest in taken_down_hashes:  # the bytes a takedown names (their sha256): dropped unread
        return _Outcome("failed_to_download", REMOVED)
    return Handoff((data, digest))


def _decode(data: bytes, digest: str, *, resize: Callable, extract_exif: bool) -> _Outcome:
    """Decode/resize/encode one downloaded image (OpenCV, simplejpeg and torch release the GIL)."""
    r = resize(data)
    if r.error is not None:
        return _Outcome("failed_to_resize", r.error)
    exif = _exif_json(data) if extract_exif else None
    return _Outcome("success", None, r.data, r.width, r.height, r.original_width, r.original_height,
                    exif, digest)


class Slots:
    """At most ``n`` holders at once (``with slots:``), like ``threading.BoundedSemaphore`` but on a C
    queue of tokens: the semaphore's Condition costs ~6% of a download thread's Python time in
    lock and notify calls, once per item (the video shards' clip slots)."""

    def __init__(self, n: int):
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(n):
            self._tokens.put(None)

    def __enter__(self) -> None:
        self._tokens.get()

    def __exit__(self, *exc) -> None:
        self._tokens.put(None)


def decode_slots(cfg: DatasetConfig) -> int:
    """Images decoded at once in one shard (its decode threads): ``decode_threads``, or one per CPU core when 0."""
    if cfg.decode_threads:
        return cfg.decode_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores)


def shard_downloads(work: Callable, items: Iterable, threads: int, pool: AbortablePool, shard: str,
                    then: Callable | None = None, then_threads: int = 1) -> Iterator:
    """``ordered_map(work, items)`` over one shard's downloads on ``pool`` (with ``then``, its second stage:
    the image shards' decodes), for its writer: closed early (an exception in the writer, an interrupt) it
    abandons the downloads in flight; once ``pool`` is aborted (``fetch.abort_all``: the process is
    stopping) it raises the shard's ``DownloadsAborted`` instead of yielding, so an abandoned download's
    outcome is never recorded as the URL's own."""
    with closing(ordered_map(work, items, threads, 2 * threads, on_abort=pool.abort, then=then,
                             then_threads=then_threads)) as results:
        try:
            for outcome in results:
                if pool.aborted:
                    raise abandoned_shard(shard)
                yield outcome
        except DownloadsAborted:  # fetch's own says which pool, not which shard
            raise abandoned_shard(shard) from None


def header_rules(cfg: DatasetConfig) -> dict:
    """``fetch``'s X-Robots-Tag arguments: the config's directives, for user_agent's product token."""
    return {"user_agent_token": robots.product_token(cfg.user_agent).lower(),
            "disallowed_directives": frozenset(d.strip().lower() for d in cfg.disallowed_header_directives)}


def write_image_shard(table: pa.Table, shard_id: int, cfg: DatasetConfig, layout: Layout,
                      takedowns: TakedownSet | None = None) -> ShardReport:
    """Download and write shard ``shard_id`` from its input rows ``table`` (source column names).
    ``takedowns``: the samples to leave out (default: the lists registered under ``layout`` and the
    config's, ``shardprep.takedown``)."""
    start_time = time.time()
    allocator.keep_freed_memory()  # decoded images reuse freed memory instead of faulting in new pages
    shard = shard_key(shard_id, cfg.oom_shard_count)
    columns = input_columns(cfg)
    missing = [src for src, _ in columns if src not in table.column_names]
    if missing:
        raise ValueError(f"shard {shard}: input rows lack column(s) {missing}; "
                         f"they have {table.column_names} (check url_col/caption_col/save_additional_columns)")
    if table.num_rows > cfg.samples_per_shard:
        raise ValueError(f"shard {shard}: {table.num_rows} rows but samples_per_shard is {cfg.samples_per_shard}; "
                         "keys would collide with the next shard")

    inputs = table.select([src for src, _ in columns]).rename_columns([out for _, out in columns])
    schema = output_schema(inputs.schema, cfg.extract_exif)
    values = {name: inputs.column(name).to_pylist() for name in inputs.column_names}
    urls = values["url"]
    names_in = inputs.column_names
    keys = [compute_key(i, shard_id, cfg.oom_sample, cfg.oom_shard_count) for i in range(inputs.num_rows)]

    # rows a takedown list names (shardprep.takedown) are recorded as removed, never requested
    if takedowns is None:
        takedowns = takedown_set(layout, cfg.takedown_lists)
    removed = {i for i in range(len(urls)) if takedowns.match(keys[i], urls[i])} if takedowns else set()
    urls = [TAKEN_DOWN if i in removed else u for i, u in enumerate(urls)] if removed else urls

    pool = make_pool(cfg.thread_count)
    if pool.aborted:  # the process is stopping (abort_all): change nothing on disk
        raise abandoned_shard(shard)
    # an older, complete run of this shard must not look complete while it is being rewritten
    remove(layout.shard_stats(shard))

    download = partial(fetch, pool=pool, timeout=cfg.timeout, max_bytes=cfg.max_image_bytes,
                       retries=cfg.retries, allow_private=cfg.allow_private_addresses, user_agent=cfg.user_agent,
                       **header_rules(cfg))
    # robots.txt and the per-host limits, as for videos
    download = politeness.polite_downloader(download, cfg, pool=pool,
                                            deadline_seconds=default_deadline(cfg.timeout, cfg.retries))
    decode = partial(_decode,
                     resize=partial(resize_image, image_size=cfg.image_size, resize_mode=cfg.resize_mode,
                                    resize_only_if_bigger=cfg.resize_only_if_bigger, encode_format=cfg.encode_format,
                                    encode_quality=cfg.encode_quality, max_image_pixels=cfg.max_image_pixels,
                                    fast_decode=cfg.fast_decode),
                     extract_exif=cfg.extract_exif)
    work = partial(_process_one, download=download, taken_down_hashes=frozenset(takedowns.entries["sha256"]))
    names_out = schema.names  # a property that builds a new list at every call: once, not once a row
    out_cols: dict[str, list] = {name: [] for name in names_out}
    counts: Counter = Counter()
    status_dict: Counter = Counter()
    try:
        # opened at the first success: a shard without any gets no tar (and loses a stale one, which
        # would contradict the parquet). Any exception in here (an interrupt, an abort) drops the tar
        # and, closing the results, abandons the downloads in flight.
        with (TarWriter(layout.tar(shard), remove_stale=True) as tar,
              closing(shard_downloads(work, urls, cfg.thread_count, pool, shard,
                                      then=decode, then_threads=decode_slots(cfg))) as results):
            for i, outcome in enumerate(results):
                counts[outcome.status] += 1
                status_dict[outcome.error if outcome.error is not None else "success"] += 1
                meta: dict[str, Any] = {name: values[name][i] for name in names_in}
                if outcome.error == REMOVED:  # only the URL says which row it was
                    meta = {name: (v if name == "url" else None) for name, v in meta.items()}
                meta.update(key=keys[i], status=outcome.status, error_message=outcome.error,
                            width=outcome.width, height=outcome.height,
                            original_width=outcome.original_width, original_height=outcome.original_height)
                if cfg.extract_exif:
                    meta["exif"] = outcome.exif
                meta[HASH_COLUMN] = outcome.sha256
                for name in names_out:
                    out_cols[name].append(meta[name])
                if outcome.status != "success":
                    continue
                members: dict[str, bytes | str] = {cfg.encode_format: outcome.image,
                                                   "json": dumps_indented(meta)}
                if cfg.caption_col is not None:
                    caption = values["caption"][i]
                    members["txt"] = str(caption) if caption is not None else ""
                tar.add(keys[i], members)
    finally:
        pool.clear()
    tar_bytes, tar_written = tar.bytes_written, tar.count > 0

    with atomic_write(layout.shard_parquet(shard)) as f:
        pq.write_table(arrow_lists.table(out_cols, schema), f)

    end_time = time.time()
    stats = {
        "count": inputs.num_rows,
        "successes": counts["success"],
        "failed_to_download": counts["failed_to_download"],
        "failed_to_resize": counts["failed_to_resize"],
        "duration": end_time - start_time,
        "start_time": start_time,
        "end_time": end_time,
        "status_dict": dict(status_dict),
    }
    with atomic_write(layout.shard_stats(shard)) as f:
        f.write(json.dumps(stats, indent=4).encode("utf-8"))
    return ShardReport(shard=shard, count=inputs.num_rows, successes=counts["success"],
                       failed_to_download=counts["failed_to_download"], failed_to_resize=counts["failed_to_resize"],
                       status_dict=dict(status_dict), tar_bytes=tar_bytes, seconds=end_time - start_time,
                       tar_written=tar_written)
