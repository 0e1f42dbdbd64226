"""The new_source_files sensor against a real local source folder and a real (test) Dagster instance.

The daemon applies a tick's partition adds before the next tick; ``tick`` does the same here.
"""

import importlib
import json
import os
import time

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.sources import read_rows
from shardprep_dagster.assets import source_parquet
from shardprep_dagster.resources import DatasetResource
from shardprep_dagster.sensors import new_source_files
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config

BASE_URL = "http://127.0.0.1:9"  # never fetched: the sensor reads only parquet footers


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), BASE_URL, n_files=2, rows_per_file=[25, 15], seed=1)  # 3 + 2 shards
    config = write_config(tmp_path / "shardprep.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=10)
    return src, config


@pytest.fixture
def instance(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as inst:
        yield inst


def tick(instance, config, cursor=None, apply=True) -> dg.SensorResult:
    """One sensor evaluation; applies its partition adds to the instance, as the daemon does."""
    with dg.build_sensor_context(instance=instance, cursor=cursor,
                                 resources={"dataset": DatasetResource(config_path=config)}) as ctx:
        result = new_source_files(ctx)
    assert isinstance(result, dg.SensorResult)
    if apply:
        for req in result.dynamic_partitions_requests or []:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result


def added(result: dg.SensorResult) -> list[str]:
    return [k for req in result.dynamic_partitions_requests or [] for k in req.partition_keys]


def requested(result: dg.SensorResult) -> list[tuple[str, str]]:
    return [(r.run_key, r.partition_key) for r in result.run_requests or []]


def write_table(path, columns: dict) -> None:
    pq.write_table(pa.table(columns), str(path))


def test_new_files_become_partitions_and_runs_once(source, instance):
    src, config = source
    first = tick(instance, config)
    shards = ["00000", "00001", "00002", "00003", "00004"]
    assert added(first) == shards
    assert first.dynamic_partitions_requests[0].partitions_def_name == "shards"
    assert requested(first) == [(k, k) for k in shards]  # run_key = shard: a replayed tick launches nothing twice
    assert instance.get_dynamic_partitions("shards") == shards
    ledger = load_ledger(Layout(str(src.parent / "out")))
    assert [(s.key, os.path.basename(s.source), s.row_start, s.row_stop) for s in ledger.shards()] == [
        ("00000", "part-00000.parquet", 0, 10), ("00001", "part-00000.parquet", 10, 20),
        ("00002", "part-00000.parquet", 20, 25), ("00003", "part-00001.parquet", 0, 10),
        ("00004", "part-00001.parquet", 10, 15)]

    second = tick(instance, config, cursor=first.cursor)
    assert added(second) == [] and requested(second) == []
    assert second.skip_reason is not None and "no new shards" in second.skip_reason.skip_message

    synthetic.make_source_parquets(str(src), BASE_URL, n_files=1, rows_per_file=[12], seed=2, prefix="zz-new")
    third = tick(instance, config, cursor=second.cursor)
    assert added(third) == ["00005", "00006"]  # only the new file's shards, ids continuing
    assert requested(third) == [("00005", "00005"), ("00006", "00006")]
    assert instance.get_dynamic_partitions("shards") == shards + ["00005", "00006"]


def test_sensor_targets_source_parquet_in_the_code_location():
    from shardprep_dagster.definitions import defs

    job = defs.resolve_job_def(defs.resolve_sensor_def("new_source_files").job_name)
    assert job.asset_layer.selected_asset_keys == {source_parquet.key}  # the rest follows by automation


def test_bad_file_is_reported_once_and_does_not_block_a_good_one(source, instance, capfd):
    src, config = source
    first = tick(instance, config)
    capfd.readouterr()
    # a file without the url column (sorted first, so it is met before the good one) and a good new file
    write_table(src / "a-bad.parquet", {"caption": ["x", "y"], "source_id": [1, 2]})
    synthetic.make_source_parquets(str(src), BASE_URL, n_files=1, rows_per_file=[8], seed=3, prefix="b-good")
    result = tick(instance, config, cursor=first.cursor)
    assert added(result) == ["00005"] and requested(result) == [("00005", "00005")]
    err = capfd.readouterr().err
    assert "a-bad.parquet" in err and "'url'" in err and "missing" in err
    cursor = json.loads(result.cursor)
    bad_url = f"file://{src / 'a-bad.parquet'}"  # sources are listed as full URLs
    assert list(cursor["bad"]) == [bad_url] and "'url'" in cursor["bad"][bad_url]

    # the same problem is not logged again on every tick; the skip reason still names it
    again = tick(instance, config, cursor=result.cursor)
    assert added(again) == [] and "a-bad.parquet" not in capfd.readouterr().err

    # fixed: the file is registered and the cursor forgets it
    write_table(src / "a-bad.parquet", {"url": [f"{BASE_URL}/a.jpg"], "caption": ["x"]})
    fixed = tick(instance, config, cursor=again.cursor)
    assert added(fixed) == ["00006"]
    assert json.loads(fixed.cursor)["bad"] == {}
    assert load_ledger(Layout(str(src.parent / "out"))).shard("00006").source == bad_url


def test_only_bad_files_give_a_skip_reason_naming_them(source, instance):
    src, config = source
    for f in src.iterdir():
        f.unlink()
    write_table(src / "only.parquet", {"link": ["u"], "caption": ["c"]})
    result = tick(instance, config)
    assert added(result) == [] and requested(result) == []
    msg = result.skip_reason.skip_message
    assert "only.parquet" in msg and "'url'" in msg and "1 source file problem" in msg


def _ranges(src) -> list[tuple[str, str, int, int]]:
    ledger = load_ledger(Layout(str(src.parent / "out")))
    return [(s.key, os.path.basename(s.source), s.row_start, s.row_stop) for s in ledger.shards()]


def _rewrite(path, table: pa.Table) -> None:
    before = os.stat(path).st_mtime_ns
    pq.write_table(table, str(path))
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a new fingerprint even on a coarse clock


def _more_rows(n: int, seed: int) -> pa.Table:
    cols = synthetic.source_rows(BASE_URL, n, seed=seed, start=1000)
    return pa.table({"url": pa.array(cols["url"], pa.string()), "caption": pa.array(cols["caption"], pa.string()),
                     "source_id": pa.array(cols["source_id"], pa.int64())})


def test_appended_rows_become_partitions_and_runs(source, instance):
    src, config = source
    first = tick(instance, config)
    before = _ranges(src)
    part1 = src / "part-00001.parquet"  # 15 rows: shards 00003 (0-9) and 00004 (10-14, short)
    _rewrite(part1, pa.concat_tables([pq.read_table(str(part1)), _more_rows(12, seed=5)]))
    result = tick(instance, config, cursor=first.cursor)
    assert added(result) == ["00005", "00006"] and requested(result) == [("00005", "00005"), ("00006", "00006")]
    assert _ranges(src) == before + [("00005", "part-00001.parquet", 15, 25), ("00006", "part-00001.parquet", 25, 27)]
    again = tick(instance, config, cursor=result.cursor)
    assert added(again) == [] and again.skip_reason.skip_message == "no new shards"


def test_rewritten_source_is_reported_once_with_the_reshard_command(source, instance, capfd):
    src, config = source
    first = tick(instance, config)
    ledger_before = load_ledger(Layout(str(src.parent / "out"))).to_json()
    capfd.readouterr()
    time.sleep(0.01)  # a new mtime even on coarse clocks
    synthetic.make_source_parquets(str(src), BASE_URL, n_files=1, rows_per_file=[40], seed=7)  # rewrites part-00000
    synthetic.make_source_parquets(str(src), BASE_URL, n_files=1, rows_per_file=[8], seed=3, prefix="zz-new")
    result = tick(instance, config, cursor=first.cursor)  # the tick goes on: the new file is registered
    assert added(result) == ["00005"] and requested(result) == [("00005", "00005")]
    rewritten = f"file://{src / 'part-00000.parquet'}"
    msg = capfd.readouterr().err
    assert f"source file {rewritten} changed after its shards were assigned" in msg
    assert f"shardprep reshard --config {config} --source {rewritten}" in msg
    assert load_ledger(Layout(str(src.parent / "out"))).to_json() != ledger_before  # the new file only
    assert _ranges(src)[:5] == [("00000", "part-00000.parquet", 0, 10), ("00001", "part-00000.parquet", 10, 20),
                                ("00002", "part-00000.parquet", 20, 25), ("00003", "part-00001.parquet", 0, 10),
                                ("00004", "part-00001.parquet", 10, 15)]
    assert list(json.loads(result.cursor)["changed"]) == [rewritten]
    again = tick(instance, config, cursor=result.cursor)
    assert again.skip_reason.skip_message == "no new shards"  # reported once, not on every tick
    assert "changed after its shards were assigned" not in capfd.readouterr().err

    # reported in the skip reason when nothing else happens in the tick, and again after a new rewrite
    time.sleep(0.01)
    synthetic.make_source_parquets(str(src), BASE_URL, n_files=1, rows_per_file=[3], seed=8)
    third = tick(instance, config, cursor=again.cursor)
    assert "now 3 rows, 25 were registered" in third.skip_reason.skip_message
    assert "shardprep reshard --config" in third.skip_reason.skip_message


def test_reshard_wipes_exactly_the_changed_shards_in_the_instance(source, instance):
    from shardprep_dagster.assets import per_shard_assets
    from shardprep_dagster.orchestration.reshard import reshard

    src, config = source
    tick(instance, config)  # shards 00000-00004 registered and partitions
    layout = Layout(str(src.parent / "out"))
    ledger = load_ledger(layout)
    shards = ledger.keys()
    for key in shards:  # as source_parquet would have copied them
        s = ledger.shard(key)
        os.makedirs(os.path.dirname(layout.source_parquet(key)), exist_ok=True)
        pq.write_table(read_rows(s.source, s.row_start, s.row_stop), layout.source_parquet(key))
    for asset in per_shard_assets:
        for key in shards:
            instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=asset.key, partition=key))

    part0 = src / "part-00000.parquet"  # 25 rows: shards 00000-00002; one row of shard 00001 changes
    table = pq.read_table(str(part0))
    captions = table["caption"].to_pylist()
    captions[12] = "a caption edited after registration"
    table = table.set_column(table.column_names.index("caption"), "caption", pa.array(captions, pa.string()))
    _rewrite(part0, pa.concat_tables([table, _more_rows(4, seed=11)]))

    result = reshard(config, str(part0), instance)
    assert result.invalidated == ["00001"] and result.emptied == [] and result.new_keys == ["00005"]
    for asset in per_shard_assets:
        assert instance.get_materialized_partitions(asset.key) == {"00000", "00002", "00003", "00004"}, asset.key
    assert instance.get_dynamic_partitions("shards") == shards + ["00005"]
    assert not os.path.exists(layout.source_parquet("00001")) and os.path.exists(layout.source_parquet("00002"))
    # the other shards' materializations are intact (their events still readable), and the sensor is quiet
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=source_parquet.key,
                                                                    asset_partitions=["00002"]), limit=1).records
    assert len(records) == 1
    assert added(tick(instance, config)) == []


def test_unreachable_source_is_a_skip_reason(tmp_path, instance):
    config = write_config(tmp_path / "c.yaml", source=str(tmp_path / "nowhere"), output_root=str(tmp_path / "out"))
    with dg.build_sensor_context(instance=instance,
                                 resources={"dataset": DatasetResource(config_path=config)}) as ctx:
        result = new_source_files(ctx)
    assert isinstance(result, dg.SkipReason) and "nowhere" in result.skip_message and "no such" in result.skip_message


def test_partition_adds_per_tick_are_capped(source, instance, monkeypatch):
    module = importlib.import_module("shardprep_dagster.sensors.new_source_files")
    assert module.MAX_PARTITION_ADDS_PER_TICK == 25_000  # Dagster's per-evaluation limit
    monkeypatch.setattr(module, "MAX_PARTITION_ADDS_PER_TICK", 2)
    src, config = source
    cursor, batches = None, []
    for _ in range(4):
        result = tick(instance, config, cursor=cursor)
        batches.append(added(result))
        assert requested(result) == [(k, k) for k in added(result)]
        cursor = result.cursor
    assert batches == [["00000", "00001"], ["00002", "00003"], ["00004"], []]
    assert instance.get_dynamic_partitions("shards") == ["00000", "00001", "00002", "00003", "00004"]


def test_each_tick_folds_the_state_journal(source, instance):
    """Driven from the UI alone (one shard per partition: no shard_work sensor, no `shardprep run`),
    the sensor's tick keeps the state index current and its journal short."""
    from shardprep import state
    from shardprep.versions import write_stamp

    src, config = source
    tick(instance, config)
    layout = Layout(str(src.parent / "out"))
    for key in ("00000", "00001"):
        write_stamp(layout, "source_parquet", "v-test", key, {})  # as a step's stamp, journaled
    assert state._journal_files(layout)
    tick(instance, config)
    assert state._journal_files(layout) == []
    indexed = state.load(layout, ["source_parquet"], fold_first=False)["source_parquet"]
    assert indexed.complete_among(["00000", "00001", "00002"], "v-test") == {"00000", "00001"}
