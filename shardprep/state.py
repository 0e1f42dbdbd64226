"""The state index: which (artifact, shard) is complete at which version, which failed and why, which
is being made, in one table per artifact under the output root, so that showing or planning a dataset
of 580,000 shards reads a handful of files instead of one stamp per shard (on ``s3://`` each read is a
request).

The stamps (``shardprep.versions``) stay the truth a writer trusts before it skips a shard; the index
mirrors them and adds what no stamp says (the last failure, the step at work). It is kept in two parts:

* ``.shardprep/state/{artifact}.parquet``: one row per shard (``shard``, ``version``, ``written_at``,
  ``outputs`` as JSON of ``{path under the root: size}``, ``failure``, ``failed_at``, ``started_at``,
  ``worker``), written atomically;
* ``.shardprep/state/journal/``: one small file per change, written by whoever changes a stamp, right
  *after* the stamp is written and right *before* it is removed, and never rewritten. A process killed
  between the two therefore leaves the index claiming less than the stamps, never more: a shard it
  shows complete is complete; a shard whose entry was lost is found complete by its stamp when it is
  run again, and recorded then.

``fold`` (under the root's ``state`` lock; the run's own process and ``status`` call it, never the
workers) applies the journal to the tables and deletes what it applied. Applying an entry twice gives
the same table, so a fold cut short is simply done again. Readers take the tables plus the journal not
yet folded (``load``). ``rebuild`` makes the tables again from the stamps (``shardprep verify
--rebuild-index``, and the first fold under an output root made before the index existed).

Across machines (dagster-celery workers on ``s3://``), workers only write journal files, each its own
object; folding happens where the run is driven, so the one-machine lock is enough.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from shardprep import arrow_lists
from shardprep.artifacts import ARTIFACTS
from shardprep.layout import Layout
from shardprep.storage import exists, lock, read_parquet, url_to_fs, write_bytes, write_parquet

FORMAT = 1
SCHEMA = pa.schema([("shard", pa.string()), ("version", pa.string()), ("written_at", pa.float64()),
                    ("outputs", pa.string()), ("failure", pa.string()), ("failed_at", pa.float64()),
                    ("started_at", pa.float64()), ("worker", pa.string())])
_FIELDS = SCHEMA.names[1:]
_HOST = socket.gethostname()


def worker() -> str:
    """This process, as the journal names it (``host:pid``)."""
    return f"{_HOST}:{os.getpid()}"


# ---------------------------------------------------------------- writing the journal


def _relative(layout: Layout, url: str) -> str:
    root = layout.root.rstrip("/") + "/"
    return url[len(root):] if url.startswith(root) else url


def _journal(layout: Layout, artifact: str, entries: list[dict]) -> None:
    if not entries:
        return
    # time first: names sort in the order the entries were made (within a host), which is the order
    # they are applied in; then the artifact, so a reader of one artifact reads only its own files
    name = f"{time.time_ns():020d}-{artifact}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    write_bytes(f"{layout.state_journal}/{name}", json.dumps(entries).encode("utf-8"))


def _artifact_of(name: str) -> str:
    """The artifact a journal file is of (artifact names hold no "-")."""
    return os.path.basename(name).split("-", 2)[1]


def record_done(layout: Layout, artifact: str, shard: str, version: str, outputs: dict[str, int],
                written_at: float) -> None:
    """``shard`` of ``artifact`` is complete at ``version`` (call after its stamp is written)."""
    # "j": when this was recorded (a shard found complete again, long after its stamp, ends its start)
    _journal(layout, artifact, [{"a": artifact, "s": shard, "k": "done", "t": written_at, "j": time.time(), "version": version,
                       "outputs": {_relative(layout, u): n for u, n in outputs.items()}}])


def record_removed(layout: Layout, artifact: str, shard: str) -> None:
    """``shard`` of ``artifact`` is no longer complete (call before its stamp is removed)."""
    _journal(layout, artifact, [{"a": artifact, "s": shard, "k": "removed", "t": time.time()}])


def record_failed(layout: Layout, artifact: str, shard: str, reason: str) -> None:
    """The last attempt at ``shard`` of ``artifact`` failed (its outputs, if any, are as they were)."""
    _journal(layout, artifact, [{"a": artifact, "s": shard, "k": "failed", "t": time.time(), "failure": reason[:2000]}])


def record_started(layout: Layout, artifact: str, shards: Iterable[str]) -> None:
    """This process starts on ``shards`` of ``artifact`` (one journal file for all of them)."""
    now, who = time.time(), worker()
    _journal(layout, artifact, [{"a": artifact, "s": s, "k": "started", "t": now, "worker": who} for s in shards])


# ---------------------------------------------------------------- reading the journal


def _journal_files(layout: Layout) -> list[str]:
    fs, path = url_to_fs(layout.state_journal)
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    # a leading dot: a temp file of a write in progress (storage.atomic_write)
    return sorted(n for n in names if not os.path.basename(n).startswith(".") and n.endswith(".json"))


def _read_entries(layout: Layout, files: list[str]) -> list[dict]:
    fs, _ = url_to_fs(layout.state_journal)
    entries = []
    for name in files:
        try:
            with fs.open(name, "rb") as f:
                entries.extend(json.loads(f.read()))
        except (FileNotFoundError, ValueError):  # folded and deleted meanwhile; or not ours
            continue
    # in the order they were recorded (stable: entries of one time keep their file order)
    entries.sort(key=lambda e: e.get("j", e["t"]))
    return entries


# ---------------------------------------------------------------- the tables


def _empty() -> pa.Table:
    # not SCHEMA.empty_table(): it imports pandas, as pa.array of a list does (shardprep.arrow_lists)
    return arrow_lists.table(dict.fromkeys(SCHEMA.names, []), SCHEMA)


def _read_table(layout: Layout, artifact: str, columns: list[str] | None = None) -> pa.Table:
    url = layout.state_table(artifact)
    if not exists(url):
        return _empty() if columns is None else _empty().select(columns)
    return read_parquet(url, columns)


def _apply(table: pa.Table, entries: list[dict]) -> pa.Table:
    """``table`` with ``entries`` (one artifact's, in time order) applied: the rows they touch are
    rebuilt in Python, the rest stays columnar (a fold at 580,000 shards touches a few)."""
    touched = list(dict.fromkeys(e["s"] for e in entries))
    mask = pc.is_in(table.column("shard"), value_set=arrow_lists.array(touched, pa.string()))
    rows = {r["shard"]: r for r in table.filter(mask).to_pylist()}
    for e in entries:
        row = rows.setdefault(e["s"], {"shard": e["s"], **dict.fromkeys(_FIELDS)})
        kind, t = e["k"], e["t"]
        # the newest change wins, whatever order entries are applied in: a rebuild from the stamps,
        # then an older journal entry of the same shard, must keep what the stamp says
        if kind in ("done", "failed") and row["started_at"] is not None and e.get("j", t) >= row["started_at"]:
            row.update(started_at=None, worker=None)  # the start has its outcome
        if kind == "done" and row["failed_at"] is not None and row["failed_at"] <= e.get("j", t):
            row.update(failure=None, failed_at=None)  # found complete since: the failure is over
        if kind in ("done", "removed") and (row["written_at"] is None or t >= row["written_at"]):
            if kind == "done":
                row.update(version=e["version"], written_at=t, outputs=json.dumps(e["outputs"], sort_keys=True))
            else:  # the time of the removal is kept, so an older "done" applied later loses
                row.update(version=None, written_at=t, outputs=None)
        elif kind == "failed" and (row["failed_at"] is None or t >= row["failed_at"]):
            row.update(failure=e["failure"], failed_at=t)
        elif kind == "started" and (row["started_at"] is None or t >= row["started_at"]):
            row.update(started_at=t, worker=e["worker"])
    # a removed shard's row stays (with the removal's time) so an older entry applied later loses to it
    kept = [r for r in rows.values() if any(r[f] is not None for f in _FIELDS)]
    new = arrow_lists.table({name: [r[name] for r in kept] for name in SCHEMA.names}, SCHEMA)
    merged = pa.concat_tables([table.filter(pc.invert(mask)), new])
    return merged.sort_by("shard")


def _by_artifact(entries: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in entries:
        out.setdefault(e["a"], []).append(e)
    return out


def _meta_url(layout: Layout) -> str:
    return f"{layout.state_dir}/meta.json"


def _stamps_of(layout: Layout, artifact: str) -> list[dict]:
    fs, path = url_to_fs(layout.stamps_dir(artifact))
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    docs = []
    for name in sorted(n for n in names if n.endswith(".json") and not os.path.basename(n).startswith(".")):
        try:
            with fs.open(name, "rb") as f:
                doc = json.loads(f.read())
        except (FileNotFoundError, ValueError):  # unreadable: not trusted, as versions.read_stamp
            continue
        if isinstance(doc, dict) and isinstance(doc.get("version"), str):
            docs.append({"s": os.path.basename(name)[:-len(".json")], "k": "done", "t": doc.get("written_at") or 0.0,
                         "version": doc["version"],
                         "outputs": {_relative(layout, u): n for u, n in (doc.get("outputs") or {}).items()}})
    return docs


def _stamped_artifacts(layout: Layout) -> list[str]:
    fs, path = url_to_fs(layout.stamps_dir(""))
    try:
        return sorted(os.path.basename(n.rstrip("/")) for n in fs.ls(path.rstrip("/"), detail=False))
    except FileNotFoundError:
        return []


def _rebuild_locked(layout: Layout) -> None:
    """The tables made from the stamps alone (the lock is held). Failures and starts are not in the
    stamps: they are kept from the tables as they were."""
    artifacts = set(_stamped_artifacts(layout))
    fs, path = url_to_fs(layout.state_dir)
    try:
        artifacts |= {os.path.basename(n)[:-len(".parquet")] for n in fs.ls(path, detail=False)
                      if n.endswith(".parquet")}
    except FileNotFoundError:
        pass
    for artifact in sorted(artifacts):
        old = _read_table(layout, artifact)
        keep = old.select(["shard", "failure", "failed_at", "started_at", "worker"]).to_pylist()
        stamps = _stamps_of(layout, artifact)
        entries = [{"s": r["shard"], "k": k, "t": r[t], **extra} for r in keep for k, t, extra in
                   (("failed", "failed_at", {"failure": r["failure"]}), ("started", "started_at", {"worker": r["worker"]}))
                   if r[t] is not None]
        table = _apply(_empty(), sorted(stamps + entries, key=lambda e: e["t"])) if stamps or entries else _empty()
        write_parquet(layout.state_table(artifact), table)
    write_bytes(_meta_url(layout), json.dumps({"format": FORMAT, "rebuilt_at": time.time()}).encode("utf-8"))


def _has_index(layout: Layout) -> bool:
    return exists(_meta_url(layout))


def _apply_journal(layout: Layout, files: list[str], after_rebuild: bool = False) -> int:
    """Apply the journal ``files`` to the tables, then delete them (the lock is held); only those: entries
    written meanwhile wait for the next fold. ``after_rebuild``: the tables were just made from the
    stamps, which were read after every entry of ``files`` was written, so they already hold what those
    entries say of completeness; only failures and starts are applied."""
    entries = _read_entries(layout, files)
    if after_rebuild:
        entries = [e for e in entries if e["k"] in ("failed", "started")]
    for artifact, mine in _by_artifact(entries).items():
        write_parquet(layout.state_table(artifact), _apply(_read_table(layout, artifact), mine))
    fs, _ = url_to_fs(layout.state_journal)
    for name in files:
        try:
            fs.rm(name)
        except FileNotFoundError:
            pass
    return len(entries)


def _rebuild_and_fold(layout: Layout, files: list[str]) -> int:
    """The tables made from the stamps, then ``files`` of the journal (listed before the stamps were
    read) folded in for their failures and starts (the lock is held)."""
    _rebuild_locked(layout)
    return _apply_journal(layout, files, after_rebuild=True)


def ensure(layout: Layout) -> None:
    """Start the index of this output root if it has none (at the start of a run: a new root gets an
    empty one at once, instead of a scan of every stamp the first time it is folded)."""
    if _has_index(layout):
        return
    with lock(layout.root, "state"):
        if not _has_index(layout):
            _rebuild_and_fold(layout, _journal_files(layout))


def read_new(layout: Layout, seen: set[str], since_ns: int = 0) -> tuple[list[dict], list[str]]:
    """Journal entries of files not in ``seen`` and made at or after ``since_ns`` (``time.time_ns()``), and
    those files' names (add them to ``seen``; ``fold(layout, files)`` folds exactly them): how a run
    follows its shards as they finish."""
    files = [n for n in _journal_files(layout)
             if n not in seen and int(os.path.basename(n).split("-", 1)[0]) >= since_ns]
    return _read_entries(layout, files), files


def fold(layout: Layout, files: list[str] | None = None) -> int:
    """Apply the journal (or only ``files`` of it) to the tables and delete the files applied; the number
    of entries applied. The first fold under an output root without an index builds it from the stamps
    first."""
    if files is None and not _journal_files(layout) and (_has_index(layout) or not _stamped_artifacts(layout)):
        return 0  # nothing to apply (and nothing recorded yet: not even a lock file is made)
    with lock(layout.root, "state"):
        listed = _journal_files(layout)
        if files is not None:  # only those still there (another fold may have taken some)
            present = set(listed)
            listed = [n for n in files if n in present]
        if not _has_index(layout):
            return _rebuild_and_fold(layout, listed)
        return _apply_journal(layout, listed)


def rebuild(layout: Layout) -> None:
    """Make the index again from the stamps (what ``verify --rebuild-index`` does). The journal listed
    before the stamps are read is folded in for its failures and starts; entries written after the
    listing wait for the next fold."""
    with lock(layout.root, "state"):
        _rebuild_and_fold(layout, _journal_files(layout))


def clear(layout: Layout) -> None:
    """Remove the index (tests; the next fold builds it again from the stamps)."""
    fs, path = url_to_fs(layout.state_dir)
    if fs.exists(path):
        fs.rm(path, recursive=True)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class ArtifactState:
    """One artifact's rows (a pyarrow Table of ``SCHEMA``), journal applied."""

    artifact: str
    table: pa.Table

    def versions(self) -> dict[str, str]:
        """``{shard: version}`` of the complete shards."""
        t = self.table.filter(pc.is_valid(self.table.column("version")))
        return dict(zip(t.column("shard").to_pylist(), t.column("version").to_pylist()))

    def complete(self, version: str) -> set[str]:
        t = self.table.filter(arrow_lists.is_value(self.table.column("version"), version))
        return set(t.column("shard").to_pylist())

    def complete_among(self, keys: list[str], version: str) -> set[str]:
        """Those of ``keys`` complete at ``version`` (compared in Arrow: a step over a few blocks of a
        580,000-shard table builds no set of the whole table)."""
        if not keys or not self.table.num_rows:
            return set()
        t = self.table
        mask = pc.and_(pc.is_in(t.column("shard"), value_set=arrow_lists.array(keys, pa.string())),
                       arrow_lists.is_value(t.column("version"), version))
        return set(t.filter(mask).column("shard").to_pylist())

    def failures(self) -> dict[str, str]:
        """``{shard: reason}`` of shards whose last attempt failed."""
        t = self.table.filter(pc.is_valid(self.table.column("failure")))
        return dict(zip(t.column("shard").to_pylist(), t.column("failure").to_pylist()))

    def started(self) -> dict[str, tuple[float, str]]:
        """``{shard: (started_at, worker)}`` of shards started and without an outcome since."""
        t = self.table.filter(pc.is_valid(self.table.column("started_at")))
        return {r["shard"]: (r["started_at"], r["worker"]) for r in t.to_pylist()}

    def row(self, shard: str) -> dict | None:
        t = self.table.filter(arrow_lists.is_value(self.table.column("shard"), shard))
        return t.to_pylist()[0] if t.num_rows else None

    def outputs(self, shard: str, layout: Layout) -> dict[str, int] | None:
        """``{url: size}`` of the files ``shard``'s complete outputs were recorded with (None: not complete)."""
        r = self.row(shard)
        if r is None or r["outputs"] is None:
            return None
        return {f"{layout.root.rstrip('/')}/{p}": n for p, n in json.loads(r["outputs"]).items()}


def load(layout: Layout, artifacts: Iterable[str], *, fold_first: bool = True) -> dict[str, ArtifactState]:
    """The state of ``artifacts``: their tables with the journal applied. ``fold_first``: fold the
    journal into the tables first (needs write access to the root; what ``status`` does)."""
    artifacts = list(artifacts)
    if fold_first:
        fold(layout)
        pending: dict[str, list[dict]] = {}
    else:
        wanted = set(artifacts)
        pending = _by_artifact(_read_entries(layout, [n for n in _journal_files(layout) if _artifact_of(n) in wanted]))
    out = {}
    for a in artifacts:
        table = _read_table(layout, a)
        if a in pending:
            table = _apply(table, pending[a])
        out[a] = ArtifactState(a, table)
    return out


def incomplete(ledger, states: dict[str, ArtifactState], versions: dict[str, str]) -> dict[str, list[str]]:
    """``{shard: [artifact]}``, in shard order, where the index says the shard's outputs of the artifact
    (one of ``states``) are not complete at its version, for the shards of the media it applies to: a
    shard new to a block, one redone by ``verify`` or ``reshard``, one whose step died with its process.
    Compared in Arrow: at 580,000 shards a Python set per artifact costs seconds."""
    keys = {m: arrow_lists.array(k, pa.string()) for m, k in ledger.keys_by_media().items() if k}
    out: dict[str, list[str]] = {}
    for name, st in states.items():
        t = st.table
        current = t.filter(arrow_lists.is_value(t.column("version"), versions[name])).column("shard")
        for media, arr in keys.items():
            if ARTIFACTS[name].applies(media):
                for key in arr.filter(pc.invert(pc.is_in(arr, value_set=current))).to_pylist():
                    out.setdefault(key, []).append(name)
    return dict(sorted(out.items()))


def stamps_equal_index(layout: Layout, artifacts: Iterable[str]) -> dict[str, list[str]]:
    """``{artifact: [shards whose index entry differs from the stamp]}``, empty when the index mirrors
    the stamps exactly (version, time and output sizes): reads every stamp, for tests and ``verify``."""
    diffs: dict[str, list[str]] = {}
    states = load(layout, artifacts, fold_first=False)
    for a in artifacts:
        stamped = {d["s"]: (d["version"], d["t"], d["outputs"]) for d in _stamps_of(layout, a)}
        t = states[a].table.filter(pc.is_valid(states[a].table.column("version")))
        indexed = {r["shard"]: (r["version"], r["written_at"], json.loads(r["outputs"])) for r in t.to_pylist()}
        bad = sorted(s for s in stamped.keys() | indexed.keys() if stamped.get(s) != indexed.get(s))
        if bad:
            diffs[a] = bad
    return diffs


__all__ = ["ArtifactState", "FORMAT", "SCHEMA", "clear", "ensure", "fold", "incomplete", "load", "read_new", "rebuild", "record_done", "record_failed",
           "record_removed", "record_started", "stamps_equal_index", "worker"]
