"""Source listing and the shard ledger: stable ids, incremental registration, clear errors."""

import json
import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.config import config_from_dict
from shardprep.layout import Layout
from shardprep.ledger import LedgerError, SourceChangedError, load_ledger, register_sources, reshard_source
from shardprep.sources import SourceError, fingerprint, list_source_files, read_rows


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


# -- source files that change after registration ---------------------------------------------------

def _table(n, start=0):
    return pa.table({"url": [f"http://x/{i}.jpg" for i in range(start, start + n)],
                     "caption": [f"c{i}" for i in range(start, start + n)], "extra": list(range(start, start + n))})


def _rewrite(path, table):
    """Rewrite a source file; its mtime moves on even on a coarse clock (the fingerprint must change)."""
    before = os.stat(path).st_mtime_ns if os.path.exists(path) else 0
    pq.write_table(table, str(path), row_group_size=7)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def _set_row(table, column, row, value):
    values = table[column].to_pylist()
    values[row] = value
    return table.set_column(table.column_names.index(column), column, pa.array(values, table.schema.field(column).type))


def _copy_shards(cfg, keys):
    """What source_parquet does: each shard's rows copied to <root>/parquet/{shard}.parquet."""
    layout = Layout(cfg.output_root)
    ledger = load_ledger(layout)
    for key in keys:
        s = ledger.shard(key)
        os.makedirs(os.path.dirname(layout.source_parquet(key)), exist_ok=True)
        pq.write_table(read_rows(s.source, s.row_start, s.row_stop), layout.source_parquet(key))


def _ranges(cfg):
    return [(s.key, os.path.basename(s.source), s.row_start, s.row_stop)
            for s in load_ledger(Layout(cfg.output_root)).shards()]


def _two_files(tmp_path, a_rows=25, copies=True):
    """a.parquet (a_rows rows) and b.parquet (10 rows) registered; shards copied if ``copies``."""
    (tmp_path / "src").mkdir()
    _rewrite(tmp_path / "src" / "a.parquet", _table(a_rows))
    _rewrite(tmp_path / "src" / "b.parquet", _table(10, start=100))
    cfg = _cfg(tmp_path)
    reg = register_sources(cfg)
    if copies:
        _copy_shards(cfg, reg.new_keys)
    return cfg, tmp_path / "src" / "a.parquet"


@pytest.mark.parametrize("copies", [True, False], ids=["checked-against-copies", "checked-by-digest"])
def test_appended_rows_become_new_shards_and_old_ones_stay(tmp_path, copies):
    cfg, a = _two_files(tmp_path, copies=copies)
    before = _ranges(cfg)
    assert before == [("00000", "a.parquet", 0, 10), ("00001", "a.parquet", 10, 20), ("00002", "a.parquet", 20, 25),
                      ("00003", "b.parquet", 0, 10)]
    _rewrite(a, pa.concat_tables([pq.read_table(str(a)), _table(50, start=25)]))  # the old rows + 50 new ones

    reg = register_sources(cfg)
    assert reg.new_keys == ["00004", "00005", "00006", "00007", "00008"]  # ids continue from the ledger's next id
    assert [u.endswith("a.parquet") for u in reg.appended_sources] == [True]
    after = _ranges(cfg)
    assert after[:4] == before  # old shards untouched: the short shard 00002 is not refilled
    assert after[4:] == [("00004", "a.parquet", 25, 35), ("00005", "a.parquet", 35, 45), ("00006", "a.parquet", 45, 55),
                         ("00007", "a.parquet", 55, 65), ("00008", "a.parquet", 65, 75)]
    s = load_ledger(Layout(cfg.output_root)).shard("00004")
    assert read_rows(s.source, s.row_start, s.row_stop)["extra"].to_pylist() == list(range(25, 35))

    raw = json.loads((tmp_path / "out" / "ledger.json").read_bytes())
    assert raw["version"] == 2
    entry = raw["files"][0]
    assert entry["rows"] == 75 and entry["segments"] == [
        {"first_shard": 0, "num_shards": 3, "row_start": 0, "row_stop": 25},
        {"first_shard": 4, "num_shards": 5, "row_start": 25, "row_stop": 75}]
    before_bytes = (tmp_path / "out" / "ledger.json").read_bytes()
    again = register_sources(cfg)
    assert again.new_keys == [] and (tmp_path / "out" / "ledger.json").read_bytes() == before_bytes


def test_a_touched_file_with_the_same_rows_is_not_an_error(tmp_path):
    cfg, a = _two_files(tmp_path)
    _rewrite(a, pq.read_table(str(a)))
    reg = register_sources(cfg)
    assert reg.new_keys == [] and reg.appended_sources == [] and len(reg.all_keys) == 4


def test_a_rewritten_row_is_an_error_naming_the_file_and_the_reshard_command(tmp_path):
    cfg, a = _two_files(tmp_path)
    ledger_before = (tmp_path / "out" / "ledger.json").read_bytes()
    _rewrite(a, pa.concat_tables([_set_row(_table(25), "caption", 15, "rewritten"), _table(5, start=25)]))
    with pytest.raises(SourceChangedError) as err:
        register_sources(cfg, config_path="/etc/shardprep.yaml")
    msg = str(err.value)
    assert isinstance(err.value, LedgerError)  # the CLI exits 2 on it
    assert f"source file file://{a} changed after its shards were assigned" in msg
    assert "rows 10-19 (shard 00001) changed" in msg and "parquet/00001.parquet" in msg
    assert f"shardprep reshard --config /etc/shardprep.yaml --source file://{a}" in msg
    assert (tmp_path / "out" / "ledger.json").read_bytes() == ledger_before  # appended rows not registered either


def test_a_rewritten_row_of_a_never_copied_shard_is_found_by_the_digest(tmp_path):
    cfg, a = _two_files(tmp_path, copies=False)
    _rewrite(a, _set_row(_table(25), "url", 3, "http://elsewhere/3.jpg"))
    with pytest.raises(SourceChangedError, match=r"a\.parquet changed .*rows 0-24 changed: the digest of their "
                                                 r"'url' values .*"
                                                 r"shardprep reshard --config <config> --source file://"):
        register_sources(cfg)


def test_a_shrunk_file_is_an_error(tmp_path):
    cfg, a = _two_files(tmp_path)
    _rewrite(a, _table(18))
    with pytest.raises(SourceChangedError, match=r"a\.parquet changed .*: now 18 rows, 25 were registered.*"
                                                 r"shardprep reshard --config"):
        register_sources(cfg)


def test_changed_columns_are_an_error(tmp_path):
    cfg, a = _two_files(tmp_path, copies=False)
    _rewrite(a, _table(25).append_column("more", pa.array(range(25))))
    with pytest.raises(SourceChangedError, match=r"columns changed: .*'more'"):
        register_sources(cfg)


def test_reshard_invalidates_exactly_the_changed_shards(tmp_path):
    cfg, a = _two_files(tmp_path, a_rows=30)  # a: shards 00000-00002 (full), b: 00003
    layout = Layout(cfg.output_root)
    _rewrite(a, pa.concat_tables([_set_row(_table(30), "caption", 12, "rewritten"), _table(5, start=30)]))
    with pytest.raises(SourceChangedError):
        register_sources(cfg)

    result = reshard_source(cfg, f"file://{a}")
    assert result.invalidated == ["00001"] and result.emptied == [] and result.new_keys == ["00004"]
    assert not os.path.exists(layout.source_parquet("00001"))  # removed, so it is copied again
    assert all(os.path.exists(layout.source_parquet(k)) for k in ("00000", "00002", "00003"))
    assert _ranges(cfg) == [("00000", "a.parquet", 0, 10), ("00001", "a.parquet", 10, 20),
                            ("00002", "a.parquet", 20, 30), ("00003", "b.parquet", 0, 10), ("00004", "a.parquet", 30, 35)]
    again = register_sources(cfg)  # the new fingerprint and digest are recorded: no error any more
    assert again.new_keys == [] and len(again.all_keys) == 5
    assert reshard_source(cfg, str(a)).invalidated == []  # a plain path names the same file; nothing left to redo


def test_reshard_of_a_shrunk_file_empties_the_shards_past_its_end(tmp_path):
    cfg, a = _two_files(tmp_path, a_rows=30)
    layout = Layout(cfg.output_root)
    _rewrite(a, _table(15))  # rows 0-14 unchanged, 15-29 gone
    result = reshard_source(cfg, f"file://{a}")
    assert result.invalidated == ["00001", "00002"] and result.emptied == ["00002"] and result.new_keys == []
    assert os.path.exists(layout.source_parquet("00000"))
    assert not os.path.exists(layout.source_parquet("00001")) and not os.path.exists(layout.source_parquet("00002"))
    assert _ranges(cfg) == [("00000", "a.parquet", 0, 10), ("00001", "a.parquet", 10, 15),
                            ("00002", "a.parquet", 15, 15), ("00003", "b.parquet", 0, 10)]
    assert load_ledger(layout).shard("00002").rows == 0  # the id is kept, never reused

    _rewrite(a, _table(28))  # grows again: new ids, the short shard 00001 stays short
    assert register_sources(cfg).new_keys == ["00004", "00005"]
    assert _ranges(cfg)[1:3] == [("00001", "a.parquet", 10, 15), ("00002", "a.parquet", 15, 15)]
    assert _ranges(cfg)[4:] == [("00004", "a.parquet", 15, 25), ("00005", "a.parquet", 25, 28)]


def test_reshard_of_an_unknown_file_says_so(tmp_path):
    cfg, _ = _two_files(tmp_path, copies=False)
    with pytest.raises(LedgerError, match=r"zz\.parquet is not in the ledger"):
        reshard_source(cfg, str(tmp_path / "src" / "zz.parquet"))


def test_a_version_1_ledger_loads_and_is_written_as_version_2(tmp_path):
    (tmp_path / "src").mkdir()
    _rewrite(tmp_path / "src" / "a.parquet", _table(25))
    _rewrite(tmp_path / "src" / "b.parquet", _table(0))
    cfg = _cfg(tmp_path)
    fs, a_path = fsspec.core.url_to_fs(str(tmp_path / "src" / "a.parquet"))
    a_url, b_url = fs.unstrip_protocol(a_path), fs.unstrip_protocol(str(tmp_path / "src" / "b.parquet"))
    v1 = {"version": 1, "samples_per_shard": 10, "oom_shard_count": 5, "files": [
        {"source": a_url, "fingerprint": fingerprint(fs.info(a_path)), "rows": 25, "first_shard": 0, "num_shards": 3,
         "columns": ["url", "caption", "extra"]},
        {"source": b_url, "fingerprint": fingerprint(fs.info(str(tmp_path / "src" / "b.parquet"))), "rows": 0,
         "first_shard": 3, "num_shards": 0, "columns": ["url", "caption", "extra"]}]}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ledger.json").write_text(json.dumps(v1))
    assert _ranges(cfg) == [("00000", "a.parquet", 0, 10), ("00001", "a.parquet", 10, 20),
                            ("00002", "a.parquet", 20, 25)]
    reg = register_sources(cfg)
    assert reg.new_keys == [] and reg.all_keys == ["00000", "00001", "00002"]
    raw = json.loads((tmp_path / "out" / "ledger.json").read_bytes())
    assert raw["version"] == 2 and raw["files"][1]["segments"] == []
    assert raw["files"][0]["segments"] == [{"first_shard": 0, "num_shards": 3, "row_start": 0, "row_stop": 25}]
    # v1 files carry no digest: appended rows are checked against the copies alone, then one is taken
    _copy_shards(cfg, ["00000"])
    _rewrite(tmp_path / "src" / "a.parquet", _table(36))  # 11 rows more: 2 shards
    assert register_sources(cfg).new_keys == ["00003", "00004"]


def test_a_ledger_of_an_unknown_version_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ledger.json").write_text(json.dumps({"version": 9, "samples_per_shard": 10,
                                                              "oom_shard_count": 5, "files": []}))
    with pytest.raises(LedgerError, match=r"ledger\.json has format version 9"):
        load_ledger(Layout(str(tmp_path / "out")))


def test_a_source_matching_nothing_fails_at_once_before_any_write(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(SourceError, match=r"source '.*/src/\*\.parquet' matched no file"):
        register_sources(_cfg(tmp_path, source=str(tmp_path / "src" / "*.parquet")))
    with pytest.raises(SourceError, match=r"source '.*/src' matched no file"):  # a folder without parquet files
        register_sources(_cfg(tmp_path))
    (tmp_path / "src" / "notes.txt").write_text("not parquet")
    with pytest.raises(SourceError, match="matched no file"):
        list_source_files(str(tmp_path / "src"))
    assert not (tmp_path / "out").exists()


def test_the_ledger_lock_is_storage_lock(tmp_path):
    cfg, _ = _two_files(tmp_path, copies=False)
    assert (tmp_path / "out" / ".shardprep" / "locks" / "ledger.lock").exists()
    assert not (tmp_path / "out" / ".ledger.lock").exists()
    ledger = load_ledger(Layout(cfg.output_root))
    assert ledger.shard("00003").source.endswith("b.parquet")
    with pytest.raises(LedgerError, match="shard '00009' is not in the ledger"):
        ledger.shard("00009")


def _videos(path, n, start=0):
    pq.write_table(pa.table({"contentUrl": [f"http://x/{i}.mp4" for i in range(start, start + n)],
                             "name": [f"v{i}" for i in range(start, start + n)]}), str(path))


def test_video_source_files_get_video_shards_in_the_same_id_sequence(tmp_path):
    from shardprep.ledger import shard_media

    (tmp_path / "src").mkdir()
    (tmp_path / "vid").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 15)
    _videos(tmp_path / "vid" / "w.parquet", 12)
    cfg = _cfg(tmp_path, video_source=str(tmp_path / "vid"), video_url_col="contentUrl", video_caption_col="name")
    reg = register_sources(cfg)
    assert reg.new_keys == ["00000", "00001", "00002", "00003"]
    layout = Layout(cfg.output_root)
    ledger = load_ledger(layout)
    assert [ledger.media(k) for k in reg.new_keys] == ["image", "image", "video", "video"]
    assert shard_media(layout, ["00001", "00003"]) == {"00001": "image", "00003": "video"}
    # a ledger written before video sources existed has no "media": its files are image files
    raw = json.loads((tmp_path / "out" / "ledger.json").read_text())
    assert [f.get("media") for f in raw["files"]] == [None, "video"]

    # rows appended to the video file become more video shards
    _videos(tmp_path / "vid" / "w.parquet", 25)
    assert register_sources(cfg).new_keys == ["00004", "00005"]  # 13 more rows, 10 a shard
    assert load_ledger(layout).media("00005") == "video"


def test_video_rows_are_checked_for_their_own_columns_and_a_file_is_one_kind(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 5)
    # video rows need video_url_col: the images' url column does not count
    cfg = _cfg(tmp_path, video_source=str(tmp_path / "src" / "a.parquet"))
    with pytest.raises(SourceError, match="named by both 'source' .* and 'video_source'"):
        register_sources(cfg)
    (tmp_path / "vid").mkdir()
    _parquet(tmp_path / "vid" / "v.parquet", 5)
    with pytest.raises(SourceError, match=r"v.parquet: column 'contentUrl' \(config field 'video_url_col'\)"):
        register_sources(_cfg(tmp_path, video_source=str(tmp_path / "vid"), video_url_col="contentUrl"))
    assert not (tmp_path / "out" / "ledger.json").exists()  # nothing registered while a file is bad

    # a registered image file later named as a video file: its shards' kind cannot change
    register_sources(_cfg(tmp_path))
    moved = _cfg(tmp_path, source=str(tmp_path / "vid"), video_source=str(tmp_path / "src"))
    with pytest.raises(LedgerError, match="registered as image rows and is now named as video rows"):
        register_sources(moved)


def test_a_video_only_dataset_needs_no_image_source(tmp_path):
    from shardprep.config import ConfigError

    (tmp_path / "vid").mkdir()
    _videos(tmp_path / "vid" / "w.parquet", 3)
    cfg = _cfg(tmp_path, source=None, video_source=str(tmp_path / "vid"), video_url_col="contentUrl",
               video_caption_col="name")
    assert register_sources(cfg).new_keys == ["00000"]
    with pytest.raises(ConfigError, match="'source' .* and 'video_source' .* are both null"):
        _cfg(tmp_path, source=None)
