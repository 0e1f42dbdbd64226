"""Download, decode, cut and re-encode one shard of videos into video2dataset's webdataset layout.

Per shard (``shard = shard_key(shard_id)``) under the output folder (``video_shard_files``):

* ``{shard}.tar``: per sample ``{key}.mp4`` (or ``.webm``), ``{key}.json``, ``{key}.txt`` (with a
  caption column), members sorted by extension. Not written when no sample succeeded.
* ``{shard}.parquet``: video2dataset's columns (the input columns, then ``key``, ``status``,
  ``error_message``): a row per sample written and a row per failed input row, so every input row has
  its status (a row cut into clips has one per clip, under the clips' keys).
* ``{shard}_stats.json``: video2dataset's fields; written last, it marks the shard complete.

Keys are img2dataset's (``shardprep.keys.compute_key``); clip ``i`` of a row is ``{key}_{i:05d}``.
Statuses are video2dataset's: ``success``; ``failed_to_download`` (HTTP error, network, address guard,
size limit: ``shardprep.fetch``'s messages; robots.txt and the per-host limits, as for images:
``shardprep.politeness``); ``failed_to_subsample`` (the bytes are no usable video:
empty, an HTML page, truncated, no video stream, too many pixels, undecodable; or no clip is left).

Differences from video2dataset 1.3.0, on purpose: the HTTP status is checked (it saves a 404 page as a
successful ``.mp4``); failed rows are not written into the tar (its #255); every URL is downloaded
directly (it sends a URL not ending in ``.mp4`` etc., even ``x.mp4?sig=...``, to yt-dlp); every video
is decoded, so a broken file is a failure, not a sample; every sample is re-encoded, so a ``.webm``
source is not stored under ``.mp4`` untranscoded; samples are in key order (not completion order).
Decoding and encoding: PyAV (``shardprep.video.clips``).

A shard stopped part way (an interrupt while downloading, or its download pool aborted because the
process is stopping: ``shardprep.fetch``) writes nothing, neither tar nor parquet nor stats; the
downloads in flight are abandoned at once, and the next run fetches all its rows again.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import pyarrow as pa

from shardprep import arrow_lists, politeness
from shardprep.config import DatasetConfig
from shardprep.fetch import ABANDONED, DownloadsAborted, abandoned_shard, default_deadline, fetch, make_pool
from shardprep.images.shards import TAKEN_DOWN, Slots, header_rules, shard_downloads
from shardprep.keys import compute_key, shard_key
from shardprep.sample_json import dumps_indented
from shardprep.storage import join, remove, write_bytes, write_parquet
from shardprep.takedown.lists import REMOVED, TakedownSet
from shardprep.tars import TarWriter
from shardprep.video.clips import OOM_CLIP_COUNT, Transcoded, VideoSpec, parse_spans, transcode
from shardprep.video.decode import VideoError
from shardprep.video.encode import check_encoder

STATUSES = ("success", "failed_to_download", "failed_to_subsample")
MIN_VIDEO_BYTES_PER_SECOND = 2_000_000  # 200 MB (max_video_bytes' default) may take 100 s
# fields of a sample's json besides the input columns: video2dataset's, then what the video is now and was
JSON_FIELDS = ("key", "status", "error_message", "yt_meta_dict", "clips", "width", "height", "framerate",
               "num_frames", "duration", "original_width", "original_height", "original_framerate",
               "original_duration", "original_codec", "original_container", "rotation", "has_audio", "sha256")


@dataclass
class VideoShardReport:
    shard: str
    count: int  # input rows
    successes: int  # input rows with at least one sample
    failed_to_download: int
    failed_to_subsample: int
    samples: int = 0  # samples in the tar (clips count one each)
    status_dict: dict[str, int] = field(default_factory=dict)
    bytes_downloaded: int = 0
    tar_bytes: int = 0
    seconds: float = 0.0
    tar_written: bool = False


@dataclass
class _Outcome:
    status: str
    error: str | None = None
    video: Transcoded | None = None
    nbytes: int = 0


def video_shard_files(out_dir: str, shard: str) -> tuple[str, str, str]:
    """(tar, parquet, stats) of ``shard`` under ``out_dir``."""
    return join(out_dir, f"{shard}.tar"), join(out_dir, f"{shard}.parquet"), join(out_dir, f"{shard}_stats.json")


def video_spec(cfg: DatasetConfig, threads: int = 1) -> VideoSpec:
    return VideoSpec(size=cfg.video_size, resize_mode=cfg.video_resize_mode, frame_rate=cfg.video_frame_rate,
                     max_duration=cfg.video_max_duration, clip_length=cfg.video_clip_length,
                     min_clip_length=cfg.video_min_clip_length, clip_strategy=cfg.video_clip_strategy,
                     encode_format=cfg.video_encode_format, crf=cfg.video_crf, preset=cfg.video_preset,
                     max_pixels=cfg.max_video_pixels, timeout=cfg.video_timeout, threads=threads)


def download_deadline(cfg: DatasetConfig) -> float:
    """Total seconds one video download may take: the images' bound (3 x timeout per attempt) plus the
    time to receive ``max_video_bytes`` at ``MIN_VIDEO_BYTES_PER_SECOND``. A large video from a sound
    server is not cut off; a server dripping bytes still frees the thread in bounded time."""
    return default_deadline(cfg.timeout, cfg.retries) + cfg.max_video_bytes / MIN_VIDEO_BYTES_PER_SECOND


def input_columns(cfg: DatasetConfig) -> list[tuple[str, str]]:
    """(source column, output name) in video2dataset's order: additional columns, clips, caption, url."""
    cols = [(c, c) for c in cfg.save_additional_columns]
    if cfg.video_clip_col is not None:
        cols.append((cfg.video_clip_col, "clips"))
    if cfg.video_caption_col is not None:
        cols.append((cfg.video_caption_col, "caption"))
    cols.append((cfg.video_url_col, "url"))
    return cols


def output_schema(input_schema: pa.Schema) -> pa.Schema:
    for name in ("key", "status", "error_message"):
        input_schema = input_schema.append(pa.field(name, pa.string()))
    return input_schema


def cpu_slots(cfg: DatasetConfig) -> tuple[int, int]:
    """(videos decoded at once, FFmpeg threads per video): ``video_decode_threads`` or one video per
    core, the cores shared among them (so a lone slow video still uses them all)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    slots = cfg.video_decode_threads or max(1, cores)
    return slots, max(1, cores // slots)


def _never() -> bool:
    return False


def _process_row(item: tuple[Any, Any, str | None], *, download: Callable, spec: VideoSpec,
                 slots: Slots, stopped: Callable[[], bool] = _never) -> _Outcome:
    """Download + decode/cut/encode one row (in a pool thread: PyAV releases the GIL in FFmpeg).
    Downloads overlap freely; at most ``slots`` videos are decoded at once (cores, memory).
    ``stopped()``: the shard is being abandoned, so a video downloaded before that is not transcoded
    (seconds each, one slot at a time: the threads queued for a slot would hold up the exit)."""
    url, spans, span_error = item
    if url is TAKEN_DOWN:
        return _Outcome("failed_to_download", REMOVED)
    if span_error is not None:
        return _Outcome("failed_to_subsample", span_error)
    fetched = download(url)
    if fetched.error is not None:
        return _Outcome("failed_to_download", fetched.error)
    with slots:
        if stopped():
            raise DownloadsAborted(ABANDONED)
        try:
            return _Outcome("success", video=transcode(fetched.data, spec, spans), nbytes=len(fetched.data))
        except VideoError as e:
            return _Outcome("failed_to_subsample", str(e), nbytes=len(fetched.data))
        except Exception as e:  # noqa: BLE001 - untrusted bytes through FFmpeg: one bad file never stops a shard
            return _Outcome("failed_to_subsample", f"{type(e).__name__}: {e}", nbytes=len(fetched.data))


def _row_items(values: dict[str, list], clip_col: str | None) -> list[tuple[Any, Any, str | None]]:
    """(url, clip spans or None, why the clips cell is unusable or None) per row."""
    items = []
    for i, url in enumerate(values["url"]):
        spans, error = None, None
        if clip_col is not None:
            try:
                spans = parse_spans(values["clips"][i])
            except ValueError as e:
                error = f"column '{clip_col}': {e}"
        items.append((url, spans, error))
    return items


def _span_cell(span: tuple[float, float], like: Any) -> list:
    """A clip's ``clips`` value, ``[[start, end]]``, in the clips column's own format (video2dataset keeps
    ``"HH:MM:SS.fff"`` strings as strings)."""
    first = like[0] if like else None
    strings = isinstance(first, str) or (isinstance(first, (list, tuple)) and first and isinstance(first[0], str))
    if not strings:
        return [[span[0], span[1]]]

    def fmt(t: float) -> str:
        ms = round(t * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"

    return [[fmt(span[0]), fmt(span[1])]]


def _samples(meta: dict, video: Transcoded, clip_mode: bool, like: Any) -> list[tuple[dict, bytes]]:
    """(json fields, encoded bytes) of each sample a video makes."""
    src = video.source
    out = []
    for i, clip in enumerate(video.clips):
        m = dict(meta)
        if clip_mode:
            m["key"] = f"{meta['key']}_{i:0{OOM_CLIP_COUNT}d}"
            m["clips"] = _span_cell(clip.span, like)
        m.update(width=clip.width, height=clip.height, framerate=clip.framerate, num_frames=clip.num_frames,
                 duration=clip.duration, original_width=video.width, original_height=video.height,
                 original_framerate=float(src.average_rate) if src.average_rate else None,
                 original_duration=video.source_duration, original_codec=src.codec,
                 original_container=src.container, rotation=video.rotation, has_audio=src.has_audio,
                 sha256=video.sha256)
        out.append((m, clip.data))
    return out


def _check_inputs(table: pa.Table, columns: list[tuple[str, str]], shard: str, cfg: DatasetConfig) -> None:
    missing = [src for src, _ in columns if src not in table.column_names]
    if missing:
        raise ValueError(f"shard {shard}: input rows lack column(s) {missing}; they have {table.column_names} "
                         "(check video_url_col/video_caption_col/video_clip_col/save_additional_columns)")
    clashes = sorted(set(cfg.save_additional_columns) & set(JSON_FIELDS))
    if clashes:
        raise ValueError(f"shard {shard}: save_additional_columns {clashes} would be overwritten by the video "
                         f"fields of each sample's json ({', '.join(JSON_FIELDS)}); rename them in the source")
    if table.num_rows > cfg.samples_per_shard:
        raise ValueError(f"shard {shard}: {table.num_rows} rows but samples_per_shard is {cfg.samples_per_shard}; "
                         "keys would collide with the next shard")


def write_video_shard(table: pa.Table, shard_id: int, cfg: DatasetConfig, out_dir: str,
                      takedowns: TakedownSet | None = None) -> VideoShardReport:
    """Download and write shard ``shard_id`` from its input rows ``table`` (source column names) into
    ``out_dir`` (any fsspec URL); every file is written atomically, the stats last. ``takedowns``: rows
    whose URL, domain or key it names are recorded as removed, never requested (``shardprep.takedown``;
    the video parquet has no hash of the bytes, so a sha256 entry cannot name a video)."""
    start_time = time.time()
    shard = shard_key(shard_id, cfg.oom_shard_count)
    tar_url, parquet_url, stats_url = video_shard_files(out_dir, shard)
    columns = input_columns(cfg)
    _check_inputs(table, columns, shard, cfg)
    check_encoder(cfg.video_encode_format)

    inputs = table.select([src for src, _ in columns]).rename_columns([out for _, out in columns])
    schema = output_schema(inputs.schema)
    values = {name: inputs.column(name).to_pylist() for name in inputs.column_names}
    keys = [compute_key(i, shard_id, cfg.oom_sample, cfg.oom_shard_count) for i in range(inputs.num_rows)]
    clip_mode = cfg.video_clip_col is not None or cfg.video_clip_length is not None

    pool = make_pool(cfg.video_thread_count)
    if pool.aborted:  # the process is stopping (abort_all): change nothing
        raise abandoned_shard(shard)
    # an older, complete run of this shard must not look complete while it is being rewritten
    remove(stats_url)

    n_slots, ffmpeg_threads = cpu_slots(cfg)
    download = partial(fetch, pool=pool, timeout=cfg.timeout, max_bytes=cfg.max_video_bytes, retries=cfg.retries,
                       allow_private=cfg.allow_private_addresses, user_agent=cfg.user_agent,
                       total_timeout=download_deadline(cfg), **header_rules(cfg))
    work = partial(
        _process_row,
        # robots.txt and the per-host limits, as for images; the wait for them counts in the video's deadline
        download=politeness.polite_downloader(download, cfg, pool=pool, deadline_seconds=download_deadline(cfg)),
        spec=video_spec(cfg, ffmpeg_threads),
        slots=Slots(n_slots),
        stopped=lambda: pool.aborted,
    )
    rows: dict[str, list] = {name: [] for name in schema.names}
    counts: Counter = Counter()
    status_dict: Counter = Counter()
    bytes_downloaded = 0
    items = _row_items(values, cfg.video_clip_col)
    if takedowns:
        items = [(TAKEN_DOWN, None, None) if takedowns.match(keys[i], item[0]) else item for i, item in enumerate(items)]
    try:
        # any exception in here (an interrupt, an abort) drops the tar and, closing the results, abandons
        # the downloads in flight
        with (TarWriter(tar_url, remove_stale=True) as tar,
              closing(shard_downloads(work, items, cfg.video_thread_count, pool, shard)) as results):
            for i, outcome in enumerate(results):
                counts[outcome.status] += 1
                status_dict[outcome.error if outcome.error is not None else "success"] += 1
                bytes_downloaded += outcome.nbytes
                meta: dict[str, Any] = {name: values[name][i] for name in inputs.column_names}
                if outcome.error == REMOVED:  # only the URL says which row it was
                    meta = {name: (v if name == "url" else None) for name, v in meta.items()}
                meta.update(key=keys[i], status=outcome.status, error_message=outcome.error, yt_meta_dict=None)
                if outcome.video is None:
                    for name in schema.names:
                        rows[name].append(meta[name])
                    continue
                like = values["clips"][i] if "clips" in values else None
                for sample, data in _samples(meta, outcome.video, clip_mode, like):
                    for name in schema.names:
                        rows[name].append(sample[name])
                    members: dict[str, bytes | str] = {cfg.video_encode_format: data,
                                                       "json": dumps_indented(sample)}
                    if cfg.video_caption_col is not None:
                        caption = values["caption"][i]
                        members["txt"] = str(caption) if caption is not None else ""
                    tar.add(sample["key"], members)
    finally:
        pool.clear()

    write_parquet(parquet_url, arrow_lists.table(rows, schema))

    end_time = time.time()
    stats = {
        "count": inputs.num_rows,
        "successes": counts["success"],
        "failed_to_download": counts["failed_to_download"],
        "failed_to_subsample": counts["failed_to_subsample"],
        "duration": end_time - start_time,
        "bytes_downloaded": bytes_downloaded,
        "start_time": start_time,
        "end_time": end_time,
        "status_dict": dict(status_dict),
    }
    write_bytes(stats_url, json.dumps(stats, indent=4).encode("utf-8"))
    return VideoShardReport(shard=shard, count=inputs.num_rows, successes=counts["success"],
                            failed_to_download=counts["failed_to_download"],
                            failed_to_subsample=counts["failed_to_subsample"], samples=tar.count,
                            status_dict=dict(status_dict), bytes_downloaded=bytes_downloaded,
                            tar_bytes=tar.bytes_written, seconds=end_time - start_time, tar_written=tar.count > 0)
