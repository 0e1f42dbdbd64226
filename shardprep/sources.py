"""Source parquet files: listing any fsspec URL or glob, checking them cheaply, reading a shard's rows."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from shardprep.config import DatasetConfig
from shardprep.errors import ShardprepError
from shardprep.storage import url_to_fs


class SourceError(ShardprepError, ValueError):
    """A source file is unreachable, not parquet, or lacks a configured column."""


@dataclass(frozen=True)
class SourceInfo:
    url: str
    rows: int
    fingerprint: str
    columns: tuple[str, ...]


def list_source_files(source: str) -> list[str]:
    """Every parquet file the source names, as full URLs, sorted (a stable shard order).

    A source that names no file (a glob matching nothing, a folder without parquet files) is an error
    at once: a typo there would otherwise make an empty dataset and fail much later, far from its cause."""
    try:
        fs, path = url_to_fs(source)
    except Exception as e:  # bad protocol, missing driver, bad credentials
        raise SourceError(f"source {source!r}: cannot open: {e}") from e
    try:
        if any(ch in path for ch in "*?["):
            paths = fs.glob(path)
        elif fs.isdir(path):
            paths = fs.glob(path.rstrip("/") + "/**/*.parquet") or fs.glob(path.rstrip("/") + "/*.parquet")
        elif fs.exists(path):
            paths = [path]
        else:
            raise SourceError(f"source {source!r}: no such file or folder")
    except SourceError:
        raise
    except Exception as e:  # network errors, permission errors
        raise SourceError(f"source {source!r}: cannot list: {e}") from e
    files = sorted({fs.unstrip_protocol(p) for p in paths if not fs.isdir(p)})
    if not files:
        raise SourceError(f"source {source!r} matched no file (no parquet file there); check config field "
                          "'source': a parquet file, a folder holding parquet files, or a glob such as "
                          "'.../*.parquet'")
    return files


def fingerprint(info: dict) -> str:
    # what changes when the object is rewritten, whatever the backend calls it
    for k in ("ETag", "etag", "last_commit", "mtime", "LastModified", "created"):
        v = info.get(k)
        if v is not None:
            return f"{info.get('size')}:{getattr(v, 'oid', v)}"
    return str(info.get("size"))


def file_fingerprint(url: str) -> str:
    """The fingerprint of the file at ``url`` now (one ``info`` call, no read)."""
    fs, path = url_to_fs(url)
    try:
        return fingerprint(fs.info(path))
    except FileNotFoundError:
        raise SourceError(f"source file {url}: not found") from None


def required_columns(cfg: DatasetConfig, media: str = "image") -> list[tuple[str, str]]:
    """(config field, column) a source file of ``media`` ("image" or "video") must have."""
    if media == "video":
        cols = [("video_url_col", cfg.video_url_col)]
        if cfg.video_caption_col:
            cols.append(("video_caption_col", cfg.video_caption_col))
        if cfg.video_clip_col:
            cols.append(("video_clip_col", cfg.video_clip_col))
    else:
        cols = [("url_col", cfg.url_col)]
        if cfg.caption_col:
            cols.append(("caption_col", cfg.caption_col))
    cols += [("save_additional_columns", c) for c in cfg.save_additional_columns]
    return cols


def url_column(cfg: DatasetConfig, media: str) -> str:
    return cfg.video_url_col if media == "video" else cfg.url_col


def list_all_source_files(cfg: DatasetConfig) -> dict[str, str]:
    """``{file URL: media}`` of every file ``source`` (images) and ``video_source`` (videos) name, in
    the order shards are given out: image files, then video files, each sorted. A file both name is an
    error: its rows cannot be both."""
    files: dict[str, str] = {}
    for media, glob in (("image", cfg.source), ("video", cfg.video_source)):
        if glob is None:
            continue
        for url in list_source_files(glob):
            if files.get(url, media) != media:
                raise SourceError(f"source file {url} is named by both 'source' (images) and 'video_source' "
                                  "(videos); a file's rows are one or the other: narrow one of the globs")
            files[url] = media
    return files


def inspect_source(url: str, cfg: DatasetConfig, media: str = "image") -> SourceInfo:
    """Read only the parquet footer: row count and schema, checked against the config's columns."""
    fs, path = url_to_fs(url)
    try:
        info = fs.info(path)
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except FileNotFoundError:
        raise SourceError(f"source file {url}: not found") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise SourceError(f"source file {url}: not a readable parquet file ({e})") from None
    columns = tuple(schema.names)
    for field_name, col in required_columns(cfg, media):
        if col not in columns:
            raise SourceError(
                f"source file {url}: column {col!r} (config field '{field_name}') is missing; "
                f"columns are {list(columns)}"
            )
    return SourceInfo(url=url, rows=meta.num_rows, fingerprint=fingerprint(info), columns=columns)


def read_rows(url: str, start: int, stop: int, columns: list[str] | None = None) -> pa.Table:
    """Rows [start, stop) of a parquet file, reading only the row groups that hold them (and only
    ``columns``, when given)."""
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        groups, offset, first = [], 0, None
        for i in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(i).num_rows
            if offset + n > start and offset < stop:
                groups.append(i)
                first = offset if first is None else first
            offset += n
        if not groups:
            empty = pf.schema_arrow.empty_table()
            return empty if columns is None else empty.select(columns)
        table = pf.read_row_groups(groups, columns=columns, use_threads=False)  # storage.read_parquet: why
    return table.slice(start - first, stop - start)
