"""Exact and near duplicates across every image shard, found incrementally.

Shards are taken in the order they arrive; a sample is a duplicate when an earlier **kept** sample
has the same image bytes (the shard parquet's ``sha256``, img2dataset's hash of the downloaded bytes)
or a CLIP image embedding whose cosine similarity to it is at least ``threshold``; it is kept
otherwise. A new shard is checked against everything before it without reading old shards again:
the kept samples' embeddings live in a FAISS index under ``<root>/dedup/``, their hashes and keys in
a SQLite file beside it, so an old shard's decisions never change when new shards arrive.

Index: exact inner product (``IndexFlatIP``) while small; past ``ivf_at`` kept samples it becomes an
IVF index of float16 vectors (``IVF{nlist},SQfp16``: 2 bytes per dimension, similarities exact to about
1e-3; product quantisation is not used, its similarity estimates are far too coarse for a threshold)
with ~4 sqrt(n) lists trained on the vectors it holds; later shards are added with the frozen centroids
and searched in ``nprobe`` lists, and once the index holds REGROW times what its lists were made for it
is trained again with more (``bench/DEDUP.md``: speed, and recall of planted near duplicates against
brute force).

Outputs: ``dedup/shards/{shard}.parquet`` (every embedded sample: ``key``, ``keep``, ``duplicate_of``,
``similarity``, ``reason`` = exact / near) and ``dedup/duplicates.parquet`` (the dropped samples:
``key``, ``kept_key``, ``similarity``, ``reason``, ``shard``). The state (``state.json``, written last)
names the shards done, with their embeddings' identity: a shard whose embeddings were made again, or a
new threshold, starts the whole thing over.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from shardprep import storage
from shardprep.curation.scores import unit_rows
from shardprep.layout import Layout

FORMAT = 1
IVF_AT = 50_000  # kept samples before the exact index becomes an IVF one
NPROBE = 16
REGROW = 4  # an IVF index is trained again (more lists) once it holds this many times what it was trained on
BLOCK = 1024  # rows compared at once within a shard (a block row of floats per shard sample)


@dataclass
class DedupReport:
    shards_added: list[str] = field(default_factory=list)
    samples_added: int = 0
    exact: int = 0  # duplicates found among the added samples, by kind
    near: int = 0
    kept_total: int = 0  # samples in the index after the update
    duplicates_total: int = 0
    rebuilt: bool = False  # started over (new threshold, or a done shard's embeddings changed)
    index: str = "flat"
    seconds: float = 0.0


class _Work:
    """The local working copy of ``<root>/dedup/`` (index, SQLite, state) for one update."""

    def __init__(self, layout: Layout, tmp: str):
        self.layout, self.tmp = layout, tmp
        self.index_path, self.db_path = os.path.join(tmp, "index.faiss"), os.path.join(tmp, "dedup.sqlite")
        self.state = load_state(layout)
        self.index = None
        self.db: sqlite3.Connection | None = None

    def open(self, fresh: bool) -> None:
        import faiss

        self.index = None
        if not fresh:
            storage.fetch_file(self.layout.dedup_index, self.index_path)
            storage.fetch_file(self.layout.dedup_db, self.db_path)
            self.index = faiss.read_index(self.index_path)
        self.db = sqlite3.connect(self.db_path)
        self.db.executescript(
            "CREATE TABLE IF NOT EXISTS kept (id INTEGER PRIMARY KEY, key TEXT NOT NULL);"
            "CREATE TABLE IF NOT EXISTS hashes (hash TEXT PRIMARY KEY, key TEXT NOT NULL);"
            "CREATE TABLE IF NOT EXISTS dups (key TEXT PRIMARY KEY, kept_key TEXT NOT NULL, similarity REAL,"
            " reason TEXT NOT NULL, shard TEXT NOT NULL);")

    def consistent(self) -> bool:
        """The index and the SQLite file hold what the state says (a crash between their publishing
        leaves them apart: then everything is made again)."""
        try:
            kept = self.db.execute("SELECT COUNT(*) FROM kept").fetchone()[0]
        except sqlite3.Error:
            return False
        return self.index is not None and self.index.ntotal == kept == self.state.get("kept")


def load_state(layout: Layout) -> dict | None:
    """``dedup/state.json``: the shards done (``shards``: shard -> embeddings' identity), threshold, counts."""
    text = storage.read_text(layout.dedup_state)
    return json.loads(text) if text else None


def _shard_inputs(layout: Layout, shard: str) -> tuple[list[str], np.ndarray, list[str | None]]:
    """Keys (clip-retrieval metadata order), normalised float32 embeddings, and each key's sha256."""
    keys = storage.read_parquet(layout.emb_metadata(shard), ["image_path"]).column("image_path").to_pylist()
    emb = storage.read_npy(layout.img_emb(shard))
    if len(emb) != len(keys):
        raise ValueError(f"{layout.img_emb(shard)}: {len(emb)} embeddings for {len(keys)} metadata rows")
    hashes: dict[str, str | None] = {}
    if storage.exists(layout.shard_parquet(shard)):
        t = storage.read_parquet(layout.shard_parquet(shard))
        if "sha256" in t.column_names:
            hashes = dict(zip(t.column("key").to_pylist(), t.column("sha256").to_pylist()))
    return keys, unit_rows(emb), [hashes.get(k) for k in keys]


def _within(emb: np.ndarray, candidates: np.ndarray, threshold: float) -> dict[int, list[tuple[int, float]]]:
    """``{i: [(j, sim), ...]}`` for candidate rows i > j of one shard with similarity >= threshold."""
    pairs: dict[int, list[tuple[int, float]]] = {}
    rows = np.flatnonzero(candidates)
    sub = emb[rows]
    for start in range(0, len(rows), BLOCK):
        block = sub[start:start + BLOCK] @ sub[:start + BLOCK].T  # only earlier rows matter
        ii, jj = np.nonzero(block >= threshold)
        for a, b in zip(ii, jj):
            i, j = rows[start + a], rows[b]
            if j < i:
                pairs.setdefault(int(i), []).append((int(j), float(block[a, b])))
    return pairs


def _lists(n: int) -> int:
    """IVF lists for ``n`` vectors: ~4 sqrt(n) (faiss's guideline), each trained with >= 32 points."""
    return int(max(1, min(65536, 4 * np.sqrt(n), n // 32)))


def _index_add(work: _Work, vectors: np.ndarray, ivf_at: int, nprobe: int) -> None:
    """Add the kept vectors; the exact index becomes an IVF one past ``ivf_at``, and an IVF index is
    trained again with more lists once it holds REGROW times the vectors its lists were made for (so a
    query keeps scanning ~nprobe * sqrt(n) / 4 vectors as the dataset grows)."""
    import faiss

    d = vectors.shape[1]
    index = work.index if work.index is not None else faiss.IndexFlatIP(d)
    total = index.ntotal + len(vectors)
    flat = isinstance(index, faiss.IndexFlat)
    if (flat and total <= ivf_at) or (not flat and total <= REGROW * (faiss.extract_index_ivf(index).nlist / 4) ** 2):
        index.add(vectors)
        work.index = index
        return
    # the vectors held so far are read back in chunks (the IVF ones decoded from float16), never all at
    # once: the old and the new index and one chunk are in memory together
    if not flat:
        faiss.extract_index_ivf(index).make_direct_map()
    held = index.ntotal
    nlist = _lists(total)
    rng = np.random.default_rng(0)
    picked = np.sort(rng.choice(total, size=min(total, 32 * nlist), replace=False))
    sample = np.concatenate([*(index.reconstruct_n(int(s), int(e - s))[picked[(picked >= s) & (picked < e)] - s]
                               for s, e in _chunks(held)), vectors[picked[picked >= held] - held]])
    ivf = faiss.index_factory(d, f"IVF{nlist},SQfp16", faiss.METRIC_INNER_PRODUCT)
    clustering = faiss.extract_index_ivf(ivf).cp
    clustering.niter, clustering.min_points_per_centroid = 10, 32  # k-means: 10 rounds, 32 points per list
    ivf.train(sample)
    del sample
    for s, e in _chunks(held):
        ivf.add(index.reconstruct_n(int(s), int(e - s)))
    ivf.add(vectors)
    faiss.extract_index_ivf(ivf).nprobe = nprobe
    work.index = ivf


def _chunks(n: int, size: int = 65_536):
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def _index_search(work: _Work, queries: np.ndarray, threshold: float, nprobe: int) -> list[tuple[int, float] | None]:
    """Per query, the most similar indexed vector with similarity >= threshold, as (id, sim), or None."""
    import faiss

    out: list[tuple[int, float] | None] = [None] * len(queries)
    if work.index is None or work.index.ntotal == 0 or not len(queries):
        return out
    if not isinstance(work.index, faiss.IndexFlat):
        faiss.extract_index_ivf(work.index).nprobe = nprobe
    lims, dist, ids = work.index.range_search(queries, threshold)
    for q in range(len(queries)):
        lo, hi = int(lims[q]), int(lims[q + 1])
        if hi > lo:
            best = lo + int(np.argmax(dist[lo:hi]))
            out[q] = (int(ids[best]), float(dist[best]))
    return out


def _add_shard(work: _Work, shard: str, threshold: float, ivf_at: int, nprobe: int, report: DedupReport):
    import pyarrow as pa
    import pyarrow.parquet as pq

    layout, db = work.layout, work.db
    keys, emb, hashes = _shard_inputs(layout, shard)
    if work.index is not None and emb.shape[1] != work.index.d:
        raise ValueError(f"{layout.img_emb(shard)}: {emb.shape[1]}-wide embeddings, the dedup index holds "
                         f"{work.index.d}-wide ones")
    n = len(keys)
    kept_key: list[str | None] = [None] * n  # None: kept
    sim = np.full(n, np.nan, dtype=np.float32)
    reason: list[str | None] = [None] * n
    # exact: the same bytes as an earlier sample (of an earlier shard, or earlier in this one)
    known = {}
    wanted = sorted({h for h in hashes if h})
    for start in range(0, len(wanted), 900):  # SQLite's variable limit
        part = wanted[start:start + 900]
        known.update(db.execute(f"SELECT hash, key FROM hashes WHERE hash IN ({','.join('?' * len(part))})", part))
    first_here: dict[str, str] = {}
    for i, h in enumerate(hashes):
        if not h:
            continue
        if h in known:
            kept_key[i], sim[i], reason[i] = known[h], 1.0, "exact"
        elif h in first_here:
            kept_key[i], sim[i], reason[i] = first_here[h], 1.0, "exact"
        else:
            first_here[h] = keys[i]
    # near: an earlier shard's kept sample, then an earlier kept sample of this shard
    rest = np.array([r is None for r in reason])
    found = _index_search(work, emb[rest], threshold, nprobe)
    ids = [f[0] for f in found if f is not None]
    id_keys = dict(db.execute(f"SELECT id, key FROM kept WHERE id IN ({','.join(map(str, ids))})")) if ids else {}
    for i, f in zip(np.flatnonzero(rest), found):
        if f is not None:
            kept_key[i], sim[i], reason[i] = id_keys[f[0]], f[1], "near"
    rest = np.array([r is None for r in reason])
    pairs = _within(emb, rest, threshold)
    for i in sorted(pairs):
        live = [(j, s) for j, s in pairs[i] if reason[j] is None]  # earlier rows still kept
        if live and reason[i] is None:
            j, s = max(live, key=lambda p: p[1])
            kept_key[i], sim[i], reason[i] = keys[j], s, "near"
    keep = np.array([r is None for r in reason])
    # an exact copy of an earlier row of this shard that turned out a near duplicate names the sample
    # kept for that row (the one sample of the two that stays)
    row = {k: i for i, k in enumerate(keys)}
    for i in np.flatnonzero(~keep):
        j = row.get(kept_key[i])
        if reason[i] == "exact" and j is not None and reason[j] is not None:
            kept_key[i], sim[i] = kept_key[j], sim[j]
    # the kept samples join the index; every hash maps to the sample kept for it
    base = work.index.ntotal if work.index is not None else 0
    if keep.any():
        _index_add(work, emb[keep], ivf_at, nprobe)
    db.executemany("INSERT INTO kept (id, key) VALUES (?, ?)",
                   [(base + k, keys[i]) for k, i in enumerate(np.flatnonzero(keep))])
    db.executemany("INSERT OR IGNORE INTO hashes (hash, key) VALUES (?, ?)",
                   [(h, kept_key[i] or keys[i]) for i, h in enumerate(hashes) if h])
    db.executemany("INSERT OR REPLACE INTO dups VALUES (?, ?, ?, ?, ?)",
                   [(keys[i], kept_key[i], float(sim[i]), reason[i], shard) for i in np.flatnonzero(~keep)])
    # published with the index, the SQLite file and the state, never before them
    pq.write_table(pa.table({
        "key": pa.array(keys, pa.string()), "keep": pa.array(keep, pa.bool_()),
        "duplicate_of": pa.array(kept_key, pa.string()), "similarity": pa.array(sim, pa.float32()),
        "reason": pa.array(reason, pa.string())}), os.path.join(work.tmp, "masks", f"{shard}.parquet"))
    report.samples_added += n
    report.exact += reason.count("exact")
    report.near += reason.count("near")
    return emb.shape[1]


def update_duplicates(layout: Layout, shards: dict[str, str], threshold: float, *, ivf_at: int = IVF_AT,
                      nprobe: int = NPROBE) -> DedupReport:
    """Bring ``<root>/dedup/`` up to date with ``shards`` (``{shard: identity of its embeddings}``, in
    arrival order): shards done before at the same identity are not read again; a done shard with a new
    identity or missing from ``shards``, or a new ``threshold``, starts everything over."""
    import faiss

    start = time.perf_counter()
    report = DedupReport()
    with tempfile.TemporaryDirectory(prefix="shardprep-dedup-") as tmp:
        work = _Work(layout, tmp)
        state = work.state
        done = (state or {}).get("shards", {})
        fresh = (state is None or state.get("format") != FORMAT or state.get("threshold") != threshold
                 or any(shards.get(s) != ident for s, ident in done.items()))
        if not fresh and all(s in done for s in shards):  # nothing new: nothing is read
            report.kept_total, report.index = state["kept"], state["index"]
            report.duplicates_total = storage.parquet_rows(layout.dedup_table) if storage.exists(layout.dedup_table) else 0
            report.seconds = time.perf_counter() - start
            return report
        try:
            work.open(fresh)
        except (OSError, RuntimeError):  # a file missing or unreadable (faiss raises RuntimeError)
            work.index = None
        if not fresh and (work.index is None or not work.consistent()):
            if work.db is not None:
                work.db.close()
            shutil.rmtree(tmp)
            os.makedirs(tmp)
            work.open(True)
            fresh = True
        if fresh:
            report.rebuilt = state is not None
            done = {}
        todo = [s for s in shards if s not in done]
        dim = (state or {}).get("dim") if not fresh else None
        os.makedirs(os.path.join(tmp, "masks"))
        for shard in todo:
            dim = _add_shard(work, shard, threshold, ivf_at, nprobe, report)
            done[shard] = shards[shard]
            report.shards_added.append(shard)
        work.db.commit()
        kept = work.db.execute("SELECT COUNT(*) FROM kept").fetchone()[0]
        dups = list(work.db.execute("SELECT key, kept_key, similarity, reason, shard FROM dups ORDER BY shard, key"))
        work.db.close()
        # publish (something is new, or everything was made again: "nothing new" returned above)
        if work.index is None:  # no sample yet: an empty exact index keeps the files consistent
            work.index = faiss.IndexFlatIP(dim or 1)
        faiss.write_index(work.index, work.index_path)
        storage.publish_file(work.index_path, layout.dedup_index)
        storage.publish_file(work.db_path, layout.dedup_db)
        for shard in todo:
            storage.publish_file(os.path.join(tmp, "masks", f"{shard}.parquet"), layout.dedup_shard(shard))
        if fresh and storage.exists(layout.dedup_shards_dir):  # masks of shards no longer in the dataset
            fs, path = storage.url_to_fs(layout.dedup_shards_dir)
            for name in fs.ls(path, detail=False):
                if name.rsplit("/", 1)[-1].removesuffix(".parquet") not in done:
                    fs.rm(name)
        storage.write_parquet(layout.dedup_table, _dups_table(dups))
        report.index = "flat" if isinstance(work.index, faiss.IndexFlat) else "ivf"
        # last: what the index and the SQLite file hold
        # the generation counts fresh starts: every keep mask was written again, so a selection made
        # from an old mask (a sample kept because of a duplicate that is gone now) must be redone
        generation = (state or {}).get("generation", 0) + (1 if fresh else 0)
        storage.write_bytes(layout.dedup_state, json.dumps({
            "format": FORMAT, "threshold": threshold, "dim": dim, "kept": kept, "shards": done,
            "index": report.index, "generation": generation}).encode())
        report.kept_total, report.duplicates_total = kept, len(dups)
    report.seconds = time.perf_counter() - start
    return report


def _dups_table(rows: list[tuple]):
    import pyarrow as pa

    return pa.table({"key": pa.array([r[0] for r in rows], pa.string()),
                     "kept_key": pa.array([r[1] for r in rows], pa.string()),
                     "similarity": pa.array([r[2] for r in rows], pa.float32()),
                     "reason": pa.array([r[3] for r in rows], pa.string()),
                     "shard": pa.array([r[4] for r in rows], pa.string())})


def remove_samples(layout: Layout, shard: str, keys: set[str], identity: str) -> int:
    """Take samples of a de-duplicated shard out of ``<root>/dedup/`` in place (a takedown): their vectors
    leave the index (the others keep their order, so ids stay positions), their rows leave the SQLite
    file, the shard's mask and the duplicates table, and the shard is recorded at its embeddings' new
    ``identity`` so the next update does not start over. Samples kept as duplicates of a removed one stay
    dropped (they are copies of it). Returns the vectors removed; 0 and nothing changed when the shard is
    not de-duplicated yet or the files are not consistent (the next update makes them again). The
    caller holds the ``duplicates`` lock."""
    import faiss
    import pyarrow as pa

    state = load_state(layout)
    if not keys or state is None or state.get("format") != FORMAT or shard not in state.get("shards", {}):
        return 0
    with tempfile.TemporaryDirectory(prefix="shardprep-dedup-") as tmp:
        work = _Work(layout, tmp)
        try:
            work.open(False)
        except (OSError, RuntimeError):
            return 0
        if not work.consistent():
            work.db.close()
            return 0
        db, gone = work.db, sorted(keys)
        ids: list[int] = []
        for start in range(0, len(gone), 900):
            part = gone[start:start + 900]
            ids += [r[0] for r in db.execute(f"SELECT id FROM kept WHERE key IN ({','.join('?' * len(part))})", part)]
        if ids:
            index, removed = work.index, np.array(sorted(ids), dtype=np.int64)
            if isinstance(index, faiss.IndexFlat):
                index.remove_ids(faiss.IDSelectorBatch(removed))  # the later vectors move down: ids stay positions
            else:  # an IVF index keeps explicit ids: the vectors left are added again, in order, to an empty copy
                ivf = faiss.extract_index_ivf(index)
                ivf.make_direct_map()
                fresh = faiss.clone_index(index)
                fresh.reset()
                for s, e in _chunks(index.ntotal):
                    block = np.arange(s, e)
                    fresh.add(index.reconstruct_n(int(s), int(e - s))[~np.isin(block, removed)])
                faiss.extract_index_ivf(fresh).nprobe = ivf.nprobe
                work.index = fresh
            rows = db.execute("SELECT id, key FROM kept ORDER BY id").fetchall()
            drop = set(ids)
            db.execute("DELETE FROM kept")
            db.executemany("INSERT INTO kept (id, key) VALUES (?, ?)",
                           [(new, key) for new, (_, key) in enumerate(r for r in rows if r[0] not in drop)])
        for start in range(0, len(gone), 900):
            part = gone[start:start + 900]
            marks = ",".join("?" * len(part))
            db.execute(f"DELETE FROM hashes WHERE key IN ({marks})", part)
            db.execute(f"DELETE FROM dups WHERE key IN ({marks})", part)
        db.commit()
        kept = db.execute("SELECT COUNT(*) FROM kept").fetchone()[0]
        dups = list(db.execute("SELECT key, kept_key, similarity, reason, shard FROM dups ORDER BY shard, key"))
        db.close()
        faiss.write_index(work.index, work.index_path)
        storage.publish_file(work.index_path, layout.dedup_index)
        storage.publish_file(work.db_path, layout.dedup_db)
        mask = storage.read_parquet(layout.dedup_shard(shard))
        storage.write_parquet(layout.dedup_shard(shard), mask.filter(pa.array(
            [k not in keys for k in mask.column("key").to_pylist()])))
        storage.write_parquet(layout.dedup_table, _dups_table(dups))
        # last: the shard at its new identity (the mask's identity changes with it: its selection is redone)
        state["shards"][shard], state["kept"] = identity, kept
        storage.write_bytes(layout.dedup_state, json.dumps(state).encode())
    return len(ids)


def identity(clip_stamp: dict) -> str:
    """A shard's embeddings' identity (their stamp's version and time): it changes when they are written again."""
    return f"{clip_stamp['version']}@{clip_stamp.get('written_at')}"


def embedded_shards(layout: Layout, clip_version: str) -> dict[str, str]:
    """``{shard: identity}`` of the image shards whose CLIP embeddings are complete at ``clip_version``, in
    ledger order; the identity (version and time of the embeddings' stamp) changes if they are made again."""
    from shardprep.versions import current_stamps

    return {key: identity(stamp) for key, stamp in current_stamps(layout, "clip_embeddings", clip_version).items()
            if stamp is not None and storage.exists(layout.img_emb(key))}


def mask_identities(layout: Layout) -> dict[str, str]:
    """``{shard: identity of its keep mask}``: changes when the mask is written again."""
    state = load_state(layout) or {}
    generation = state.get("generation", 0)
    return {shard: f"{generation}:{ident}" for shard, ident in state.get("shards", {}).items()}


def keep_mask(layout: Layout, shard: str) -> dict[str, bool] | None:
    """``{key: keep}`` of ``shard``, or None when it has not been de-duplicated."""
    return storage.read_keyed(layout.dedup_shard(shard), "keep")
