"""shardprep.curation.dedup on synthetic shards in clip-retrieval's layout: duplicates planted within a shard, across
shards and across arrivals are found against brute force, old shards are not read again, the exact and
IVF indexes agree, and a new threshold, changed embeddings or a torn update start over."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.curation.dedup import keep_mask, update_duplicates
from shardprep.layout import Layout

DIM = 48


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _near(v: np.ndarray, cos: float, rng) -> np.ndarray:
    noise = rng.normal(size=v.shape).astype(np.float32)
    noise = _unit(noise - (noise @ v) * v)
    return _unit(cos * v + np.sqrt(1 - cos ** 2) * noise)


def _write_shard(layout: Layout, shard: str, emb: np.ndarray, hashes: list[str]) -> list[str]:
    for url in (layout.img_emb(shard), layout.emb_metadata(shard), layout.shard_parquet(shard)):
        os.makedirs(os.path.dirname(url), exist_ok=True)
    keys = [f"{shard}{i:04d}" for i in range(len(emb))]
    np.save(layout.img_emb(shard), emb.astype(np.float16))
    pq.write_table(pa.table({"image_path": keys}), layout.emb_metadata(shard))
    pq.write_table(pa.table({"key": keys, "status": ["success"] * len(keys), "sha256": hashes}),
                   layout.shard_parquet(shard))
    return keys


def _greedy(emb: np.ndarray, hashes: list[str], threshold: float) -> np.ndarray:
    """Brute force: row i is dropped when an earlier kept row has its hash or cosine >= threshold."""
    e = _unit(emb.astype(np.float16).astype(np.float32))
    keep = np.ones(len(e), bool)
    for i in range(len(e)):
        earlier = np.flatnonzero(keep[:i])
        if any(hashes[j] == hashes[i] for j in earlier) or (len(earlier) and (e[earlier] @ e[i]).max() >= threshold):
            keep[i] = False
    return keep


@pytest.fixture
def planted(tmp_path):
    """Three shards of 300 random 48-d embeddings: near copies (cosine 0.96-0.99) and exact copies (same
    bytes) of rows earlier in the shard and in earlier shards, and copies at cosine 0.90 that must stay."""
    rng = np.random.default_rng(5)
    layout = Layout(str(tmp_path / "out"))
    shards, all_emb, all_hash = {}, [], []
    for s in range(3):
        emb = _unit(rng.normal(size=(300, DIM)))
        hashes = [f"h{s}-{i}" for i in range(300)]
        for i in range(10, 300, 13):
            pool = np.concatenate(all_emb + [emb[:i]]) if all_emb else emb[:i]
            j = int(rng.integers(len(pool)))
            emb[i] = _near(pool[j], float(rng.uniform(0.96, 0.99)), rng)
        for i in range(11, 300, 29):  # the same bytes as an earlier row: its hash and its embedding
            hs = sum(all_hash, []) + hashes[:i]
            j = int(rng.integers(len(hs)))
            hashes[i] = hs[j]
            emb[i] = (np.concatenate(all_emb + [emb[:i]]) if all_emb else emb[:i])[j]
        for i in range(12, 300, 31):  # similar, not a duplicate
            emb[i] = _near(emb[int(rng.integers(i))], 0.90, rng)
        shards[f"{s:05d}"] = _write_shard(layout, f"{s:05d}", emb, hashes)
        all_emb.append(emb)
        all_hash.append(hashes)
    return layout, shards, np.concatenate(all_emb), sum(all_hash, [])


def _decided(layout: Layout, shards: dict) -> np.ndarray:
    return np.array([keep_mask(layout, s)[k] for s, keys in shards.items() for k in keys])


def test_duplicates_across_arrivals_match_brute_force(planted, monkeypatch):
    layout, shards, emb, hashes = planted
    truth = _greedy(emb, hashes, 0.95)
    assert 60 < (~truth).sum() < 120  # the planted copies, no accidental ones
    ids = {s: "v1" for s in shards}
    first = update_duplicates(layout, dict(list(ids.items())[:2]), 0.95)
    assert first.shards_added == ["00000", "00001"] and first.index == "flat"

    # the third shard arrives: the first two are not read again
    import shardprep.curation.dedup as dedup

    read = []
    original = dedup._shard_inputs
    monkeypatch.setattr(dedup, "_shard_inputs", lambda layout, s: read.append(s) or original(layout, s))
    second = update_duplicates(layout, ids, 0.95)
    assert second.shards_added == ["00002"] and read == ["00002"]
    assert np.array_equal(_decided(layout, shards), truth)
    table = pq.read_table(layout.dedup_table).to_pandas()
    assert len(table) == (~truth).sum() and set(table["reason"]) == {"exact", "near"}
    # an exact copy names the sample kept for its bytes (similarity 1, or the near match of a copied row
    # that was itself a near duplicate)
    assert (table[table.reason == "exact"]["similarity"] >= 0.95).all()
    kept = {k for s, keys in shards.items() for k in keys if keep_mask(layout, s)[k]}
    assert set(table["kept_key"]) <= kept and (table["kept_key"] < table["key"]).all()
    # across shards and across arrivals
    assert (table["shard"] == "00002").any() and (table["kept_key"].str[:5] < table["shard"]).any()
    # nothing new: nothing read, nothing written
    read.clear()
    state = os.stat(layout.dedup_state).st_mtime_ns
    assert update_duplicates(layout, ids, 0.95).shards_added == [] and read == []
    assert os.stat(layout.dedup_state).st_mtime_ns == state


def test_the_ivf_index_finds_what_the_exact_one_finds(planted):
    layout, shards, emb, hashes = planted
    report = update_duplicates(layout, {s: "v1" for s in shards}, 0.95, ivf_at=250, nprobe=8)
    assert report.index == "ivf"
    # at 48-d with ~20 lists, 8 probed: the planted copies (cosine >= 0.96) are all found
    assert np.array_equal(_decided(layout, shards), _greedy(emb, hashes, 0.95))


def test_a_new_threshold_changed_embeddings_or_a_torn_update_start_over(planted):
    layout, shards, emb, hashes = planted
    ids = {s: "v1" for s in shards}
    update_duplicates(layout, ids, 0.95)
    looser = update_duplicates(layout, ids, 0.85)
    assert looser.rebuilt and looser.shards_added == list(shards)
    assert np.array_equal(_decided(layout, shards), _greedy(emb, hashes, 0.85))  # the 0.90 copies go too
    again = update_duplicates(layout, {**ids, "00001": "v2"}, 0.85)  # re-embedded shard
    assert again.rebuilt and again.shards_added == list(shards)
    # the index and SQLite file published, the state not (a crash between them): when the next shard
    # arrives this is found out and everything is made again
    state = json.loads(open(layout.dedup_state).read())
    state["kept"] += 1
    open(layout.dedup_state, "w").write(json.dumps(state))
    _write_shard(layout, "00003", _unit(np.random.default_rng(0).normal(size=(5, DIM))), [f"x{i}" for i in range(5)])
    torn = update_duplicates(layout, {**ids, "00001": "v2", "00003": "v1"}, 0.85)
    assert torn.rebuilt and torn.shards_added == [*shards, "00003"]
    assert np.array_equal(_decided(layout, shards), _greedy(emb, hashes, 0.85))


def test_embeddings_of_another_width_are_refused_naming_the_file(planted):
    layout, shards, emb, hashes = planted
    update_duplicates(layout, {s: "v1" for s in shards}, 0.95)
    _write_shard(layout, "00003", _unit(np.random.default_rng(0).normal(size=(5, DIM + 1))), [f"x{i}" for i in range(5)])
    with pytest.raises(ValueError, match=r"img_emb_00003.npy: 49-wide embeddings, the dedup index holds 48-wide"):
        update_duplicates(layout, {**{s: "v1" for s in shards}, "00003": "v1"}, 0.95)
    assert json.loads(open(layout.dedup_state).read())["shards"].keys() == set(shards)  # nothing published


@pytest.mark.parametrize("ivf_at", [10_000, 100])  # the exact index; an IVF one
def test_a_takedown_removes_samples_in_place_and_the_next_update_goes_on(tmp_path, ivf_at):
    import faiss

    from shardprep.curation.dedup import load_state, remove_samples

    rng = np.random.default_rng(9)
    layout = Layout(str(tmp_path / "out"))
    embs = {s: _unit(rng.normal(size=(120, DIM))) for s in ("00000", "00001")}
    keys = {s: _write_shard(layout, s, e, [f"h{s}-{i}" for i in range(120)]) for s, e in embs.items()}
    update_duplicates(layout, {"00000": "a", "00001": "b"}, 0.95, ivf_at=ivf_at)
    before = faiss.read_index(layout.dedup_index)
    assert before.ntotal == 240 and isinstance(before, faiss.IndexFlat) == (ivf_at > 240)
    gone = {keys["00000"][i] for i in (0, 7, 50, 119)}

    assert remove_samples(layout, "00000", gone, "a2") == 4
    index = faiss.read_index(layout.dedup_index)
    assert index.ntotal == 236
    if not isinstance(index, faiss.IndexFlat):
        faiss.extract_index_ivf(index).make_direct_map()
    left = [k for s in ("00000", "00001") for k in keys[s] if k not in gone]
    vectors = np.concatenate([embs["00000"], embs["00001"]])[[k not in gone for s in keys for k in keys[s]]]
    # what is left, in order: id i is still the i-th kept vector, named by the SQLite file
    np.testing.assert_allclose(index.reconstruct_n(0, 236), _unit(vectors.astype(np.float16).astype(np.float32)),
                               atol=2e-3)
    import sqlite3

    with sqlite3.connect(layout.dedup_db) as db:
        assert [k for _, k in db.execute("SELECT id, key FROM kept ORDER BY id")] == left
        assert db.execute("SELECT COUNT(*) FROM hashes WHERE key IN ('%s')" % "','".join(gone)).fetchone()[0] == 0
    assert not set(pq.read_table(layout.dedup_shard("00000")).column("key").to_pylist()) & gone
    assert load_state(layout)["shards"] == {"00000": "a2", "00001": "b"} and load_state(layout)["kept"] == 236

    # a new shard: a copy of a removed sample is kept (nothing left is like it), a copy of a kept one is not
    new = _unit(rng.normal(size=(4, DIM)))
    new[0], new[1] = embs["00000"][7], embs["00001"][3]
    _write_shard(layout, "00002", new, ["x0", "x1", "x2", "x3"])
    report = update_duplicates(layout, {"00000": "a2", "00001": "b", "00002": "c"}, 0.95, ivf_at=ivf_at)
    assert not report.rebuilt and report.shards_added == ["00002"]
    mask = keep_mask(layout, "00002")
    assert mask["000020000"] and not mask["000020001"]
