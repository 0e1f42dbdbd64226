"""Balanced (NeMo reorganize_tar) tars, wdinfo.pkl and the Megatron-Energon index.

Oracles: webdataset 0.2 reads every tar, plain ``pickle`` reads wdinfo, the real megatron-energon
7.4.1 loads our index (``get_train_dataset`` + ``get_loader``), and its CLI (``energon prepare``,
``info``, ``lint``) runs on the same tars.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sqlite3
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
import yaml
from PIL import Image

from shardprep.energon import assign_splits, collapse_names, find_tars, read_tar_idx, update_energon_index
from shardprep.keys import compute_key, shard_key
from shardprep.layout import Layout
from shardprep.nemo.balanced import incomplete_marker, update_balanced_shards
from shardprep.nemo.wdinfo import write_wdinfo
from shardprep.tars import TarWriter

ENERGON = str(Path(sys.executable).with_name("energon"))
OOM_SAMPLE = 2  # samples_per_shard = 100
CHUNK = 4
# shard id -> indices of the successful rows (holes = failed downloads); shard 1 had no success at all
FIRST = {0: [0, 1, 3, 4, 5, 8, 9], 1: [], 2: [0, 2, 3, 5, 6, 7]}  # 13 samples: 3 full tars + 1
LATER = {3: [1, 2, 4], 4: [0, 1, 2, 3, 7]}  # +8: the partial fills, one more full, a new partial of 1


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8 + i % 3, 8), ((i * 37) % 256, (i * 91) % 256, 60)).save(buf, "JPEG")
    return buf.getvalue()


def write_shards(layout: Layout, spec: dict[int, list[int]]) -> dict[str, list[str]]:
    """img2dataset-layout tars (``{key}.jpg/.json/.txt``, webdataset TarWriter headers); returns shard -> keys."""
    out = {}
    for shard_id, indices in spec.items():
        shard = shard_key(shard_id)
        keys = [compute_key(i, shard_id, OOM_SAMPLE) for i in indices]
        out[shard] = keys
        if not keys:
            continue  # no success: no tar, as write_image_shard does
        Path(layout.images_dir).mkdir(parents=True, exist_ok=True)
        with TarWriter(layout.tar(shard)) as tar:
            for key in keys:
                tar.add(key, {"jpg": _jpeg(int(key)), "json": json.dumps({"key": key}), "txt": f"caption of {key}"})
    return out


def wds_samples(url: str) -> list[dict]:
    return list(wds.WebDataset(url, shardshuffle=False))


def tar_keys(url: str) -> list[str]:
    return [s["__key__"] for s in wds_samples(url)]


def files_snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    """Balanced tars built in two updates; yields (layout, keys in (shard, index) order, reports, snapshots)."""
    layout = Layout(str(tmp_path_factory.mktemp("balanced-root")))
    first_keys = write_shards(layout, FIRST)
    shards1 = [shard_key(i) for i in FIRST]
    r1 = update_balanced_shards(layout, shards1, chunk_size=CHUNK)
    snap1 = {p: Path(p).read_bytes() for p in r1.complete_tars + [r1.partial_tar]}
    partial1 = r1.partial_tar
    marker1 = Path(incomplete_marker(partial1)).exists()
    later_keys = write_shards(layout, LATER)
    r2 = update_balanced_shards(layout, shards1 + [shard_key(i) for i in LATER], chunk_size=CHUNK)
    keys = [k for d in (first_keys, later_keys) for ks in d.values() for k in ks]
    return dict(layout=layout, keys=keys, r1=r1, r2=r2, snap1=snap1, partial1=partial1, marker1=marker1)


# ------------------------------------------------------------------ balanced tars


def test_first_update_makes_full_tars_and_a_marked_partial(balanced):
    layout, r1 = balanced["layout"], balanced["r1"]
    first = balanced["keys"][:13]
    assert r1.shards_without_tar == ["00001"]
    assert r1.complete_tars == [layout.balanced_tar(i) for i in range(3)]
    assert r1.partial_tar == layout.balanced_tar(3) and r1.partial_count == 1
    assert balanced["marker1"], "the short tar must carry a .INCOMPLETE sidecar"
    got = []
    for path in r1.complete_tars:
        samples = wds_samples(path)  # tars 0..2 are complete, so still the first update's bytes
        assert len(samples) == CHUNK
        for s in samples:
            assert set(s) >= {"jpg", "json", "txt"}
            assert s["txt"].decode() == f"caption of {s['__key__']}"
            assert s["jpg"] == _jpeg(int(s["__key__"]))
        got += [s["__key__"] for s in samples]
    assert got == first[:12]  # (shard, index) order, holes and the tar-less shard skipped


def test_update_keeps_complete_tars_and_fills_the_partial(balanced):
    layout, r2, snap1 = balanced["layout"], balanced["r2"], balanced["snap1"]
    for path in balanced["r1"].complete_tars:
        assert Path(path).read_bytes() == snap1[path], f"{path} was rewritten"
    assert r2.rewritten_tars == [balanced["partial1"]]
    assert r2.new_complete_tars == [layout.balanced_tar(3), layout.balanced_tar(4)]
    assert not Path(incomplete_marker(balanced["partial1"])).exists()
    assert r2.partial_tar == layout.balanced_tar(5) and r2.partial_count == 1
    assert Path(incomplete_marker(r2.partial_tar)).exists()
    all_keys = [k for i in range(6) for k in tar_keys(layout.balanced_tar(i))]
    assert all_keys == balanced["keys"]  # every success once, in (shard, index) order
    assert [len(tar_keys(p)) for p in r2.complete_tars] == [CHUNK] * 5
    assert r2.total_samples == len(balanced["keys"]) == 21


def test_incremental_equals_one_shot_and_noop_rerun(balanced, tmp_path):
    layout = balanced["layout"]
    other = Layout(str(tmp_path))
    shutil.copytree(layout.images_dir, other.images_dir)
    shards = [shard_key(i) for i in [*FIRST, *LATER]]
    update_balanced_shards(other, shards, chunk_size=CHUNK)
    for i in range(6):  # deterministic bytes: building in one go gives the same tars
        assert Path(other.balanced_tar(i)).read_bytes() == Path(layout.balanced_tar(i)).read_bytes()
    before = files_snapshot(Path(other.balanced_dir))
    again = update_balanced_shards(other, shards, chunk_size=CHUNK)
    assert not again.changed and again.samples_added == 0
    assert files_snapshot(Path(other.balanced_dir)) == before
    # final=True drops the marker (the short tar becomes indexable); final=False restores it
    update_balanced_shards(other, shards, chunk_size=CHUNK, final=True)
    assert not Path(incomplete_marker(other.balanced_tar(5))).exists()
    assert find_tars(other.balanced_dir)[-1] == "00005.tar"
    update_balanced_shards(other, shards, chunk_size=CHUNK)
    assert Path(incomplete_marker(other.balanced_tar(5))).exists()
    # crash in the middle of an update (tars written, state.json still the old one, .pending left): the
    # re-run writes every tar again from the shards, the same bytes
    crash = Layout(str(tmp_path / "crash"))
    shutil.copytree(layout.images_dir, crash.images_dir)
    update_balanced_shards(crash, shards[:3], chunk_size=CHUNK)
    old_state = Path(crash.balanced_dir, "state.json").read_bytes()
    update_balanced_shards(crash, shards, chunk_size=CHUNK)
    Path(crash.balanced_dir, "state.json").write_bytes(old_state)
    Path(crash.balanced_dir, ".pending").write_bytes(b"")
    assert update_balanced_shards(crash, shards, chunk_size=CHUNK).rebuilt == "an earlier update was interrupted"

    def outputs(folder: str) -> dict[str, bytes]:
        return {p: d for p, (d, _) in files_snapshot(Path(folder)).items()
                if p == "state.json" or p.endswith((".tar", ".INCOMPLETE"))}

    assert outputs(crash.balanced_dir) == outputs(layout.balanced_dir)
    assert not Path(crash.balanced_dir, ".pending").exists()
    with pytest.raises(ValueError, match="chunk_size=4, not 5"):
        update_balanced_shards(other, shards, chunk_size=5)


# ------------------------------------------------------------------ wdinfo


def test_wdinfo_lists_complete_tars_only(balanced):
    layout = balanced["layout"]
    info = write_wdinfo(layout.balanced_dir, layout.balanced_wdinfo, CHUNK)
    with open(layout.balanced_wdinfo, "rb") as f:
        loaded = pickle.load(f)
    assert loaded == info
    assert set(loaded) == {"tar_files", "chunk_size", "total_key_count"}
    assert type(loaded["tar_files"]) is list and all(type(t) is str for t in loaded["tar_files"])
    assert type(loaded["chunk_size"]) is int and type(loaded["total_key_count"]) is int
    assert loaded["tar_files"] == [f"{i:05d}.tar" for i in range(5)]  # 00005.tar is INCOMPLETE
    assert loaded["chunk_size"] == CHUNK and loaded["total_key_count"] == 5 * CHUNK
    for rel in loaded["tar_files"]:
        assert len(tar_keys(os.path.join(layout.balanced_dir, rel))) == CHUNK


def test_wdinfo_subfolders_and_short_tar(balanced, tmp_path):
    src = balanced["layout"]
    root = tmp_path / "reorganized"
    for task, i in (("task0000", 0), ("task0000", 1), ("task0001", 2)):
        (root / task).mkdir(parents=True, exist_ok=True)
        shutil.copy(src.balanced_tar(i), root / task / f"{i:05d}.tar")
    shutil.copy(src.balanced_tar(5), root / "task0001" / "00005.tar")  # short, marked
    (root / "task0001" / "00005.tar.INCOMPLETE").write_bytes(b"")
    (root / "task0002").mkdir()
    (root / "task0002" / "00009.tar").write_bytes(b"")  # size 0: skipped like NeMo does
    info = write_wdinfo(str(root), str(tmp_path / "wdinfo.pkl"), CHUNK)
    assert info == {"tar_files": ["task0000/00000.tar", "task0000/00001.tar", "task0001/00002.tar"],
                    "chunk_size": CHUNK, "total_key_count": 3 * CHUNK}
    for rel in info["tar_files"]:
        assert len(tar_keys(str(root / rel))) == CHUNK
    # an energon .tar.idx newer than its tar is trusted for the count (here a wrong one, to prove it is read)
    (root / "task0000" / "00001.tar.idx").write_bytes(struct.pack("3Q", 0, 512, 1024))
    with pytest.raises(ValueError, match=r"task0000/00001\.tar: holds 2 samples"):
        write_wdinfo(str(root), str(tmp_path / "wdinfo.pkl"), CHUNK)
    (root / "task0000" / "00001.tar.idx").unlink()
    (root / "task0001" / "00005.tar.INCOMPLETE").unlink()  # now a short tar would be listed
    with pytest.raises(ValueError, match=r"task0001/00005\.tar: holds 1 samples, but wdinfo chunk_size is 4"):
        write_wdinfo(str(root), str(tmp_path / "wdinfo.pkl"), CHUNK)


# ------------------------------------------------------------------ energon index


def _energon_loader(path: str, split: str, task_encoder=None, batch_size: int = 3):
    from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset

    ds = get_train_dataset(path, split_part=split, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=batch_size, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           repeat=False, task_encoder=task_encoder or DefaultTaskEncoder())
    return get_loader(ds)


def _split_files(dataset: Path) -> dict[str, list[str]]:
    import braceexpand

    doc = yaml.safe_load((dataset / ".nv-meta" / "split.yaml").read_text())
    assert doc["exclude"] == []
    return {s: [n for p in v for n in braceexpand.braceexpand(p)] for s, v in doc["split_parts"].items()}


def _sqlite_rows(dataset: Path):
    info = json.loads((dataset / ".nv-meta" / ".info.json").read_text())
    names = list(info["shard_counts"])
    db = sqlite3.connect(dataset / ".nv-meta" / "index.sqlite")
    try:
        samples = sorted((names[t], k, i, o, s) for t, k, i, o, s in db.execute("SELECT * FROM samples"))
        parts = sorted((names[t], i, p, o, s) for t, i, p, o, s in db.execute("SELECT * FROM sample_parts"))
        schema = {t: db.execute(f"PRAGMA table_info({t})").fetchall() for t in ("samples", "sample_parts")}
        indexes = sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index' AND sql IS NOT NULL"))
    finally:
        db.close()
    return info["shard_counts"], samples, parts, schema, indexes


@pytest.fixture(scope="module")
def image_dataset(balanced, tmp_path_factory):
    """Our index over the 5 complete balanced tars, with a val split."""
    layout = balanced["layout"]
    report = update_energon_index(layout.balanced_dir, sample_type="captioning", split_ratio=(0.6, 0.4, 0.0))
    return Path(layout.balanced_dir), report


def test_energon_loads_our_image_index(image_dataset, balanced):
    dataset, report = image_dataset
    assert report.tars == [f"{i:05d}.tar" for i in range(5)]  # the INCOMPLETE 00005.tar is left out
    meta = dataset / ".nv-meta"
    assert yaml.safe_load((meta / ".info.yaml").read_text()) == {"shard_counts": {t: CHUNK for t in report.tars}}
    assert yaml.safe_load((meta / "dataset.yaml").read_text()) == {
        "sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
        "field_map": {"image": "jpg", "caption": "txt"}}
    splits = _split_files(dataset)
    assert splits["train"] and splits["val"] and sorted(splits["train"] + splits["val"]) == report.tars
    for split in ("train", "val"):
        expected = sorted(k for t in splits[split] for k in tar_keys(str(dataset / t)))
        seen = []
        for batch in _energon_loader(str(dataset), split):
            assert type(batch).__name__ == "CaptioningSample"
            assert batch.image.shape[1] == 3 and batch.image.shape[2] == 8
            assert batch.caption == [f"caption of {k}" for k in batch.__key__]
            seen += batch.__key__
        assert sorted(seen) == expected  # each key of the split exactly once


def test_energon_cli_agrees_with_our_index(image_dataset, tmp_path):
    dataset, report = image_dataset
    copy = tmp_path / "copy"
    copy.mkdir()
    for t in report.tars:
        shutil.copy(dataset / t, copy / t)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {
        "prepare": subprocess.Popen(
            [ENERGON, "prepare", str(copy), "--non-interactive", "--split-ratio", "1,0,0", "--num-workers", "1",
             "--no-progress", "--sample-type", "CaptioningSample", "--field-map", '{"image":"jpg","caption":"txt"}'],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env),
        "info": subprocess.Popen([ENERGON, "info", str(dataset)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env),
        "lint": subprocess.Popen([ENERGON, "lint", str(dataset)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env),
    }
    outputs = {name: p.communicate(timeout=120)[0].decode(errors="replace") for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"energon {name} failed:\n{outputs[name][-3000:]}"
    assert "20 samples" in outputs["info"] and "5 shards" in outputs["info"]

    ours, theirs = _sqlite_rows(dataset), _sqlite_rows(copy)
    assert ours[0] == theirs[0]  # shard_counts, same order
    assert ours[1] == theirs[1]  # samples: tar, key, index, byte offset, byte size
    assert ours[2] == theirs[2]  # sample_parts
    assert ours[3] == theirs[3] and ours[4] == theirs[4]  # schema and indexes
    for t in report.tars:
        assert (dataset / f"{t}.idx").read_bytes() == (copy / f"{t}.idx").read_bytes()


def _write_crude_tar(path: Path, keys: list[str]) -> None:
    import torch

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key in keys:
            buf = io.BytesIO()
            torch.save(torch.full((2, 1, 2, 2), float(int(key)), dtype=torch.bfloat16), buf)
            for name, data in ((f"{key}..json", json.dumps({"image_height": 16, "image_width": 16}).encode()),
                               (f"{key}..pth", buf.getvalue())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_crude_dataset_with_stateless_cooker(tmp_path):
    from megatron.energon import Cooker, DefaultTaskEncoder, TextSample, basic_sample_keys, stateless

    dataset = tmp_path / "diffusion"
    dataset.mkdir()
    _write_crude_tar(dataset / "rank0-000000.tar", ["000000", "000001", "000002"])
    _write_crude_tar(dataset / "rank0-000001.tar", ["000003", "000004"])
    report = update_energon_index(str(dataset), sample_type="crude", split_ratio=(1, 0, 0))
    assert report.shard_counts == {"rank0-000000.tar": 3, "rank0-000001.tar": 2}
    assert yaml.safe_load((dataset / ".nv-meta" / "dataset.yaml").read_text()) == {
        "__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    _, samples, parts, _, _ = _sqlite_rows(dataset)
    assert sorted(s[1] for s in samples) == [f"{i:06d}" for i in range(5)]  # "000000..pth" -> key "000000"
    assert {p[2] for p in parts} == {".json", ".pth"}

    @stateless
    def cook(sample: dict) -> TextSample:
        latent, meta = sample[".pth"], sample[".json"]
        return TextSample(**basic_sample_keys(sample),
                          text=f"{latent.dtype}:{tuple(latent.shape)}:{float(latent.float().mean())}:{meta['image_width']}")

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    texts = {}
    for batch in _energon_loader(str(dataset), "train", Encoder(), batch_size=2):
        texts.update(zip(batch.__key__, batch.text))
    assert texts == {f"{i:06d}": f"torch.bfloat16:(2, 1, 2, 2):{float(i)}:16" for i in range(5)}


def test_incremental_index_keeps_existing_files(image_dataset, balanced, tmp_path):
    dataset, report = image_dataset
    copy = tmp_path / "inc"
    copy.mkdir()
    for t in report.tars:
        shutil.copy(dataset / t, copy / t)
    r1 = update_energon_index(str(copy), sample_type="captioning", split_ratio=(0.5, 0.5, 0), tars=report.tars[:3])
    assert r1.scanned_tars == report.tars[:3] and r1.splits["val"]
    idx_before = {t: ((copy / f"{t}.idx").read_bytes(), (copy / f"{t}.idx").stat().st_mtime_ns) for t in r1.tars}
    assert not (copy / "00003.tar.idx").exists()

    noop = update_energon_index(str(copy), sample_type="captioning", split_ratio=(0.5, 0.5, 0), tars=report.tars[:3])
    assert noop.files_written == [] and noop.uuid == r1.uuid and not noop.index_changed

    r2 = update_energon_index(str(copy), sample_type="captioning", split_ratio=(0.5, 0.5, 0))  # default: all 5
    assert r2.kept_tars == r1.tars and r2.scanned_tars == report.tars[3:]
    for t, (data, mtime) in idx_before.items():
        assert (copy / f"{t}.idx").read_bytes() == data and (copy / f"{t}.idx").stat().st_mtime_ns == mtime
    for t in r2.scanned_tars:
        assert read_tar_idx(str(copy / f"{t}.idx")) == read_tar_idx(str(dataset / f"{t}.idx"))
    assert r2.uuid != r1.uuid and (copy / ".nv-meta" / "index.uuid").read_text() == r2.uuid
    for split, tars in r1.splits.items():  # old tars stay where they were
        assert set(tars) <= set(r2.splits[split])
    counts, samples, _, _, _ = _sqlite_rows(copy)
    assert counts == {t: CHUNK for t in report.tars}
    assert sorted(s[1] for s in samples) == sorted(k for t in report.tars for k in tar_keys(str(copy / t)))
    assert _sqlite_rows(copy)[1:3] == _sqlite_rows(dataset)[1:3]  # same rows as a one-shot index

    # a tar rewritten on disk is rescanned in place (same position and split), the others are kept
    shutil.copy(balanced["layout"].balanced_tar(5), copy / "00001.tar")  # the 1-sample partial tar
    r3 = update_energon_index(str(copy), sample_type="captioning", split_ratio=(0.5, 0.5, 0))
    assert r3.changed_tars == ["00001.tar"] and r3.scanned_tars == ["00001.tar"] and r3.tars == r2.tars
    assert r3.shard_counts["00001.tar"] == 1 and r3.splits == r2.splits
    assert (copy / "00001.tar.idx").read_bytes() != idx_before["00001.tar"][0]
    assert sorted(s[1] for s in _sqlite_rows(copy)[1]) == sorted(
        k for t in report.tars for k in tar_keys(str(copy / t)))

    # an index we did not write last (here: energon prepare's new uuid) is rebuilt from scratch,
    # but .tar.idx files that come out identical are not rewritten
    (copy / ".nv-meta" / "index.uuid").write_text("00000000-0000-4000-8000-000000000000")
    idx_now = {t: (copy / f"{t}.idx").stat().st_mtime_ns for t in r3.tars}
    rows_now = _sqlite_rows(copy)
    r4 = update_energon_index(str(copy), sample_type="captioning", split_ratio=(0.5, 0.5, 0))
    assert r4.kept_tars == [] and sorted(r4.scanned_tars) == sorted(r3.tars) and r4.splits == r3.splits
    assert {t: (copy / f"{t}.idx").stat().st_mtime_ns for t in r3.tars} == idx_now
    assert r4.uuid != r3.uuid and _sqlite_rows(copy) == rows_now


def test_full_disk_while_publishing_the_sqlite_keeps_the_previous_index(image_dataset, tmp_path, monkeypatch):
    import errno

    from shardprep import storage

    dataset, report = image_dataset
    copy = tmp_path / "full"
    copy.mkdir()
    for t in report.tars:
        shutil.copy(dataset / t, copy / t)
    first = update_energon_index(str(copy), sample_type="captioning", tars=report.tars[:3])
    meta = copy / ".nv-meta"
    before = (meta / "index.sqlite").read_bytes()
    real_copy = storage.shutil.copyfileobj

    def full_disk(src, dst, *args):
        if ".index.sqlite" + storage.TEMP_MARK not in getattr(dst, "name", ""):
            return real_copy(src, dst, *args)
        dst.write(src.read(4096))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.shutil, "copyfileobj", full_disk)
    with pytest.raises(OSError) as err:
        update_energon_index(str(copy), sample_type="captioning")  # all 5 tars: the sqlite changes
    assert err.value.errno == errno.ENOSPC
    assert (meta / "index.sqlite").read_bytes() == before
    assert not [p.name for p in meta.iterdir() if storage.TEMP_MARK in p.name]
    keys = [k for batch in _energon_loader(str(copy), "train") for k in batch.__key__]
    assert sorted(keys) == sorted(k for t in first.tars for k in tar_keys(str(copy / t)))  # still loadable

    monkeypatch.undo()
    (meta / f".index.sqlite{storage.TEMP_MARK}0123456789ab").write_bytes(b"left by an older release")
    # a gone writer's temp goes with the next process that writes into its folder (this one swept it already)
    code = ("import json, sys; from shardprep.energon import update_energon_index; "
            "r = update_energon_index(sys.argv[1], sample_type='captioning'); "
            "print(json.dumps([list(r.tars), list(r.kept_tars), r.index_changed]))")
    done = subprocess.run([sys.executable, "-c", code, str(copy)], check=True, capture_output=True, text=True)
    tars, kept, changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert tars == list(report.tars) and kept == list(first.tars) and changed
    assert not [p.name for p in meta.rglob("*") if storage.TEMP_MARK in p.name]
    keys = [k for batch in _energon_loader(str(copy), "train") for k in batch.__key__]
    assert sorted(keys) == sorted(k for t in report.tars for k in tar_keys(str(copy / t)))


def test_index_refuses_duplicate_keys_and_empty_tars(tmp_path):
    dataset = tmp_path / "bad"
    dataset.mkdir()
    _write_crude_tar(dataset / "a.tar", ["000001", "000002"])
    update_energon_index(str(dataset), sample_type="crude")
    before = files_snapshot(dataset)

    _write_crude_tar(dataset / "b.tar", ["000003", "000002"])
    with pytest.raises(ValueError, match=r"duplicate sample key '000002': in .*b\.tar and in .*a\.tar"):
        update_energon_index(str(dataset), sample_type="crude")
    (dataset / "b.tar").unlink()
    with tarfile.open(dataset / "empty.tar", "w"):
        pass
    with pytest.raises(ValueError, match=r"empty\.tar: tar has no samples"):
        update_energon_index(str(dataset), sample_type="crude")
    (dataset / "empty.tar").unlink()
    assert files_snapshot(dataset) == before  # nothing written by the refused updates

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _write_crude_tar(fresh / "c.tar", ["000001", "000002"])
    with tarfile.open(fresh / "c2.tar", "w", format=tarfile.USTAR_FORMAT) as tar:  # same key twice, non-contiguous
        for name in ("000007..json", "000008..json", "000007..pth"):
            info = tarfile.TarInfo(name)
            tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match=r"c2\.tar: duplicate sample key '000007'"):
        update_energon_index(str(fresh), sample_type="crude")
    assert not (fresh / ".nv-meta").exists() and not (fresh / "c.tar.idx").exists()


# ------------------------------------------------------------------ split rule


def test_split_rule_is_stable_and_never_leaves_val_empty():
    # extreme ratios force the "an empty split takes one tar" step (hashes alone would leave it empty)
    for ratio in ((0.9, 0.1, 0.0), (0.999, 0.001, 0.0), (0.001, 0.999, 0.0), (0.998, 0.001, 0.001)):
        wanted = [name for name, r in zip(("train", "val", "test"), ratio) if r > 0]
        for n in range(len(wanted), 12):
            tars = [f"{i:05d}.tar" for i in range(n)]
            splits = assign_splits(tars, ratio, None)
            assert all(splits[name] for name in wanted), (ratio, n, splits)
            assert sorted(t for ts in splits.values() for t in ts) == tars
            more = tars + [f"{i:05d}.tar" for i in range(n, n + 5)]
            previous = {t: [s] for s, ts in splits.items() for t in ts}
            later = assign_splits(more, ratio, None, previous)
            for s, ts in splits.items():
                assert set(ts) <= set(later[s])
    assert assign_splits(["a.tar"], (0.9, 0.1, 0.0), None) == {"train": ["a.tar"], "val": [], "test": []}
    by_pattern = assign_splits(["t/00000.tar", "t/00001.tar", "v/00000.tar"], None,
                               {"train": [r"t/"], "val": [r"v/"]})
    assert by_pattern == {"train": ["t/00000.tar", "t/00001.tar"], "val": ["v/00000.tar"]}
    assert collapse_names(["00000.tar", "00001.tar", "00002.tar", "00007.tar", "x/00008.tar"]) == [
        "{00000..00002}.tar", "00007.tar", "x/00008.tar"]
