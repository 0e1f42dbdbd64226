"""A bad source fails register_sources before anything is written: nothing under output_root, not even the
ledger lock file, and no output_root folder where there was none. Registrations racing the check still lose
no shard (the ledger is read again under the lock)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardprep.ledger as ledger_module
from shardprep.config import load_config
from shardprep.errors import ShardprepError
from shardprep.layout import Layout
from shardprep.ledger import load_ledger, register_sources
from tests.fixtures.configs import write_config


def _parquet(path, n, cols=("url", "caption")):
    data = {"url": [f"http://x/{i}.jpg" for i in range(n)], "caption": [f"c{i}" for i in range(n)]}
    pq.write_table(pa.table({c: data[c] for c in cols}), str(path))


def _config(tmp_path, source: str, **fields):
    return load_config(write_config(tmp_path / "c.yaml", source=source, output_root=str(tmp_path / "out"),
                                    samples_per_shard=10, **fields))


def _bad_glob(src):
    return str(src / "*.parquet"), "*.parquet"


def _not_parquet(src):
    (src / "a.parquet").write_text("url,caption\nhttp://x/0.jpg,hello\n")
    return str(src / "*.parquet"), "a.parquet"


def _no_url_column(src):
    _parquet(src / "b.parquet", 5, cols=("caption",))
    return str(src / "*.parquet"), "b.parquet"


def _one_good_one_bad(src):
    _parquet(src / "a.parquet", 12)  # good, but registered with the bad one or not at all
    _parquet(src / "b.parquet", 5, cols=("caption",))
    return str(src / "*.parquet"), "b.parquet"


BAD_SOURCES = [_bad_glob, _not_parquet, _no_url_column, _one_good_one_bad]


@pytest.mark.parametrize("make", BAD_SOURCES, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_source_creates_no_output_root(tmp_path, make):
    (tmp_path / "src").mkdir()
    source, named = make(tmp_path / "src")
    cfg = _config(tmp_path, source)
    with pytest.raises(ShardprepError, match=named.replace(".", r"\.").replace("*", r"\*")):
        register_sources(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make", BAD_SOURCES, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_source_leaves_an_empty_output_root_empty(tmp_path, make):
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    source, named = make(tmp_path / "src")
    with pytest.raises(ShardprepError, match=named.replace(".", r"\.").replace("*", r"\*")):
        register_sources(_config(tmp_path, source))
    assert list((tmp_path / "out").iterdir()) == []


def test_a_video_file_without_its_url_column_creates_nothing(tmp_path):
    (tmp_path / "vid").mkdir()
    _parquet(tmp_path / "vid" / "v.parquet", 3)
    cfg = _config(tmp_path, None, video_source=str(tmp_path / "vid"), video_url_col="contentUrl")
    with pytest.raises(ShardprepError, match=r"v\.parquet: column 'contentUrl'"):
        register_sources(cfg)
    assert not (tmp_path / "out").exists()


def test_a_good_source_still_registers_and_takes_the_lock(tmp_path):
    (tmp_path / "src").mkdir()
    _parquet(tmp_path / "src" / "a.parquet", 12)
    reg = register_sources(_config(tmp_path, str(tmp_path / "src")))
    assert reg.new_keys == ["00000", "00001"]
    assert (tmp_path / "out" / ".shardprep" / "locks" / "ledger.lock").exists()


def test_a_registration_between_the_check_and_the_lock_loses_no_shard(tmp_path, monkeypatch):
    # the check reads the ledger without the lock: another process may register files before this one
    # takes it, and its shards must survive this one's write
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _parquet(tmp_path / name / f"{name}.parquet", 15)
    cfg_a, cfg_b = _config(tmp_path, str(tmp_path / "a")), _config(tmp_path, str(tmp_path / "b"))
    check = ledger_module._check_sources
    others: list = []

    def check_then_other_process_registers(*args, **kwargs):
        checked = check(*args, **kwargs)
        if not others:
            others.append(None)  # the other registration checks through here too: once only
            others[0] = register_sources(cfg_b)  # b's files are new to the ledger this one checked
        return checked

    monkeypatch.setattr(ledger_module, "_check_sources", check_then_other_process_registers)
    reg_a = register_sources(cfg_a)
    assert others[0].new_keys == ["00000", "00001"]
    assert reg_a.new_keys == ["00002", "00003"]
    ledger = load_ledger(Layout(cfg_a.output_root))
    assert [f["source"].rsplit("/", 1)[1] for f in ledger.files] == ["b.parquet", "a.parquet"]
    assert ledger.keys() == ["00000", "00001", "00002", "00003"]
