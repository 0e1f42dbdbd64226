"""Megatron-Energon index of a webdataset folder, as ``energon prepare`` writes it, but incremental.

Under ``dataset_dir`` (see reference formats.md §7.1):

* ``{tar}.idx`` beside each tar: native-endian uint64 offsets of each sample's first header, plus the
  end offset of the last sample (``count + 1`` values), energon's ``TarIndexWriter`` format.
* ``.nv-meta/.info.json`` (energon 7: ``energon_version`` + ``shard_counts``) and ``.info.yaml``
  (``shard_counts`` only: energon <= 5.x, NeMo's pin 5.2, reads just this file and parses strictly).
* ``.nv-meta/split.yaml``: ``split_parts: {train: [...], val: [...], test: [...]}``, ``exclude: []``.
* ``.nv-meta/dataset.yaml``: ``CaptioningSample`` + ``field_map`` ("captioning") or
  ``CrudeWebdataset`` ("crude", cooked by a task encoder).
* ``.nv-meta/index.sqlite`` with energon 7's schema (``samples``, ``sample_parts`` and their indexes)
  and ``.nv-meta/index.uuid`` (a new uuid4 whenever the sqlite changes).
* ``.nv-meta/shardprep_index.json``: our bookkeeping (size + mtime, count and split of each indexed
  tar, the split rule, the uuid and sqlite size written), so an update scans only new or changed tars.

Tar scanning is energon's (``flavors/webdataset/prepare.py``): regular members only, names matching
``__*__`` skipped, key = path up to the basename's first dot (``000..pth`` is key ``000``, part
``.pth``), consecutive members with one key form a sample. Energon aborts on a key present in two
tars (or twice in one tar) and on a tar without samples; here both raise ``ValueError`` naming the
tar(s) and key before anything is written.

Tar order (= energon's ``tar_file_id``): already indexed tars keep their position, new tars are
appended in sorted order, so existing sqlite rows and ``.tar.idx`` files stay valid and untouched.
A listed tar whose size or mtime changed is rescanned in place; a tar no longer listed loses its rows
(later tars move up). If the sqlite is not the one we wrote last (a crash mid-update, or an
``energon prepare`` since: checked via ``index.uuid`` and ``PRAGMA user_version``), every tar is
rescanned; ``.tar.idx`` files whose bytes come out the same are not rewritten.

Split rule (stable under updates). With ``split_patterns`` ({split: [regex, ...]}, ``re.match`` on
the tar path, like ``energon prepare --split-parts``) a tar goes to every split whose pattern matches.
With ``split_ratio`` (train, val, test; normalised) a tar keeps the split it was given before; a new
tar ``t`` goes by ``u = sha256(t)`` read as a fraction in [0, 1): train if ``u < r_train``, val if
``u < r_train + r_val``, else test. Then every split with a ratio > 0 that is still empty takes one
tar (a new one if possible; the one whose ``u`` is nearest to the split's interval) from the largest
split, as long as that split keeps at least one; so with a val ratio > 0 and >= 2 tars, val is never
empty. Changing the ratio or the patterns re-splits every tar.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import sqlite3
import struct
import tarfile
import tempfile
import uuid as uuid_mod
from array import array
from dataclasses import dataclass, field

import yaml

from shardprep.balanced import INCOMPLETE_SUFFIX
from shardprep.keys import is_meta_member, split_member_name
from shardprep.storage import atomic_write, is_local, url_to_fs

META_DIR = ".nv-meta"
INFO_JSON = ".info.json"
INFO_YAML = ".info.yaml"
SPLIT_YAML = "split.yaml"
DATASET_YAML = "dataset.yaml"
INDEX_SQLITE = "index.sqlite"
INDEX_UUID = "index.uuid"
STATE_JSON = "shardprep_index.json"
STATE_VERSION = 1
SPLIT_NAMES = ("train", "val", "test")
ENERGON_FORMAT_VERSION = "7.4.1"  # the energon release whose on-disk format this mirrors

# energon's megatron/energon/flavors/webdataset/config.py

SAMPLE_TYPES = ("captioning", "crude")
DEFAULT_FIELD_MAP = {"image": "jpg", "caption": "txt"}

# energon 7.4's SqliteIndexWriter schema
_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS samples (
        tar_file_id INTEGER NOT NULL,
        sample_key TEXT NOT NULL UNIQUE,
        sample_index INTEGER NOT NULL,
        byte_offset INTEGER,
        byte_size INTEGER
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS sample_parts (
        tar_file_id INTEGER,
        sample_index INTEGER,
        part_name TEXT,
        content_byte_offset INTEGER,
        content_byte_size INTEGER
    )
    """,
)
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, "
    "content_byte_offset, content_byte_size)",
)
_BATCH = 4096


@dataclass
class IndexReport:
    dataset_dir: str
    tars: list[str]  # in energon's tar_file_id order
    shard_counts: dict[str, int]
    splits: dict[str, list[str]]
    scanned_tars: list[str]  # new or changed tars read by this call
    kept_tars: list[str]  # indexed before and unchanged: .tar.idx and sqlite rows kept
    changed_tars: list[str]  # indexed before, changed on disk (size/mtime): rescanned
    removed_tars: list[str]  # indexed before, no longer listed (their .tar.idx files are left in place)
    total_samples: int
    uuid: str
    index_changed: bool  # sqlite rows changed (a new index.uuid)
    files_written: list[str] = field(default_factory=list)


@dataclass
class _Scan:
    name: str
    size: int
    mtime: str
    offsets: array  # count + 1 values
    keys: list[str]
    parts: list[tuple[int, str, int, int]]  # (sample_index, part_name, data offset, data size)


# ---------------------------------------------------------------- small helpers


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def _stat(fs, path: str) -> tuple[int, str]:
    """(size, modification stamp) of a file; the stamp only needs to change when the file does."""
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        st = os.stat(path)
        return st.st_size, str(st.st_mtime_ns)
    info = fs.info(path)
    stamp = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("ETag") or ""
    return int(info["size"]), str(stamp)


def _read_text(url: str) -> str | None:
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        return f.read().decode("utf-8")


def _write_if_changed(url: str, data: bytes, written: list[str]) -> None:
    fs, path = url_to_fs(url)
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            if f.read() == data:
                return
    with atomic_write(url) as f:
        f.write(data)
    written.append(url)


def _hash_fraction(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def collapse_names(names: list[str]) -> list[str]:
    """Brace-collapse runs of consecutive zero-padded numbers (``{00000..00002}.tar``), keeping order.

    Like energon's ``bracecollapse.collapse(..., keep_order=True)`` for the names shardprep writes;
    readers brace-expand split entries, and a name without a run is kept as is.
    """
    num_re = re.compile(r"^(.*?)(\d+)(\.tar)$")
    out: list[str] = []
    run: list[tuple[str, str, int, int]] = []  # (prefix, suffix, width, number)

    def flush() -> None:
        if not run:
            return
        p, s, w, first = run[0]
        last = run[-1][3]
        out.append(f"{p}{first:0{w}d}{s}" if len(run) == 1 else f"{p}{{{first:0{w}d}..{last:0{w}d}}}{s}")
        run.clear()

    for name in names:
        m = num_re.match(name)
        if m is None or "{" in name or "}" in name or "," in name:
            flush()
            out.append(name)
            continue
        p, digits, s = m.groups()
        cur = (p, s, len(digits), int(digits))
        if run and (run[-1][0], run[-1][1], run[-1][2]) == cur[:3] and run[-1][3] + 1 == cur[3]:
            run.append(cur)
        else:
            flush()
            run.append(cur)
    flush()
    return out


# ---------------------------------------------------------------- tar discovery and scanning


def find_tars(dataset_dir: str, *, skip_incomplete: bool = True) -> list[str]:
    """``**/*.tar`` under ``dataset_dir``, relative and sorted, like ``energon prepare``'s glob.

    Hidden files/folders (``.nv-meta``, atomic-write temps) are skipped, and so are tars with an
    ``.INCOMPLETE`` sidecar unless ``skip_incomplete=False``.
    """
    fs, root = url_to_fs(dataset_dir)
    root = root.rstrip("/")
    found = {posixpath.relpath(p, root) for p in fs.find(root)}
    return sorted(
        rel for rel in found
        if rel.endswith(".tar") and not any(part.startswith(".") for part in rel.split("/"))
        and not (skip_incomplete and rel + INCOMPLETE_SUFFIX in found)
    )


def scan_tar(dataset_dir: str, rel: str) -> _Scan:
    """Read one tar's headers into energon's index rows (offsets, keys, parts), as energon's
    ``_preprocess_tar`` does: same members, same key/part split, same offsets."""
    url = _join(dataset_dir, rel)
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        raise FileNotFoundError(f"{url}: tar listed for indexing does not exist")
    size, mtime = _stat(fs, path)
    offsets = array("Q")
    keys: list[str] = []
    seen: set[str] = set()
    parts: list[tuple[int, str, int, int]] = []
    with fs.open(path, "rb") as f:
        try:
            with tarfile.open(fileobj=f, mode="r:*") as tar:
                for member in tar:  # headers only; payloads are skipped by seeking
                    if not member.isreg() or member.name is None or is_meta_member(member.name):
                        continue
                    split = split_member_name(member.name)
                    if split is None:
                        continue
                    key, part = split
                    if not keys or key != keys[-1]:
                        if key in seen:
                            raise ValueError(f"{url}: duplicate sample key {key!r} (its members are not "
                                             "contiguous); energon prepare aborts on duplicate keys")
                        seen.add(key)
                        offsets.append(member.offset)  # first header of the sample (incl. PAX/GNU ones)
                        keys.append(key)
                    parts.append((len(keys) - 1, part, member.offset_data, member.size))
                offsets.append(tar.offset)  # end of the last member, energon's final entry
        except tarfile.TarError as e:
            raise ValueError(f"{url}: not a readable tar ({e})") from e
    if not keys:
        raise ValueError(f"{url}: tar has no samples; energon prepare aborts on a 0-sample shard "
                         "(leave it out of the dataset)")
    return _Scan(rel, size, mtime, offsets, keys, parts)


# ---------------------------------------------------------------- splits


def _normalised_ratio(split_ratio) -> tuple[float, float, float]:
    r = tuple(float(x) for x in split_ratio)
    if len(r) != 3 or any(x < 0 for x in r) or sum(r) <= 0:
        raise ValueError(f"split_ratio must be 3 non-negative numbers (train, val, test) with a positive sum, "
                         f"got {split_ratio!r}")
    total = sum(r)
    return tuple(x / total for x in r)  # type: ignore[return-value]


def assign_splits(tars: list[str], ratio: tuple[float, float, float] | None,
                  patterns: dict[str, list[str]] | None,
                  previous: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """``{split: [tars in order]}`` by the module's split rule; ``previous`` = tar -> splits to keep."""
    if patterns is not None:
        compiled = {split: [re.compile(p) for p in pats] for split, pats in patterns.items()}
        return {split: [t for t in tars if any(c.match(t) for c in cs)] for split, cs in compiled.items()}
    assert ratio is not None
    previous = previous or {}
    bounds = []
    acc = 0.0
    for r in ratio:
        bounds.append((acc, acc + r))
        acc += r
    where: dict[str, str] = {}
    for t in tars:
        old = previous.get(t)
        if old:
            where[t] = old[0]
            continue
        u = _hash_fraction(t)
        where[t] = next((SPLIT_NAMES[i] for i, (_, hi) in enumerate(bounds) if u < hi and ratio[i] > 0),
                        next(SPLIT_NAMES[i] for i in reversed(range(3)) if ratio[i] > 0))

    def members(split: str) -> list[str]:
        return [t for t in tars if where[t] == split]

    for i, split in enumerate(SPLIT_NAMES):
        if ratio[i] <= 0 or members(split):
            continue
        donors = sorted((s for s in SPLIT_NAMES if s != split and len(members(s)) > 1),
                        key=lambda s: -len(members(s)))
        if not donors:
            continue
        pool = members(donors[0])
        fresh = [t for t in pool if t not in previous]
        lo, hi = bounds[i]

        def distance(t: str) -> float:
            u = _hash_fraction(t)
            return 0.0 if lo <= u < hi else min(abs(u - lo), abs(u - hi))

        where[min(fresh or pool, key=lambda t: (distance(t), t))] = split
    return {split: members(split) for split in SPLIT_NAMES}


# ---------------------------------------------------------------- sqlite


def _create_schema(db: sqlite3.Connection) -> None:
    for stmt in _SCHEMA:
        db.execute(stmt)


def _insert_scan(db: sqlite3.Connection, tar_id: int, scan: _Scan, names: list[str], dataset_dir: str) -> None:
    rows = [(tar_id, key, i, scan.offsets[i], scan.offsets[i + 1] - scan.offsets[i]) for i, key in enumerate(scan.keys)]
    for start in range(0, len(rows), _BATCH):
        batch = rows[start:start + _BATCH]
        db.execute("SAVEPOINT shardprep_batch")
        try:
            db.executemany("INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset, byte_size) "
                           "VALUES (?, ?, ?, ?, ?)", batch)
            db.execute("RELEASE SAVEPOINT shardprep_batch")
        except sqlite3.IntegrityError:
            # executemany keeps the rows before the failing one: undo them, then find the older holder
            db.execute("ROLLBACK TO SAVEPOINT shardprep_batch")
            db.execute("RELEASE SAVEPOINT shardprep_batch")
            for row in batch:
                hit = db.execute("SELECT tar_file_id FROM samples WHERE sample_key = ?", (row[1],)).fetchone()
                if hit is not None:
                    raise ValueError(
                        f"duplicate sample key {row[1]!r}: in {_join(dataset_dir, scan.name)} and in "
                        f"{_join(dataset_dir, names[hit[0]])}; energon needs keys unique across the dataset "
                        "(energon prepare aborts)") from None
            raise
    db.executemany("INSERT INTO sample_parts (tar_file_id, sample_index, part_name, content_byte_offset, "
                   "content_byte_size) VALUES (?, ?, ?, ?, ?)", ((tar_id, *p) for p in scan.parts))


def _idx_from_sqlite(db: sqlite3.Connection, tar_id: int) -> bytes:
    rows = db.execute("SELECT byte_offset, byte_size FROM samples WHERE tar_file_id = ? ORDER BY sample_index",
                      (tar_id,)).fetchall()
    offsets = array("Q", [r[0] for r in rows] + [rows[-1][0] + rows[-1][1]])
    return offsets.tobytes()


# ---------------------------------------------------------------- state


def _load_state(dataset_dir: str) -> dict | None:
    text = _read_text(_join(dataset_dir, META_DIR, STATE_JSON))
    if text is None:
        return None
    raw = json.loads(text)
    return raw if raw.get("version") == STATE_VERSION else None


def _sqlite_generation(path: str) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def _load_trusted_sqlite(dataset_dir: str, state: dict | None, dest: str) -> bool:
    """Copy the existing sqlite to ``dest`` if our state describes it; False means: rebuild from scratch.

    Trusted only when ``index.uuid`` is the uuid we wrote last and the sqlite carries our generation
    number (``PRAGMA user_version``, which energon never sets): a crash mid-update or a later
    ``energon prepare`` (new uuid) breaks one of the two.
    """
    if state is None or not state.get("uuid"):
        return False
    current_uuid = _read_text(_join(dataset_dir, META_DIR, INDEX_UUID))
    if current_uuid is None or current_uuid.strip() != state["uuid"]:
        return False
    fs, sqlite_path = url_to_fs(_join(dataset_dir, META_DIR, INDEX_SQLITE))
    if not fs.exists(sqlite_path):
        return False
    fs.get_file(sqlite_path, dest)
    if _sqlite_generation(dest) != state.get("generation"):
        os.remove(dest)
        return False
    return True


def _dataset_definition(sample_type: str, field_map: dict | None) -> dict:
    if sample_type == "captioning":
        return {"sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
                "field_map": dict(field_map or DEFAULT_FIELD_MAP)}
    if field_map:
        raise ValueError("field_map applies to sample_type='captioning' only; crude samples are cooked by a "
                         "task encoder")
    return {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}


def _energon_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-energon")
    except Exception:  # noqa: BLE001 - energon is optional for writing its format
        return ENERGON_FORMAT_VERSION


# ---------------------------------------------------------------- main entry point


def update_energon_index(dataset_dir: str, *, sample_type: str, field_map: dict | None = None,
                         split_ratio: tuple[float, float, float] = (1.0, 0.0, 0.0),
                         split_patterns: dict[str, list[str]] | None = None,
                         tars: list[str] | None = None) -> IndexReport:
    """Create or update ``dataset_dir/.nv-meta`` and the ``.tar.idx`` files (see the module doc).

    ``tars``: tar paths relative to ``dataset_dir`` to index (default: ``find_tars``, i.e. every
    ``**/*.tar`` without an ``.INCOMPLETE`` sidecar). Nothing is written if a tar is unreadable,
    has no samples or repeats a key.
    """
    if sample_type not in SAMPLE_TYPES:
        raise ValueError(f"sample_type must be one of {SAMPLE_TYPES}, got {sample_type!r}")
    definition = _dataset_definition(sample_type, field_map)
    ratio = None if split_patterns is not None else _normalised_ratio(split_ratio)
    if split_patterns is not None:
        if not split_patterns or any(isinstance(v, str) or not v for v in split_patterns.values()):
            raise ValueError(f"split_patterns must map split names to non-empty lists of regexes, got {split_patterns!r}")
        for split, pats in split_patterns.items():
            for p in pats:
                try:
                    re.compile(p)
                except re.error as e:
                    raise ValueError(f"split_patterns[{split!r}]: bad regex {p!r} ({e})") from e
    split_rule = {"patterns": split_patterns} if split_patterns is not None else {"ratio": list(ratio)}

    if tars is None:
        tars = find_tars(dataset_dir)
    wanted = []
    for t in tars:
        rel = posixpath.normpath(t)
        if rel.startswith("/") or rel.startswith("..") or not rel.endswith(".tar"):
            raise ValueError(f"tar path {t!r} must be a .tar relative to {dataset_dir}")
        if rel not in wanted:
            wanted.append(rel)
    if not wanted:
        raise ValueError(f"{dataset_dir}: no tars to index (energon cannot load an empty dataset)")

    fs, root = url_to_fs(dataset_dir)
    root = root.rstrip("/")
    meta = _join(dataset_dir, META_DIR)
    sqlite_url = _join(meta, INDEX_SQLITE)
    state = _load_state(dataset_dir)
    written: list[str] = []
    build_dir = tempfile.mkdtemp(prefix="shardprep-energon-")
    try:
        tmp_sqlite = os.path.join(build_dir, INDEX_SQLITE)
        trusted = _load_trusted_sqlite(dataset_dir, state, tmp_sqlite)
        old_entries = {e["name"]: e for e in state["tars"]} if trusted else {}
        old_order = [e["name"] for e in state["tars"]] if trusted else []

        # indexed tars keep their position (tar_file_id) even when changed on disk; new ones go last
        staying = [n for n in old_order if n in wanted]
        kept = [n for n in staying if fs.exists(f"{root}/{n}")
                and _stat(fs, f"{root}/{n}") == (old_entries[n]["size"], old_entries[n]["mtime"])]
        kept_set = set(kept)
        changed = [n for n in staying if n not in kept_set]
        dropped = [n for n in old_order if n not in wanted]
        removed = dropped + changed  # their old sqlite rows go
        known = set(old_order)
        order = staying + sorted(t for t in wanted if t not in known)
        ids = {name: i for i, name in enumerate(order)}

        scans = [scan_tar(dataset_dir, name) for name in order if name not in kept_set]  # raises before any write
        index_changed = bool(scans or removed)
        generation = state.get("generation") if trusted else None

        db = sqlite3.connect(tmp_sqlite)
        try:
            _create_schema(db)
            old_ids = {name: i for i, name in enumerate(old_order)}
            gone = [old_ids[n] for n in removed]
            if gone:
                marks = ",".join("?" * len(gone))
                db.execute(f"DELETE FROM samples WHERE tar_file_id IN ({marks})", gone)
                db.execute(f"DELETE FROM sample_parts WHERE tar_file_id IN ({marks})", gone)
            moves = [(old_ids[n], ids[n]) for n in kept if old_ids[n] != ids[n]]
            if moves:
                for table in ("samples", "sample_parts"):
                    # through negative ids, so a moved tar never collides with one not yet moved
                    for old_id, new_id in moves:
                        db.execute(f"UPDATE {table} SET tar_file_id = ? WHERE tar_file_id = ?", (-1 - new_id, old_id))
                    db.execute(f"UPDATE {table} SET tar_file_id = -1 - tar_file_id WHERE tar_file_id < 0")
            for scan in scans:
                _insert_scan(db, ids[scan.name], scan, order, dataset_dir)
            for stmt in _INDEXES:
                db.execute(stmt)
            if index_changed or generation is None:
                generation = int.from_bytes(os.urandom(4), "big") & 0x7FFFFFFF or 1
                db.execute(f"PRAGMA user_version = {generation}")
            counts = dict(db.execute("SELECT tar_file_id, COUNT(*) FROM samples GROUP BY tar_file_id").fetchall())
            # kept tars whose .tar.idx went missing get it back from their sqlite rows, without a rescan
            restore = {n: _idx_from_sqlite(db, ids[n]) for n in kept if not fs.exists(f"{root}/{n}.idx")}
            db.commit()
        finally:
            db.close()
        shard_counts = {name: int(counts.get(ids[name], 0)) for name in order}

        # Publication order keeps every intermediate state loadable or detectably stale:
        # 1. per-tar indexes of new tars (existing ones stay byte-identical)
        for scan in scans:
            _write_if_changed(_join(dataset_dir, scan.name + ".idx"), scan.offsets.tobytes(), written)
        for name, data in restore.items():
            _write_if_changed(_join(dataset_dir, name + ".idx"), data, written)
        # 2. the sqlite, when its rows changed (then also a new index.uuid, below)
        new_uuid = state["uuid"] if trusted and not index_changed else str(uuid_mod.uuid4())
        if index_changed or not trusted:
            if is_local(dataset_dir):
                os.makedirs(f"{root}/{META_DIR}", exist_ok=True)
                staged = f"{root}/{META_DIR}/.{INDEX_SQLITE}.tmp-{uuid_mod.uuid4().hex[:12]}"
                shutil.copyfile(tmp_sqlite, staged)
                os.replace(staged, f"{root}/{META_DIR}/{INDEX_SQLITE}")  # sqlite needs a real file: same-dir rename
            else:
                with atomic_write(sqlite_url) as f, open(tmp_sqlite, "rb") as src:
                    shutil.copyfileobj(src, f)
            written.append(sqlite_url)
        # 3. info before split: a split entry must always name a tar that info counts
        _write_if_changed(_join(meta, INFO_JSON), json.dumps(
            {"energon_version": _energon_version(), "shard_counts": shard_counts}, indent=2).encode("utf-8"), written)
        _write_if_changed(_join(meta, INFO_YAML), yaml.dump({"shard_counts": shard_counts}).encode("utf-8"), written)

        previous = None
        if state is not None and state.get("split_rule") == split_rule:
            previous = {e["name"]: e["split"] for e in state["tars"] if e["name"] in ids}
        splits = assign_splits(order, ratio, split_patterns, previous)
        split_doc = {"split_parts": {s: collapse_names(v) for s, v in splits.items()}, "exclude": []}
        _write_if_changed(_join(meta, SPLIT_YAML), yaml.dump(split_doc, sort_keys=False).encode("utf-8"), written)
        _write_if_changed(_join(meta, DATASET_YAML), yaml.dump(definition, sort_keys=False).encode("utf-8"), written)
        # 4. uuid, then our state: until both are written the next call does not trust the sqlite
        _write_if_changed(_join(meta, INDEX_UUID), new_uuid.encode("utf-8"), written)
        stats = {s.name: (s.size, s.mtime) for s in scans}
        tar_entries = []
        for name in order:
            size, mtime = stats[name] if name in stats else (old_entries[name]["size"], old_entries[name]["mtime"])
            tar_entries.append({"name": name, "size": size, "mtime": mtime, "count": shard_counts[name],
                                "split": [s for s, members in splits.items() if name in members]})
        new_state = {"version": STATE_VERSION, "uuid": new_uuid, "generation": generation,
                     "split_rule": split_rule, "sample_type": sample_type, "tars": tar_entries}
        _write_if_changed(_join(meta, STATE_JSON), json.dumps(new_state, indent=1).encode("utf-8"), written)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)

    return IndexReport(dataset_dir=dataset_dir, tars=order, shard_counts=shard_counts, splits=splits,
                       scanned_tars=[s.name for s in scans], kept_tars=kept,
                       changed_tars=changed, removed_tars=dropped,
                       total_samples=sum(shard_counts.values()), uuid=new_uuid, index_changed=index_changed,
                       files_written=written)


def read_tar_idx(url: str) -> list[int]:
    """The offsets of a ``.tar.idx`` file (for checks and tools)."""
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        data = f.read()
    return list(struct.unpack(f"{len(data) // 8}Q", data))
