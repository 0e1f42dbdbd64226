"""``update_energon_index``: scan the new or changed tars, update the sqlite, then publish every file in
an order that keeps each intermediate state loadable or detectably stale."""

from __future__ import annotations

import json
import os
import posixpath
import sqlite3
import tempfile
import uuid as uuid_mod
from dataclasses import dataclass, field

from shardprep import storage
from shardprep.energon import format as fmt
from shardprep.energon.format import EnergonIndexError, dataset_definition
from shardprep.energon.scan import TarScan, scan_tar
from shardprep.energon.splits import assign_splits, check_patterns, collapse_names, normalised_ratio
from shardprep.energon.sqlite_index import (
    create_indexes,
    create_schema,
    drop_tars,
    idx_from_sqlite,
    insert_scan,
    load_trusted_sqlite,
    move_tars,
    new_generation,
)
from shardprep.tars import list_tars


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
    excluded: int = 0  # split.yaml exclude entries (samples or whole tars a selection leaves out)


@dataclass
class _Plan:
    """The tar order (energon's ``tar_file_id``) and how it differs from the trusted index."""

    order: list[str]
    kept: list[str]  # indexed before and unchanged on disk
    changed: list[str]  # indexed before, changed on disk: rescanned in place
    dropped: list[str]  # indexed before, no longer wanted
    old_order: list[str]
    old_entries: dict[str, dict]

    @property
    def ids(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.order)}

    @property
    def removed(self) -> list[str]:
        """Tars whose old sqlite rows go."""
        return self.dropped + self.changed


def update_energon_index(dataset_dir: str, *, sample_type: str, field_map: dict | None = None,
                         split_ratio: tuple[float, float, float] = (1.0, 0.0, 0.0),
                         split_patterns: dict[str, list[str]] | None = None,
                         tars: list[str] | None = None, exclude: list[str] | None = None) -> IndexReport:
    """Create or update ``dataset_dir/.nv-meta`` and the ``.tar.idx`` files (see the package doc).

    ``exclude``: split.yaml's ``exclude`` list, ``"<tar>"`` or ``"<tar>/<key>"`` entries (the samples a
    curation selection drops); energon's loader skips them, the index itself is unchanged.

    ``tars``: tar paths relative to ``dataset_dir`` to index (default: ``find_tars``, i.e. every
    ``**/*.tar`` without an ``.INCOMPLETE`` sidecar). Nothing is written if a tar is unreadable,
    has no samples or repeats a key.
    """
    definition = dataset_definition(sample_type, field_map)
    ratio, split_rule = _split_rule(split_ratio, split_patterns)
    wanted = _wanted_tars(dataset_dir, tars)
    state = _load_state(dataset_dir)
    written: list[str] = []
    with tempfile.TemporaryDirectory(prefix="shardprep-energon-") as build_dir:
        tmp_sqlite = os.path.join(build_dir, fmt.INDEX_SQLITE)
        trusted = load_trusted_sqlite(dataset_dir, state, tmp_sqlite)
        plan = _plan(dataset_dir, wanted, state if trusted else None)
        kept = set(plan.kept)
        scans = [scan_tar(dataset_dir, name) for name in plan.order if name not in kept]  # raises before any write
        index_changed = bool(scans or plan.removed)
        keep_generation = state["generation"] if trusted and not index_changed else None
        generation, restore = _update_sqlite(tmp_sqlite, dataset_dir, plan, scans, keep_generation)
        # the rows of a kept tar are the ones its state entry counted
        scanned = {s.name: len(s.keys) for s in scans}
        shard_counts = {name: scanned[name] if name in scanned else plan.old_entries[name]["count"]
                        for name in plan.order}

        # 1. per-tar indexes of new tars (existing ones stay byte-identical)
        for name, data in [(s.name, s.offsets.tobytes()) for s in scans] + list(restore.items()):
            _write_if_changed(storage.join(dataset_dir, name + ".idx"), data, written)
        # 2. the sqlite, when its rows changed (then also a new index.uuid, below)
        new_uuid = state["uuid"] if trusted and not index_changed else str(uuid_mod.uuid4())
        if index_changed or not trusted:
            sqlite_url = _meta(dataset_dir, fmt.INDEX_SQLITE)
            storage.publish_file(tmp_sqlite, sqlite_url)
            written.append(sqlite_url)
    # 3. info before split: a split entry must always name a tar that info counts
    splits = _publish_documents(dataset_dir, shard_counts, plan.order, ratio, split_patterns,
                                _previous_splits(state, split_rule, plan.order), definition, written, exclude)
    # 4. uuid, then our state: until both are written the next call does not trust the sqlite
    _write_if_changed(_meta(dataset_dir, fmt.INDEX_UUID), new_uuid.encode("utf-8"), written)
    _publish_state(dataset_dir, {"version": fmt.STATE_VERSION, "uuid": new_uuid, "generation": generation,
                                 "split_rule": split_rule, "sample_type": sample_type,
                                 "tars": _state_entries(plan, scans, shard_counts, splits)}, written)
    return IndexReport(dataset_dir=dataset_dir, tars=plan.order, shard_counts=shard_counts, splits=splits,
                       scanned_tars=[s.name for s in scans], kept_tars=plan.kept,
                       changed_tars=plan.changed, removed_tars=plan.dropped,
                       total_samples=sum(shard_counts.values()), uuid=new_uuid, index_changed=index_changed,
                       files_written=written, excluded=len(exclude or []))


# ---------------------------------------------------------------- arguments


def _split_rule(split_ratio, split_patterns) -> tuple[tuple[float, float, float] | None, dict]:
    """(normalised ratio or None, the rule as recorded in our state)."""
    if split_patterns is not None:
        check_patterns(split_patterns)
        return None, {"patterns": split_patterns}
    ratio = normalised_ratio(split_ratio)
    return ratio, {"ratio": list(ratio)}


def _wanted_tars(dataset_dir: str, tars: list[str] | None) -> list[str]:
    """The tars to index, normalised and deduplicated, in the order given (default: ``list_tars``)."""
    wanted: list[str] = []
    for t in list_tars(dataset_dir) if tars is None else tars:
        rel = posixpath.normpath(t)
        if rel.startswith("/") or rel.startswith("..") or not rel.endswith(".tar"):
            raise EnergonIndexError(f"tar path {t!r} must be a .tar relative to {dataset_dir}")
        if rel not in wanted:
            wanted.append(rel)
    if not wanted:
        raise EnergonIndexError(f"{dataset_dir}: no tars to index (energon cannot load an empty dataset)")
    return wanted


# ---------------------------------------------------------------- state and plan


def _meta(dataset_dir: str, name: str) -> str:
    return storage.join(dataset_dir, fmt.META_DIR, name)


def _load_state(dataset_dir: str) -> dict | None:
    text = storage.read_text(_meta(dataset_dir, fmt.STATE_JSON))
    if text is None:
        return None
    raw = json.loads(text)
    return raw if raw.get("version") == fmt.STATE_VERSION else None


def _unchanged(dataset_dir: str, entry: dict) -> bool:
    try:
        return storage.stat(storage.join(dataset_dir, entry["name"])) == (entry["size"], entry["mtime"])
    except FileNotFoundError:
        return False


def _plan(dataset_dir: str, wanted: list[str], state: dict | None) -> _Plan:
    """Indexed tars keep their position (``tar_file_id``) even when changed on disk; new ones go last,
    sorted. ``state`` None: nothing indexed is trusted."""
    old_entries = {e["name"]: e for e in state["tars"]} if state else {}
    old_order = [e["name"] for e in state["tars"]] if state else []
    wanted_set = set(wanted)
    staying = [n for n in old_order if n in wanted_set]
    kept = [n for n in staying if _unchanged(dataset_dir, old_entries[n])]
    kept_set = set(kept)
    changed = [n for n in staying if n not in kept_set]
    dropped = [n for n in old_order if n not in wanted_set]
    order = staying + sorted(wanted_set - set(old_order))
    return _Plan(order, kept, changed, dropped, old_order, old_entries)


def _update_sqlite(path: str, dataset_dir: str, plan: _Plan, scans: list[TarScan],
                   generation: int | None) -> tuple[int, dict[str, bytes]]:
    """Apply ``plan`` and ``scans`` to the local sqlite at ``path``; returns its generation (a new one
    unless ``generation`` is kept) and the ``.tar.idx`` bytes of kept tars whose ``.tar.idx`` went
    missing or was cut short (rebuilt from their rows, without a rescan)."""
    ids = plan.ids
    old_ids = {name: i for i, name in enumerate(plan.old_order)}
    db = sqlite3.connect(path)
    try:
        # a local build copy: published (and fsynced) by publish_file, so no journal or fsync of its own
        db.execute("PRAGMA synchronous = OFF")
        db.execute("PRAGMA journal_mode = MEMORY")
        create_schema(db)
        drop_tars(db, [old_ids[n] for n in plan.removed])
        move_tars(db, [(old_ids[n], ids[n]) for n in plan.kept if old_ids[n] != ids[n]])
        for scan in scans:
            insert_scan(db, ids[scan.name], scan, plan.order, dataset_dir)
        create_indexes(db)
        if generation is None:
            generation = new_generation(db)
        restore = {n: idx_from_sqlite(db, ids[n]) for n in plan.kept
                   if not _idx_whole(dataset_dir, n, plan.old_entries[n]["count"])}
        db.commit()
    finally:
        db.close()
    return generation, restore


def _idx_whole(dataset_dir: str, name: str, count: int) -> bool:
    # a kept tar's .tar.idx that went missing or was cut short is rebuilt from its rows: one offset per
    # sample and the end, 8 bytes each (the size is all a stat gives, and all a truncation changes)
    try:
        return storage.stat(storage.join(dataset_dir, name + ".idx"))[0] == 8 * (count + 1)
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------- publication


def _write_if_changed(url: str, data: bytes, written: list[str]) -> None:
    if storage.exists(url) and storage.read_bytes(url) == data:
        return
    storage.write_bytes(url, data)
    written.append(url)


def _previous_splits(state: dict | None, split_rule: dict, order: list[str]) -> dict[str, list[str]] | None:
    """tar -> splits recorded under the same rule (a changed rule re-splits every tar)."""
    if state is None or state.get("split_rule") != split_rule:
        return None
    listed = set(order)
    return {e["name"]: e["split"] for e in state["tars"] if e["name"] in listed}


def _publish_documents(dataset_dir: str, shard_counts: dict[str, int], order: list[str], ratio, split_patterns,
                       previous: dict[str, list[str]] | None, definition: dict,
                       written: list[str], exclude: list[str] | None = None) -> dict[str, list[str]]:
    """``.info.json``, ``.info.yaml``, then ``split.yaml`` and ``dataset.yaml``; returns the splits."""
    _write_if_changed(_meta(dataset_dir, fmt.INFO_JSON), fmt.info_json(shard_counts), written)
    _write_if_changed(_meta(dataset_dir, fmt.INFO_YAML), fmt.info_yaml(shard_counts), written)
    splits = assign_splits(order, ratio, split_patterns, previous)
    split_parts = {s: collapse_names(v) for s, v in splits.items()}
    _write_if_changed(_meta(dataset_dir, fmt.SPLIT_YAML), fmt.split_yaml(split_parts, exclude), written)
    _write_if_changed(_meta(dataset_dir, fmt.DATASET_YAML), fmt.dataset_yaml(definition), written)
    return splits


def _state_entries(plan: _Plan, scans: list[TarScan], shard_counts: dict[str, int],
                   splits: dict[str, list[str]]) -> list[dict]:
    stats = {s.name: (s.size, s.mtime) for s in scans}
    entries = []
    for name in plan.order:
        old = plan.old_entries.get(name)
        size, mtime = stats[name] if name in stats else (old["size"], old["mtime"])
        entries.append({"name": name, "size": size, "mtime": mtime, "count": shard_counts[name],
                        "split": [s for s, members in splits.items() if name in members]})
    return entries


def _publish_state(dataset_dir: str, state: dict, written: list[str]) -> None:
    _write_if_changed(_meta(dataset_dir, fmt.STATE_JSON), json.dumps(state, indent=1).encode("utf-8"), written)
