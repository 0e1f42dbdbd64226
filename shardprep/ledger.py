"""The shard ledger: which rows of which source file make each shard, decided once and never changed.

Stored as ``<root>/ledger.json``. Shard ids continue across source files (as img2dataset's do), so
keys are unique in the whole dataset and a new source file only appends shards. Rows appended to a
registered file become new shards too (ids continuing from the ledger's next id); a file rewritten in
place or shrunk is an error until ``reshard_source`` settles which of its shards must be redone.

Format, version 2 (version 1 ledgers are read and converted; the next write is version 2)::

    {"version": 2, "samples_per_shard": 10000, "oom_shard_count": 5,
     "files": [{"source": "s3://bucket/part-00000.parquet",   # the full URL, as listed
                "fingerprint": "123456:2024-01-01T00:00:00",  # size:mtime/etag when last registered
                "rows": 25000,                                # rows registered (the file's count then)
                "columns": ["url", "caption", ...],
                "digest": {"column": "url", "head_rows": 1000, "last_row": 24999, "sha256": "..."} | null,
                "segments": [{"first_shard": 0, "num_shards": 3, "row_start": 0, "row_stop": 25000}, ...],
                "media": "video"}]}                           # only for files of video_source (else images)

Shard ``first_shard + i`` of a segment holds rows ``[a, min(a + samples_per_shard, row_stop))`` with
``a = min(row_start + i * samples_per_shard, row_stop)``: every shard is full but a segment's last,
and shards past a shrunk file's end hold no rows (their ids are kept, never reused). Segments of a
file are contiguous: the first starts at row 0, each next one where the previous one stops.

The digest lets a file whose shards were never copied be checked without its copies: sha256 over the
``column`` values (JSON, one a line) of rows ``[0, head_rows)`` followed by row ``last_row``. It
catches a rewrite of the file's head (where row reorders and re-exports show) or of its last
registered row (where a file cut and regrown shows); a change elsewhere in a shard never copied goes
unseen, and harms nothing: that shard reads the rows as they are when it is first copied.
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from shardprep.config import DatasetConfig
from shardprep.errors import ShardprepError
from shardprep.keys import partition_key, partition_range, shard_key
from shardprep.layout import Layout
from shardprep.sources import (
    SourceError,
    SourceInfo,
    file_fingerprint,
    inspect_source,
    list_all_source_files,
    read_rows,
    url_column,
)
from shardprep.storage import exists, lock, open_read, read_bytes, remove, url_to_fs, write_bytes

LEDGER_VERSION = 2
READABLE_VERSIONS = (1, 2)
DIGEST_HEAD_ROWS = 1000  # a footer read plus the url column of one or two row groups per file


class LedgerError(ShardprepError, ValueError):
    """The ledger disagrees with the config (e.g. samples_per_shard changed) or with a source file."""


def reshard_command(url: str, config_path: str | None = None) -> str:
    config = shlex.quote(config_path) if config_path else "<config>"
    return f"shardprep reshard --config {config} --source {shlex.quote(url)}"


class SourceChangedError(LedgerError):
    """A registered source file was rewritten or shrank: rows its shards were given are not there any
    more. ``url``: the file; ``change``: what changed; ``fingerprint``: the file's fingerprint when
    checked (a caller can skip checking it again until it changes)."""

    def __init__(self, url: str, change: str, fingerprint: str, config_path: str | None = None):
        self.url, self.change, self.fingerprint = url, change, fingerprint
        super().__init__(
            f"source file {url} changed after its shards were assigned: {change}. A shard's rows never "
            f"move, so re-shard the file (shards whose rows changed are redone, the others kept): "
            f"{reshard_command(url, config_path)}")


@dataclass(frozen=True)
class Shard:
    shard_id: int
    key: str
    source: str
    row_start: int
    row_stop: int
    media: str = "image"  # "video" for the shards of video_source files

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start


def _segment_rows(segment: dict, samples_per_shard: int):
    """(shard id, row_start, row_stop) of each shard of a segment, in id order."""
    for i in range(segment["num_shards"]):
        start = min(segment["row_start"] + i * samples_per_shard, segment["row_stop"])
        yield segment["first_shard"] + i, start, min(start + samples_per_shard, segment["row_stop"])


@dataclass
class Ledger:
    samples_per_shard: int
    oom_shard_count: int
    files: list[dict] = field(default_factory=list)
    shards_per_partition: int = 1  # Dagster partitions: blocks of this many consecutive shard ids
    read_version: int = field(default=LEDGER_VERSION, compare=False)  # as read (version 1 is rewritten)
    # key -> (shard id, source, row_start, row_stop, media) in id order, built on first use: shard(key) is
    # a dict lookup (LAION: 580,000 shards); tuples, as a frozen dataclass each costs several times more
    _index: dict[str, tuple[int, str, int, int, str]] | None = field(default=None, init=False, repr=False,
                                                                    compare=False)

    def reindex(self) -> None:
        """Call after changing ``files``."""
        self._index = None

    def _by_key(self) -> dict[str, tuple[int, str, int, int, str]]:
        if self._index is None:
            rows = sorted((sid, f["source"], start, stop, media_of(f)) for f in self.files for seg in f["segments"]
                          for sid, start, stop in _segment_rows(seg, self.samples_per_shard))
            self._index = {shard_key(r[0], self.oom_shard_count): r for r in rows}
        return self._index

    def _shard(self, key: str, row: tuple[int, str, int, int, str]) -> Shard:
        return Shard(row[0], key, row[1], row[2], row[3], row[4])

    def file_shards(self, entry: dict) -> list[Shard]:
        return [Shard(sid, shard_key(sid, self.oom_shard_count), entry["source"], start, stop, media_of(entry))
                for seg in entry["segments"] for sid, start, stop in _segment_rows(seg, self.samples_per_shard)]

    def media(self, key: str) -> str:
        """"image" or "video": what the shard's rows point at (its source file's kind)."""
        return self.shard(key).media

    @property
    def next_shard_id(self) -> int:
        return max((s["first_shard"] + s["num_shards"] for f in self.files for s in f["segments"]), default=0)

    def shards(self) -> list[Shard]:
        """Every shard, in id order (new shards come last, whichever file they are in)."""
        return [self._shard(k, r) for k, r in self._by_key().items()]

    def shard(self, key: str) -> Shard:
        row = self._by_key().get(key)
        if row is None:
            raise LedgerError(f"shard {key!r} is not in the ledger (known: {len(self._by_key())} shards)")
        return self._shard(key, row)

    def keys(self) -> list[str]:
        return list(self._by_key())

    def keys_by_media(self) -> dict[str, list[str]]:
        """``{"image": [keys], "video": [keys]}`` in id order, straight from the segments (the shard index
        and a Shard per shard cost seconds at 580,000 shards; this a tenth of one)."""
        out: dict[str, list[str]] = {"image": [], "video": []}
        width = self.oom_shard_count
        for first, n, media in sorted((seg["first_shard"], seg["num_shards"], media_of(f))
                                      for f in self.files for seg in f["segments"]):
            out[media].extend(f"{i:0{width}d}" for i in range(first, first + n))
        return out

    def partition_of(self, key: str) -> str:
        """The Dagster partition key of shard ``key``."""
        return partition_key(self.shard(key).shard_id, self.shards_per_partition, self.oom_shard_count)

    def partition_keys(self) -> list[str]:
        """Every partition holding a shard, in id order (the last block may not be full yet)."""
        if self.shards_per_partition == 1:
            return self.keys()
        return list(dict.fromkeys(partition_key(r[0], self.shards_per_partition, self.oom_shard_count)
                                  for r in self._by_key().values()))

    def partition_shards(self, key: str) -> list[str]:
        """The shards of partition ``key`` that exist, in id order."""
        if self.shards_per_partition == 1:
            return [key] if key in self._by_key() else []
        index = self._by_key()
        return [k for k in (shard_key(i, self.oom_shard_count) for i in partition_range(key)) if k in index]

    def entry(self, url: str) -> dict | None:
        return next((f for f in self.files if f["source"] == url), None)

    def to_json(self) -> bytes:
        return json.dumps({"version": LEDGER_VERSION, "samples_per_shard": self.samples_per_shard,
                           "oom_shard_count": self.oom_shard_count, "shards_per_partition": self.shards_per_partition,
                           "files": self.files}, indent=2).encode()


@dataclass(frozen=True)
class Registration:
    new_keys: list[str]
    all_keys: list[str]
    empty_sources: list[str]
    appended_sources: list[str] = field(default_factory=list)  # registered earlier, rows appended since
    partitions: list[str] = field(default_factory=list)  # every Dagster partition (shard blocks), in id order
    shards_per_partition: int = 1


@dataclass(frozen=True)
class ReshardResult:
    source: str
    invalidated: list[str]  # shards whose rows changed: copies removed, to be redone
    emptied: list[str]  # of those, the ones now past the file's end: 0 rows
    new_keys: list[str]  # rows beyond the registered ones
    rows_before: int
    rows_after: int

    def summary(self) -> str:
        """One line for people: what changed and which shards run next."""
        def listed(keys: list[str]) -> str:
            return f" ({', '.join(keys)})" if keys else ""

        return (f"re-sharded {self.source}: {self.rows_before} -> {self.rows_after} rows; "
                f"{len(self.invalidated)} shard(s) to redo{listed(self.invalidated)}"
                + (f", {len(self.emptied)} of them now empty" if self.emptied else "")
                + f", {len(self.new_keys)} new shard(s){listed(self.new_keys)}")


# ---------------------------------------------------------------- reading and writing the ledger


def media_of(entry: dict) -> str:
    # entries written before video sources existed are image files
    return entry.get("media", "image")


def shard_media(layout: Layout, keys: list[str]) -> dict[str, str]:
    """``{key: "image" | "video"}`` for ``keys``. A ledger without video files answers without building
    its shard index (a LAION-size ledger has 580,000 shards)."""
    ledger = load_ledger(layout)
    if ledger is None or all(media_of(f) == "image" for f in ledger.files):
        return dict.fromkeys(keys, "image")
    return {k: ledger.media(k) for k in keys}


def _file_from_v1(f: dict) -> dict:
    # version 1: one run of shards per file, from row 0
    segments = [{"first_shard": f["first_shard"], "num_shards": f["num_shards"], "row_start": 0,
                 "row_stop": f["rows"]}] if f["num_shards"] else []
    return {"source": f["source"], "fingerprint": f["fingerprint"], "rows": f["rows"], "columns": f["columns"],
            "digest": None, "segments": segments}


def load_ledger(layout: Layout) -> Ledger | None:
    return _parse_ledger(layout, _ledger_bytes(layout))


def _ledger_bytes(layout: Layout) -> bytes | None:
    # reads nothing but the ledger and creates nothing: safe before the lock (writes are atomic renames)
    return read_bytes(layout.ledger) if exists(layout.ledger) else None


def _parse_ledger(layout: Layout, data: bytes | None) -> Ledger | None:
    if data is None:
        return None
    raw = json.loads(data)
    version = raw.get("version", 1)
    if version not in READABLE_VERSIONS:
        raise LedgerError(f"{layout.ledger} has format version {version}; this shardprep reads versions "
                          f"{', '.join(map(str, READABLE_VERSIONS))}: a newer shardprep wrote it, upgrade shardprep")
    files = raw["files"] if version == 2 else [_file_from_v1(f) for f in raw["files"]]
    # ledgers written before shard blocks: one partition per shard
    return Ledger(raw["samples_per_shard"], raw["oom_shard_count"], files, raw.get("shards_per_partition", 1),
                  read_version=version)


def _open_ledger(cfg: DatasetConfig, layout: Layout) -> Ledger:
    """The ledger (a new empty one if there is none), checked against the config."""
    return _check_config(cfg, layout, load_ledger(layout))


def _check_config(cfg: DatasetConfig, layout: Layout, ledger: Ledger | None) -> Ledger:
    """``ledger`` (a new empty one for None), checked against the config."""
    ledger = ledger or Ledger(cfg.samples_per_shard, cfg.oom_shard_count, shards_per_partition=cfg.shards_per_partition)
    for name in ("samples_per_shard", "oom_shard_count", "shards_per_partition"):
        if getattr(ledger, name) != getattr(cfg, name):
            raise LedgerError(
                f"config field '{name}' is {getattr(cfg, name)} but the ledger at {layout.ledger} was "
                f"made with {getattr(ledger, name)}; shard ids never change, use a new output_root"
            )
    return ledger


# ---------------------------------------------------------------- checking a registered file's rows


def _digest_sha(url: str, column: str, head_rows: int, last_row: int) -> str:
    head = read_rows(url, 0, head_rows, [column])[column].to_pylist()
    if last_row < head_rows:
        last = head[last_row]
    else:
        last = read_rows(url, last_row, last_row + 1, [column])[column][0].as_py()
    h = hashlib.sha256()
    for value in [*head, last]:
        h.update(json.dumps(value, default=str).encode() + b"\n")
    return h.hexdigest()


def source_digest(url: str, rows: int, column: str) -> dict | None:
    """The digest of a file's first rows and its last registered row (see the module docstring)."""
    if rows == 0:
        return None
    head = min(rows, DIGEST_HEAD_ROWS)
    return {"column": column, "head_rows": head, "last_row": rows - 1,
            "sha256": _digest_sha(url, column, head, rows - 1)}


def _same_rows(a: pa.Table, b: pa.Table) -> bool:
    # full rows: the same columns in the same order, the same types and values (chunking aside)
    return (a.num_rows == b.num_rows and a.column_names == b.column_names
            and all(a.column(i).equals(b.column(i)) for i in range(a.num_columns)))


def _differs_from_copy(shard: Shard, layout: Layout) -> bool:
    """Whether the shard's rows in its source file now differ from its copy (source_parquet's output).
    No copy: nothing was made from the shard yet (every later asset reads the copy), so nothing to redo."""
    copy = layout.source_parquet(shard.key)
    if shard.rows == 0 or not exists(copy):
        return False
    with open_read(copy) as f:
        copied = pq.ParquetFile(f).read(use_threads=False)  # storage.read_parquet: why
    return not _same_rows(read_rows(shard.source, shard.row_start, shard.row_stop), copied)


def _rows(start: int, stop: int) -> str:
    return f"row {start}" if stop - start == 1 else f"rows {start}-{stop - 1}"


def _find_change(ledger: Ledger, entry: dict, info: SourceInfo, layout: Layout) -> str | None:
    """What changed in the registered rows of a file (None: they are all as registered, so any rows
    after them were appended). Cheap checks first; the copies locate a change to the shard."""
    if list(info.columns) != entry["columns"]:
        return f"columns changed: were {entry['columns']}, now {list(info.columns)}"
    if info.rows < entry["rows"]:
        return f"now {info.rows} rows, {entry['rows']} were registered"
    for shard in ledger.file_shards(entry):
        if _differs_from_copy(shard, layout):
            return (f"{_rows(shard.row_start, shard.row_stop)} (shard {shard.key}) changed: they differ from "
                    f"their copy {layout.source_parquet(shard.key)}")
    digest = entry.get("digest")
    if digest and _digest_sha(info.url, digest["column"], digest["head_rows"], digest["last_row"]) != digest["sha256"]:
        return (f"{_rows(0, entry['rows'])} changed: the digest of their {digest['column']!r} values "
                f"({_rows(0, digest['head_rows'])} and row {digest['last_row']}) differs from the one taken at "
                "registration")
    return None


def _extend(entry: dict, info: SourceInfo, first_shard: int, cfg: DatasetConfig) -> list[str]:
    """Give the file's rows beyond ``entry['rows']`` new shards from ``first_shard`` on (a short last
    shard stays short: appended rows never refill it) and record the file as it is now."""
    old = entry["rows"]
    n = math.ceil((info.rows - old) / cfg.samples_per_shard) if info.rows > old else 0
    if n:
        entry["segments"].append({"first_shard": first_shard, "num_shards": n, "row_start": old,
                                  "row_stop": info.rows})
    entry.update(fingerprint=info.fingerprint, rows=info.rows, columns=list(info.columns),
                 digest=source_digest(info.url, info.rows, url_column(cfg, media_of(entry))))
    return [shard_key(first_shard + i, cfg.oom_shard_count) for i in range(n)]


# ---------------------------------------------------------------- registering and re-sharding


@dataclass(frozen=True)
class _Checked:
    """The source files as checked before the ledger lock is taken (see ``_check_sources``)."""
    fingerprints: dict[str, str]  # every file's fingerprint when checked
    infos: dict[str, SourceInfo]  # the files new to the ledger or changed since registered: footers read

    def info(self, url: str, cfg: DatasetConfig, media: str) -> SourceInfo:
        # not read yet only when another process rewrote the ledger between the check and the lock
        return self.infos.get(url) or inspect_source(url, cfg, media)


def _check_media(entry: dict, url: str, media: str) -> None:
    if media_of(entry) != media:
        raise LedgerError(f"source file {url} was registered as {media_of(entry)} rows and is now named "
                          f"as {media} rows ('source' is images, 'video_source' videos); a shard's "
                          "kind never changes: use a new output_root or move the file back")


def _check_sources(cfg: DatasetConfig, files: dict[str, str], ledger: Ledger) -> _Checked:
    """Check every file against ``ledger`` as read without the lock: files new to it or changed since
    registered must be readable parquet with the configured columns. Raises on the first bad file;
    only reads, so a bad source leaves nothing under output_root (not even the lock file)."""
    known = {f["source"]: f for f in ledger.files}
    fingerprints: dict[str, str] = {}
    infos: dict[str, SourceInfo] = {}
    for url, media in files.items():
        entry = known.get(url)
        if entry is not None:
            _check_media(entry, url, media)
            fingerprints[url] = file_fingerprint(url)  # unchanged files cost one info call
            if fingerprints[url] == entry["fingerprint"]:
                continue
        infos[url] = inspect_source(url, cfg, media)
        fingerprints[url] = infos[url].fingerprint
    return _Checked(fingerprints, infos)


def _changes(cfg: DatasetConfig, files: dict[str, str], ledger: Ledger, layout: Layout, checked: _Checked,
             config_path: str | None) -> tuple[list[tuple[dict, SourceInfo]], list[tuple[SourceInfo, str]]]:
    """(entry, info) of the registered files grown since, and (info, media) of the files new to the
    ledger; raises SourceChangedError for a registered file whose registered rows changed."""
    known = {f["source"]: f for f in ledger.files}
    grown: list[tuple[dict, SourceInfo]] = []
    fresh: list[tuple[SourceInfo, str]] = []
    for url, media in files.items():
        entry = known.get(url)
        if entry is None:
            fresh.append((checked.info(url, cfg, media), media))
            continue
        _check_media(entry, url, media)
        if checked.fingerprints[url] != entry["fingerprint"]:
            info = checked.info(url, cfg, media)
            change = _find_change(ledger, entry, info, layout)
            if change:
                raise SourceChangedError(url, change, info.fingerprint, config_path)
            grown.append((entry, info))
    return grown, fresh


def register_sources(cfg: DatasetConfig, source_files: dict[str, str] | None = None, *,
                     config_path: str | None = None) -> Registration:
    """Give shard ids to source files not yet in the ledger, and to rows appended to registered ones.
    ``source_files``: ``{url: "image" | "video"}`` (default: every file ``source`` and ``video_source``
    name, ``sources.list_all_source_files``).

    Every file is checked first: if one is bad (unreadable, a column missing, rewritten or shrunk
    since registration: SourceChangedError), the ledger is left as it was and the error names the
    file. A file that is not readable parquet with the configured columns fails before the lock is
    taken, so it leaves nothing under output_root, which is not even created. ``config_path`` goes
    into the re-shard command such an error shows."""
    layout = Layout(cfg.output_root)
    files = list_all_source_files(cfg) if source_files is None else source_files
    seen = _ledger_bytes(layout)
    checked_against = _check_config(cfg, layout, _parse_ledger(layout, seen))
    checked = _check_sources(cfg, files, checked_against)
    with lock(layout.root, "ledger"):
        # the ledger is read again under the lock: another process may have registered files since
        # (kept as parsed when it did not: a LAION ledger takes a while to parse)
        now = _ledger_bytes(layout)
        ledger = checked_against if now == seen else _check_config(cfg, layout, _parse_ledger(layout, now))
        grown, fresh = _changes(cfg, files, ledger, layout, checked, config_path)  # raises before any write

        next_id, new_keys, appended, empty = ledger.next_shard_id, [], [], []
        for entry, info in grown:
            keys = _extend(entry, info, next_id, cfg)
            appended += [info.url] if keys else []
            new_keys, next_id = new_keys + keys, next_id + len(keys)
        for info, media in fresh:
            entry = {"source": info.url, "fingerprint": info.fingerprint, "rows": 0, "columns": list(info.columns),
                     "digest": None, "segments": [], **({"media": media} if media != "image" else {})}
            ledger.files.append(entry)
            keys = _extend(entry, info, next_id, cfg)
            empty += [] if keys else [info.url]
            new_keys, next_id = new_keys + keys, next_id + len(keys)
        ledger.reindex()
        if grown or fresh or ledger.read_version != LEDGER_VERSION or not exists(layout.ledger):
            write_bytes(layout.ledger, ledger.to_json())
    return Registration(new_keys, ledger.keys(), empty, appended, ledger.partition_keys(), ledger.shards_per_partition)


def _as_source_url(url: str) -> str:
    # the ledger holds sources as listed (full URLs): a plain path names the same file
    fs, path = url_to_fs(url)
    return fs.unstrip_protocol(path)


def _clamp(entry: dict, rows: int) -> None:
    """Cut the file's segments at ``rows``: a shard across the end gets shorter, shards past it empty."""
    for seg in entry["segments"]:
        seg["row_start"], seg["row_stop"] = min(seg["row_start"], rows), min(seg["row_stop"], rows)
    entry["rows"] = min(entry["rows"], rows)


def reshard_source(cfg: DatasetConfig, url: str, *,
                   on_invalidated: Callable[[list[str]], None] | None = None) -> ReshardResult:
    """Settle a registered source file that was rewritten or shrunk, keeping every shard id.

    Shards keep their row ranges; one whose rows changed (its copy differs from the file now) or that
    the file's new end cuts short is invalidated: its copy ``<root>/parquet/{shard}.parquet`` is
    removed, so it is read again. Shards past a shrunk file's end hold no rows from now on; rows past
    the registered ones become new shards. The fingerprint and digest are taken anew.

    ``on_invalidated(keys)`` runs after the ledger is written and before the copies are removed (the
    orchestration wipes the shards' materializations there): if anything stops before the copies are
    gone, running this again finds the same shards, by their copies."""
    layout = Layout(cfg.output_root)
    url = _as_source_url(url)
    with lock(layout.root, "ledger"):
        ledger = _open_ledger(cfg, layout)
        entry = ledger.entry(url)
        if entry is None:
            raise LedgerError(f"source file {url} is not in the ledger {layout.ledger}: only registered files "
                              "can be re-sharded (`shardprep run` registers new ones)")
        info = inspect_source(url, cfg, media_of(entry))
        before, rows_before = ledger.file_shards(entry), entry["rows"]
        _clamp(entry, info.rows)
        invalidated, emptied = [], []
        for old, now in zip(before, ledger.file_shards(entry)):
            if (now.row_start, now.row_stop) != (old.row_start, old.row_stop) or _differs_from_copy(now, layout):
                invalidated.append(now.key)
                emptied += [now.key] if now.rows == 0 else []
        new_keys = _extend(entry, info, ledger.next_shard_id, cfg)
        ledger.reindex()
        write_bytes(layout.ledger, ledger.to_json())
        if on_invalidated and invalidated:
            on_invalidated(invalidated)
        for key in invalidated:
            remove(layout.source_parquet(key))
    return ReshardResult(url, invalidated, emptied, new_keys, rows_before, info.rows)


__all__ = ["Ledger", "LedgerError", "Registration", "ReshardResult", "Shard", "SourceChangedError", "SourceError",
           "load_ledger", "media_of", "register_sources", "reshard_command", "reshard_source", "shard_media",
           "source_digest"]
