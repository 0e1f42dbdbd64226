"""Source listing and the shard ledger: stable ids, incremental registration, clear errors."""

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.config import config_from_dict
from shardprep.layout import Layout
from shardprep.ledger import LedgerError, load_ledger, register_sources
from shardprep.sources import SourceError, list_source_files, read_rows


def _parquet(path, n, start=0, cols=("url", "caption"), row_group_size=7):
    data = {"url": [f"http://x/{i}.jpg" for i in range(start, start + n)],
            "caption": [f"c{i}" for i in range(start, start + n)], "extra": list(range(start, start + n))}
    pq.write_table(pa.table({c: data[c] for c in (*cols, "extra")}), str(path), row_group_size=row_group_size)


def _cfg(tmp_path, **kw):
    return config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"),
                             "samples_per_shard": 10, **kw})


def test_shards_are_stable_and_new_files_only_add(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 25)
    _parquet(tmp_path / "src" / "b.parquet", 10, start=100)
    cfg = _cfg(tmp_path)
    reg = register_sources(cfg)
    assert reg.new_keys == ["00000", "00001", "00002", "00003"]
    ledger = load_ledger(Layout(cfg.output_root))
    s2 = ledger.shard("00002")
    assert (s2.source.endswith("a.parquet"), s2.row_start, s2.row_stop) == (True, 20, 25)
    assert read_rows(s2.source, s2.row_start, s2.row_stop)["extra"].to_pylist() == list(range(20, 25))
    assert read_rows(ledger.shard("00003").source, 0, 10)["extra"].to_pylist() == list(range(100, 110))

    before = (tmp_path / "out" / "ledger.json").read_bytes()
    again = register_sources(cfg)
    assert again.new_keys == [] and again.all_keys == reg.all_keys
    assert (tmp_path / "out" / "ledger.json").read_bytes() == before

    # a new file sorting *before* the others still only appends shard ids
    _parquet(tmp_path / "src" / "0first.parquet", 11, start=500)
    third = register_sources(cfg)
    assert third.new_keys == ["00004", "00005"]
    assert load_ledger(Layout(cfg.output_root)).shard("00000").source.endswith("a.parquet")


def test_changed_source_is_reported_not_resharded(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 12)
    cfg = _cfg(tmp_path)
    register_sources(cfg)
    _parquet(tmp_path / "src" / "a.parquet", 30)
    reg = register_sources(cfg)
    assert reg.new_keys == [] and len(reg.changed_sources) == 1 and reg.changed_sources[0].endswith("a.parquet")
    assert len(reg.all_keys) == 2


def test_samples_per_shard_cannot_change_under_a_ledger(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 12)
    register_sources(_cfg(tmp_path))
    with pytest.raises(LedgerError, match="'samples_per_shard' is 5 .* made with 10"):
        register_sources(_cfg(tmp_path, samples_per_shard=5))


def test_bad_sources_name_the_file_and_leave_the_ledger_alone(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 12)
    cfg = _cfg(tmp_path)
    register_sources(cfg)
    ledger_before = (tmp_path / "out" / "ledger.json").read_bytes()

    _parquet(tmp_path / "src" / "b.parquet", 5, cols=("caption",))
    with pytest.raises(SourceError, match=r"b\.parquet: column 'url' \(config field 'url_col'\) is missing"):
        register_sources(cfg)
    (tmp_path / "src" / "b.parquet").unlink()

    (tmp_path / "src" / "c.parquet").write_text("url,caption\nhttp://x,y\n")
    with pytest.raises(SourceError, match=r"c\.parquet: not a readable parquet file"):
        register_sources(cfg)
    (tmp_path / "src" / "c.parquet").unlink()
    assert (tmp_path / "out" / "ledger.json").read_bytes() == ledger_before

    _parquet(tmp_path / "src" / "d.parquet", 0)
    reg = register_sources(cfg)
    assert reg.new_keys == [] and reg.empty_sources[0].endswith("d.parquet")


def test_unreachable_sources_fail_clearly(tmp_path, monkeypatch):
    with pytest.raises(SourceError, match="no such file or folder"):
        list_source_files(str(tmp_path / "missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceError, match=r"hf://datasets/someone/data/\*\.parquet.*cannot list"):
        list_source_files("hf://datasets/someone/data/*.parquet")


def test_any_fsspec_url_works_for_source_and_output(tmp_path):
    # memory:// is a real fsspec backend standing in for object stores (no local paths, no rename)
    fs = fsspec.filesystem("memory")
    with fs.open("/bucket/src/a.parquet", "wb") as f:
        pq.write_table(pa.table({"url": ["u"] * 15, "caption": ["c"] * 15}), f)
    cfg = config_from_dict({"source": "memory://bucket/src/*.parquet", "output_root": "memory://bucket/out",
                            "samples_per_shard": 10})
    reg = register_sources(cfg)
    assert reg.new_keys == ["00000", "00001"]
    raw = json.loads(fs.cat("/bucket/out/ledger.json"))
    src = raw["files"][0]["source"]
    assert src.startswith("memory://") and src.endswith("bucket/src/a.parquet")
    assert not [p for p in fs.find("/bucket/out") if ".tmp-" in p]
