"""Applying takedowns to finished shards: the matching samples leave every per-shard artifact's files.

Per shard, each artifact's files are rewritten without the samples (atomically, one file at a time):

* ``image_shards`` / ``video_shards``: the tar loses the samples' members (every other member is copied
  byte for byte), the parquet row of each keeps its key and URL but becomes ``failed_to_download`` /
  ``removed: takedown`` with its caption and other columns emptied, the stats are counted again, the
  preview is drawn again from what is left;
* ``clip_embeddings``: the rows of ``img_emb``/``text_emb`` and of the metadata parquet (rows stay aligned);
* ``reordered_embeddings``: the samples' rows (row = key index) become zero rows, as a missing sample's;
* ``image_scores``: the rows of ``scores/{shard}.parquet``;
* ``captions``: the rows of ``captions/{shard}.parquet``;
* ``diffusion_samples`` / ``video_diffusion_samples``: the samples' members of the diffusion tar.

Each artifact whose stamp exists is stamped again at the same version with a new time and the new file
sizes: nothing is made again, and the global artifacts (dedup, selection, balanced tars, wdinfo,
precached encodings, energon indexes, report) see a changed shard, as they see any, and update.

The shard parquet is written last: a crash part way leaves its rows unmarked, so the next application
matches them again and finishes (every step is idempotent). Callers hold the shard's locks.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardprep import storage
from shardprep.artifacts import ARTIFACTS, PER_SHARD
from shardprep.curation import dedup
from shardprep.keys import index_of_key, oom_sample_per_shard, split_member_name
from shardprep.layout import Layout
from shardprep.takedown.lists import REMOVED, TakedownSet
from shardprep.tars import _BLOCK, _RECORD, read_headers
from shardprep.verify import file_sizes
from shardprep.versions import read_stamp, write_stamp

# the columns of a removed row that are kept: what says which sample it was and why it is gone
KEPT_COLUMNS = ("url", "key", "status", "error_message")


@dataclass
class ShardTakedown:
    shard: str
    media: str
    removed: list[dict] = field(default_factory=list)  # {"key", "url", "kind", "value", "list", "reason"}
    artifacts: dict[str, int] = field(default_factory=dict)  # artifact -> samples taken out of its files

    @property
    def keys(self) -> set[str]:
        return {r["key"] for r in self.removed}


def _parquet_url(layout: Layout, shard: str, media: str) -> str:
    return layout.shard_parquet(shard) if media == "image" else layout.video_parquet(shard)


def find_matches(layout: Layout, shard: str, media: str, takedowns: TakedownSet) -> list[dict]:
    """The rows of ``shard``'s parquet that ``takedowns`` names and that are not removed yet."""
    url = _parquet_url(layout, shard, media)
    if not takedowns or not storage.exists(url):
        return []
    with storage.open_read(url) as f:
        names = pq.ParquetFile(f).schema_arrow.names
    cols = [c for c in ("key", "url", "error_message", "sha256") if c in names]
    t = storage.read_parquet(url, cols)
    keys, urls = t.column("key").to_pylist(), t.column("url").to_pylist()
    errors = t.column("error_message").to_pylist() if "error_message" in cols else [None] * t.num_rows
    hashes = t.column("sha256").to_pylist() if "sha256" in cols else [None] * t.num_rows
    out = []
    for key, u, err, h in zip(keys, urls, errors, hashes):
        if err == REMOVED:
            continue
        hit = takedowns.match(key, u, h)
        if hit is not None:
            kind, value, version, reason = hit
            out.append({"key": key, "url": u, "kind": kind, "value": value, "list": version, "reason": reason})
    return out


# ---------------------------------------------------------------- one artifact's files


def _dropper(keys: set[str]) -> Callable[[str], bool]:
    """Whether a sample key is one of ``keys`` or made from one (a clip ``{key}_00003`` of a row key,
    a diffusion sample of a clip)."""
    def drop(key: str) -> bool:
        while True:
            if key in keys:
                return True
            head, sep, _ = key.rpartition("_")
            if not sep:
                return False
            key = head
    return drop


def filter_tar(url: str, drop: Callable[[str], bool]) -> int:
    """Rewrite the plain tar at ``url`` without the members of the samples ``drop`` names (every other
    member copied byte for byte, headers included); returns the samples dropped. No tar, or nothing to
    drop: nothing written. Nothing left: the tar is removed (as a writer leaves no empty tar)."""
    if not storage.exists(url):
        return 0
    headers, end = read_headers(url)
    keys = [(split_member_name(h.name) or (h.name, ""))[0] for h in headers]
    dropped = {k for k in keys if drop(k)}
    if not dropped:
        return 0
    kept = [h for h, k in zip(headers, keys) if k not in dropped]
    if not kept:
        storage.remove(url)
        return len(dropped)
    written = 0
    with storage.open_read(url) as src, storage.atomic_write(url) as out:
        for h in kept:
            src.seek(h.offset)
            n = h.data_offset - h.offset + h.size + (-h.size % _BLOCK)
            out.write(src.read(n))
            written += n
        tail = written + 2 * _BLOCK
        out.write(bytes(2 * _BLOCK + (-tail % _RECORD)))
    return len(dropped)


def _filter_parquet(url: str, drop: Callable[[str], bool], key_col: str) -> tuple[int, bool]:
    """Rows of ``url`` whose ``key_col`` ``drop`` names removed; (rows removed, rows left)."""
    if not storage.exists(url):
        return 0, False
    t = storage.read_parquet(url)
    mask = [not drop(k) if k is not None else True for k in t.column(key_col).to_pylist()]
    removed = mask.count(False)
    if removed:
        kept = t.filter(pa.array(mask))
        buf = io.BytesIO()
        pq.write_table(kept, buf)
        with storage.atomic_write(url) as f:
            f.write(buf.getbuffer())
    return removed, len(mask) > removed


def _embedding_rows(meta: str, arrays: tuple[str, ...], drop) -> int:
    """Rows of clip-retrieval's layout (``meta``'s ``image_path`` row for row with the npy ``arrays``)
    that ``drop`` names, removed from all of them."""
    if not storage.exists(meta):
        return 0
    keys = storage.read_parquet(meta, ["image_path"]).column("image_path").to_pylist()
    mask = np.array([not drop(k) for k in keys], dtype=bool)
    if mask.all():
        return 0
    if not mask.any():  # nothing left: no files, as write_clip_embeddings leaves for an empty shard
        for url in (*arrays, meta):
            storage.remove(url)
        return len(keys)
    for url in arrays:
        if storage.exists(url):
            storage.write_npy(url, np.ascontiguousarray(storage.read_npy(url)[mask]))
    _filter_parquet(meta, drop, "image_path")
    return int((~mask).sum())


def _embeddings(layout: Layout, shard: str, drop, **_) -> int:
    return _embedding_rows(layout.emb_metadata(shard), (layout.img_emb(shard), layout.text_emb(shard)), drop)


def _reordered(layout: Layout, shard: str, drop, keys: set[str], index_width: int, **_) -> int:
    rows = sorted(index_of_key(k, index_width) for k in keys)
    removed = 0
    for url in (layout.reordered_img(shard), layout.reordered_text(shard)):
        if not storage.exists(url):
            continue
        arr = storage.read_npy(url)
        hit = [r for r in rows if r < len(arr) and arr[r].any()]
        if hit:
            arr = np.array(arr)
            arr[hit] = 0
            storage.write_npy(url, arr)
        removed = max(removed, len(hit))
    return removed


def _scores(layout: Layout, shard: str, drop, **_) -> int:
    return _filter_parquet(layout.scores(shard), drop, "key")[0]


def _captions(layout: Layout, shard: str, drop, **_) -> int:
    return _filter_parquet(layout.captions(shard), drop, "key")[0]


def _training_text(layout: Layout, shard: str, drop, **_) -> int:
    _embedding_rows(layout.train_text_metadata(shard), (layout.train_text_emb(shard),), drop)
    return _filter_parquet(layout.training_text(shard), drop, "key")[0]


def _diffusion(layout: Layout, shard: str, drop, **_) -> int:
    return filter_tar(layout.diffusion_tar(shard), drop)


def _image_tar(layout: Layout, shard: str, drop, **_) -> int:
    n = filter_tar(layout.tar(shard), drop)
    if n:
        _preview(layout, shard, layout.tar(shard), "image")
    return n


def _video_tar(layout: Layout, shard: str, drop, **_) -> int:
    n = filter_tar(layout.video_tar(shard), drop)
    if n:
        _preview(layout, shard, layout.video_tar(shard), "video")
    return n


def _preview(layout: Layout, shard: str, tar_url: str, media: str) -> None:
    """The shard's preview drawn again from what is left (a removed sample's thumbnail must go too)."""
    from shardprep.report.contact_sheet import contact_sheet, video_contact_sheet

    out = layout.contact_sheet(shard)
    if not storage.exists(out):
        return
    if not storage.exists(tar_url):
        storage.remove(out)
        return
    try:
        png = (contact_sheet if media == "image" else video_contact_sheet)(tar_url)
    except Exception:  # noqa: BLE001 - a preview that cannot be drawn goes; it never keeps old thumbnails
        storage.remove(out)
        return
    storage.write_bytes(out, png)


# artifact -> what takes the samples out of its files (the shard parquet and stats: ``_mark_rows``, last)
REMOVERS: dict[str, Callable[..., int]] = {
    "image_shards": _image_tar,
    "video_shards": _video_tar,
    "clip_embeddings": _embeddings,
    "reordered_embeddings": _reordered,
    "image_scores": _scores,
    "captions": _captions,
    "training_text": _training_text,
    "diffusion_samples": _diffusion,
    "video_diffusion_samples": _diffusion,
}


def _mark_rows(layout: Layout, shard: str, media: str, keys: set[str]) -> None:
    """The removed rows of the shard parquet: key and URL kept, ``failed_to_download`` / ``removed:
    takedown``, every other column emptied; the stats counted again from the rows."""
    url = _parquet_url(layout, shard, media)
    t = storage.read_parquet(url)
    hit = pa.array([k in keys for k in t.column("key").to_pylist()])
    cols = []
    for name in t.column_names:
        col = t.column(name)
        if name == "status":
            col = pc.if_else(hit, pa.scalar("failed_to_download", col.type), col)
        elif name == "error_message":
            col = pc.if_else(hit, pa.scalar(REMOVED, col.type), col)
        elif name not in KEPT_COLUMNS:
            col = pc.if_else(hit, pa.scalar(None, col.type), col)
        cols.append(col)
    table = pa.Table.from_arrays(cols, schema=t.schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    with storage.atomic_write(url) as f:
        f.write(buf.getbuffer())
    stats_url = layout.shard_stats(shard) if media == "image" else layout.video_stats(shard)
    if storage.exists(stats_url):
        stats = json.loads(storage.read_bytes(stats_url))
        status = Counter(table.column("status").to_pylist())
        reasons = Counter(e if e is not None else "success" for e in table.column("error_message").to_pylist())
        stats["successes"] = status["success"]
        for name in ("failed_to_download", "failed_to_resize", "failed_to_subsample"):
            if name in stats:
                stats[name] = status[name]
        stats.update(status_dict=dict(reasons), removed_by_takedown=reasons[REMOVED], takedown_at=time.time())
        storage.write_bytes(stats_url, json.dumps(stats, indent=4).encode("utf-8"))


def takedown_shard(layout: Layout, shard: str, media: str, removed: list[dict]) -> ShardTakedown:
    """Take the samples of ``removed`` (``find_matches``' rows) out of every artifact of ``shard``."""
    from shardprep.ledger import load_ledger

    report = ShardTakedown(shard, media, removed)
    keys = report.keys
    if not keys:
        return report
    ledger = load_ledger(layout)
    index_width = oom_sample_per_shard(ledger.samples_per_shard) if ledger else 0
    drop = _dropper(keys)
    holder = "image_shards" if media == "image" else "video_shards"
    for name in PER_SHARD:
        if name not in REMOVERS or not ARTIFACTS[name].applies(media):
            continue
        report.artifacts[name] = REMOVERS[name](layout, shard, drop=drop, keys=keys, index_width=index_width)
        if name != holder:
            _restamp(layout, name, shard)
    clip = read_stamp(layout, "clip_embeddings", shard) if media == "image" else None
    if clip is not None:  # the dedup index, in place, at the embeddings' new identity (else it would start over)
        with storage.lock(layout.root, "duplicates"):
            report.artifacts["duplicates"] = dedup.remove_samples(layout, shard, keys, dedup.identity(clip))
    _mark_rows(layout, shard, media, keys)  # last: until it is written the rows match again (module doc)
    _restamp(layout, holder, shard)
    return report


def _restamp(layout: Layout, name: str, shard: str) -> None:
    stamp = read_stamp(layout, name, shard)
    if stamp is not None:  # complete as before, at its version; a new time tells the globals it changed
        write_stamp(layout, name, stamp["version"], shard, file_sizes(layout.shard_outputs(name, shard)))


# ---------------------------------------------------------------- every shard


@dataclass
class ApplyReport:
    lists: list[dict]  # every registered list: version, source, entries, new (registered by this call)
    shards: list[ShardTakedown] = field(default_factory=list)  # shards samples were taken out of
    checked: int = 0  # shards whose rows were matched (the others were checked against these lists before)
    audit: str | None = None  # the audit record written (None: nothing removed)

    @property
    def removed(self) -> int:
        return sum(len(s.removed) for s in self.shards)

    def per_artifact(self) -> dict[str, int]:
        out: Counter = Counter()
        for s in self.shards:
            out.update(s.artifacts)
        return dict(out)

    def per_list(self) -> dict[str, int]:
        return dict(Counter(r["list"] for s in self.shards for r in s.removed))


def _identity(version: str, written_at) -> str:
    return f"{version}@{written_at}"


def _shard_identities(layout: Layout) -> dict[str, str]:
    """``{shard: version@written_at}`` of the image and video shards whose download is complete."""
    from shardprep import state

    state.ensure(layout)
    out: dict[str, str] = {}
    for st in state.load(layout, ["image_shards", "video_shards"], fold_first=False).values():
        t = st.table.filter(pc.is_valid(st.table.column("version")))
        out.update({s: _identity(v, w) for s, v, w in zip(t.column("shard").to_pylist(), t.column("version").to_pylist(),
                                                     t.column("written_at").to_pylist())})
    return out


def _set_version(lists) -> str:
    import hashlib

    return hashlib.sha256(",".join(sorted(lst.version for lst in lists)).encode()).hexdigest()[:16]


def apply_lists(layout: Layout, list_urls: list[str] | tuple[str, ...] = (), *,
                locked: Callable[[str, str], object] | None = None,
                on_shard: Callable[[ShardTakedown], None] | None = None) -> ApplyReport:
    """Register the lists at ``list_urls`` and take every sample that any registered list names out of
    every finished (or half-finished) shard of the ledger. ``locked(shard, media)``: a context manager
    holding the shard's writers off while it changes (the caller's: the Dagster side's lock names);
    ``on_shard(report)`` after each shard changed. Shards already checked against the same lists, whose
    parquet has not changed since, are not read again."""
    import contextlib
    import uuid

    from shardprep.ledger import load_ledger
    from shardprep.takedown.lists import read_list, register, registered

    new = {register(layout, read_list(url), url) for url in dict.fromkeys(list_urls)}
    lists = registered(layout)
    report = ApplyReport([{"version": lst.version, "source": lst.source, "entries": len(lst.entries),
                           "registered_at": lst.registered_at, "new": lst.version in new} for lst in lists])
    ledger = load_ledger(layout)
    if not lists or ledger is None:
        return report
    takedowns = TakedownSet.of(lists)
    set_version = _set_version(lists)
    text = storage.read_text(layout.takedown_checked)
    before = json.loads(text) if text else {}
    checked = before.get("shards", {}) if before.get("set") == set_version else {}
    # which shards changed since they were checked: their image/video stamps in the state index (one table
    # read, no request per shard: LAION-5B has 580,000); a shard without a complete download is skipped,
    # its next download leaves the listed rows out
    made = _shard_identities(layout)
    for shard in ledger.keys():
        ident = made.get(shard)
        if ident is None or checked.get(shard) == ident:
            continue
        media = ledger.media(shard)
        report.checked += 1
        if find_matches(layout, shard, media, takedowns):
            with locked(shard, media) if locked is not None else contextlib.nullcontext():
                # matched again under the locks: a writer of the shard may have finished in between
                done = takedown_shard(layout, shard, media, find_matches(layout, shard, media, takedowns))
            report.shards.append(done)
            if on_shard is not None:
                on_shard(done)
            stamp = read_stamp(layout, "image_shards" if media == "image" else "video_shards", shard)
            ident = _identity(stamp["version"], stamp.get("written_at")) if stamp else None  # stamped again
        checked[shard] = ident
    if report.shards:
        report.audit = storage.join(layout.takedown_audit_dir,
                                    f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}.json")
        storage.write_bytes(report.audit, json.dumps({
            "applied_at": time.time(), "lists": report.lists, "artifacts": report.per_artifact(),
            "removed": [{"shard": s.shard, "media": s.media, **r} for s in report.shards for r in s.removed],
        }, indent=1).encode("utf-8"))
    storage.write_bytes(layout.takedown_checked, json.dumps({"set": set_version, "shards": checked}).encode())
    return report
