"""Balanced tars kept in step with shards whose samples change (a reshard now, a takedown later): a changed
sample is replaced where it is, a sample gone leaves a hole the last sample fills, a new one is appended,
a withdrawn shard leaves; every complete tar keeps exactly chunk_size samples, only the tars whose samples
changed are written again, and no byte of a replaced sample is left. The oracle: every balanced sample is
byte for byte the sample its shard holds now, each exactly once, read back by webdataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import webdataset as wds

from shardprep.keys import compute_key, shard_key
from shardprep.layout import Layout
from shardprep.nemo.balanced import incomplete_marker, load_state, update_balanced_shards
from shardprep.tars import TarWriter
from tests.test_balanced_index import _jpeg

CHUNK = 4
OOM_SAMPLE = 2


def key(shard_id: int, index: int) -> str:
    return compute_key(index, shard_id, OOM_SAMPLE)


def write_shard(layout: Layout, shard_id: int, indices: list[int], caption=lambda key: f"caption of {key}") -> None:
    keys = [compute_key(i, shard_id, OOM_SAMPLE) for i in indices]
    Path(layout.images_dir).mkdir(parents=True, exist_ok=True)
    with TarWriter(layout.tar(shard_key(shard_id)), remove_stale=True) as tar:
        for key in keys:
            tar.add(key, {"jpg": _jpeg(int(key)), "json": json.dumps({"key": key}), "txt": caption(key)})


def balanced_samples(layout: Layout) -> list[list[dict]]:
    state = load_state(layout)
    return [list(wds.WebDataset(layout.balanced_tar(i), shardshuffle=False)) for i in range(len(state["tars"]))]


def shard_samples(layout: Layout, shards: list[str]) -> dict[str, dict]:
    out = {}
    for shard in shards:
        if Path(layout.tar(shard)).exists():
            out.update({s["__key__"]: s for s in wds.WebDataset(layout.tar(shard), shardshuffle=False)})
    return out


def assert_in_step(layout: Layout, shards: list[str]) -> list[list[dict]]:
    """Every balanced sample is its shard's current sample, each once; complete tars hold CHUNK, the short
    last one is marked."""
    tars = balanced_samples(layout)
    want = shard_samples(layout, shards)
    got = [s for tar in tars for s in tar]
    assert sorted(s["__key__"] for s in got) == sorted(want)
    for s in got:
        assert {e: s[e] for e in ("jpg", "json", "txt")} == {e: want[s["__key__"]][e] for e in ("jpg", "json", "txt")}
    for i, tar in enumerate(tars):
        url = layout.balanced_tar(i)
        if i < len(tars) - 1:
            assert len(tar) == CHUNK and not Path(incomplete_marker(url)).exists()
        else:
            assert Path(incomplete_marker(url)).exists() == (len(tar) < CHUNK)
    return tars


def tar_bytes(layout: Layout) -> dict[int, bytes]:
    return {int(p.stem): p.read_bytes() for p in Path(layout.balanced_dir).glob("*.tar")}


@pytest.fixture
def layout(tmp_path) -> Layout:
    layout = Layout(str(tmp_path))
    write_shard(layout, 0, [0, 1, 2, 3, 4, 5, 6])
    write_shard(layout, 1, [0, 1, 2, 3, 4])
    write_shard(layout, 2, [0, 1, 2, 3, 4, 5])  # 18 samples: 4 complete tars and 2 in the partial
    update_balanced_shards(layout, {"00000": "a", "00001": "a", "00002": "a"}, chunk_size=CHUNK)
    return layout


def test_a_changed_sample_is_replaced_in_its_tar_only(layout):
    before = tar_bytes(layout)
    write_shard(layout, 1, [0, 1, 2, 3, 4], caption=lambda k: "rewritten" if k == key(1, 2) else f"caption of {k}")
    r = update_balanced_shards(layout, {"00000": "a", "00001": "b", "00002": "a"}, chunk_size=CHUNK)
    tars = assert_in_step(layout, ["00000", "00001", "00002"])
    holder = next(i for i, tar in enumerate(tars) if any(s["__key__"] == key(1, 2) for s in tar))
    assert r.samples_replaced == 1 and r.samples_removed == 0 and r.samples_added == 0
    after = tar_bytes(layout)
    assert [i for i in after if after[i] != before[i]] == [holder]  # one tar written again, nothing else
    assert not any(f"caption of {key(1, 2)}".encode() in data for data in after.values())


def test_removed_samples_leave_holes_filled_from_the_end(layout):
    before = tar_bytes(layout)
    write_shard(layout, 0, [0, 2, 4, 5, 6])  # 000001 and 000003 are gone (both in tar 0)
    r = update_balanced_shards(layout, {"00000": "b", "00001": "a", "00002": "a"}, chunk_size=CHUNK)
    tars = assert_in_step(layout, ["00000", "00001", "00002"])
    assert r.samples_removed == 2 and [len(t) for t in tars] == [4, 4, 4, 4]  # the partial's 2 filled tar 0
    after = tar_bytes(layout)
    assert [i for i in after if after.get(i) != before.get(i)] == [0] and 4 not in after  # the partial went
    for data in after.values():
        assert _jpeg(int(key(0, 1))) not in data and _jpeg(int(key(0, 3))) not in data

    # more samples go than the partial holds: the last complete tar dissolves into the holes
    write_shard(layout, 1, [0])
    r = update_balanced_shards(layout, {"00000": "b", "00001": "c", "00002": "a"}, chunk_size=CHUNK)
    tars = assert_in_step(layout, ["00000", "00001", "00002"])
    assert [len(t) for t in tars] == [4, 4, 4] and r.samples_removed == 4 and len(r.removed_tars) == 1


def test_a_shard_not_ready_is_withdrawn_until_it_is_again(layout):
    r = update_balanced_shards(layout, {"00000": "a", "00001": None, "00002": "a"}, chunk_size=CHUNK)
    assert_in_step(layout, ["00000", "00002"])
    assert r.samples_removed == 5 and "00001" not in load_state(layout)["shards"]
    r = update_balanced_shards(layout, {"00000": "a", "00001": "b", "00002": "a"}, chunk_size=CHUNK)
    assert_in_step(layout, ["00000", "00001", "00002"])
    assert r.samples_added == 5


def test_new_samples_of_a_consumed_shard_are_appended_and_a_selection_is_honoured(layout):
    write_shard(layout, 2, [0, 1, 2, 3, 4, 5, 7, 8])
    r = update_balanced_shards(layout, {"00000": "a", "00001": "a", "00002": "b"}, chunk_size=CHUNK)
    assert r.samples_added == 2
    assert_in_step(layout, ["00000", "00001", "00002"])
    dropped = {key(0, 3), key(2, 4)}
    r = update_balanced_shards(layout, {"00000": "s", "00001": "a", "00002": "s"}, chunk_size=CHUNK,
                               selected=lambda shard: None if shard == "00001" else
                               {k for k in shard_samples(layout, [shard]) if k not in dropped})
    got = {s["__key__"] for tar in balanced_samples(layout) for s in tar}
    assert got == set(shard_samples(layout, ["00000", "00001", "00002"])) - dropped and r.samples_removed == 2


def test_nothing_changed_writes_nothing_and_an_interrupted_update_is_redone(layout):
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(layout.balanced_dir).rglob("*") if p.is_file()}
    r = update_balanced_shards(layout, {"00000": "a", "00001": "a", "00002": "a"}, chunk_size=CHUNK)
    assert not r.changed
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(layout.balanced_dir).rglob("*")
            if p.is_file()} == snapshot
    # a crash in the middle of an update: the next one writes every tar again from the shards
    write_shard(layout, 0, [0, 2, 4])
    Path(layout.balanced_dir, ".pending").write_bytes(b"")
    r = update_balanced_shards(layout, {"00000": "b", "00001": "a", "00002": "a"}, chunk_size=CHUNK)
    assert r.rebuilt == "an earlier update was interrupted"
    assert_in_step(layout, ["00000", "00001", "00002"])
    assert not Path(layout.balanced_dir, ".pending").exists()
    # a tar changed behind the state's back (its samples no longer what the manifest says): rebuilt too
    Path(layout.balanced_tar(0)).write_bytes(Path(layout.balanced_tar(1)).read_bytes())
    write_shard(layout, 0, [0, 2])
    r = update_balanced_shards(layout, {"00000": "c", "00001": "a", "00002": "a"}, chunk_size=CHUNK)
    assert r.rebuilt and "00000.tar" in r.rebuilt
    assert_in_step(layout, ["00000", "00001", "00002"])
