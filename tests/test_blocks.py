"""Shard blocks: with ``shards_per_partition`` a Dagster partition is a block of consecutive shards; a block
run does only its shards that are not complete (per-shard stamps and the state index stay the truth), new
shards fill the open block or start new ones, and each block's materialization carries its own figures."""

import json
import signal
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEventType

from shardprep import state
from shardprep.config import load_config
from shardprep.keys import partition_key, partition_range
from shardprep.layout import Layout
from shardprep.ledger import Ledger, LedgerError, load_ledger, register_sources
from shardprep.versions import read_stamp
from shardprep_dagster.orchestration.runner import run_pipeline
from shardprep_dagster.orchestration.status import asset_statuses
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config
from tests.fixtures.live_dagster import prepare_home
from tests.fixtures.slow_runs import complete, shardprep_run, slow_image_source, wait_for

PER_SHARD = ["source_parquet", "image_shards", "clip_embeddings", "reordered_embeddings", "image_scores"]


def test_block_keys_sort_and_cover_their_ids():
    assert partition_key(12345, 100, 8) == "00012300-00012399"
    assert partition_key(7, 1) == "00007"
    assert list(partition_range("00012300-00012399")) == list(range(12300, 12400))
    assert list(partition_range("00007")) == [7]
    with pytest.raises(ValueError, match="not a shard partition key"):
        partition_range("abc")
    ledger = Ledger(10, 5, [{"source": "a", "segments": [{"first_shard": 0, "num_shards": 10, "row_start": 0,
                                                           "row_stop": 95}]}], shards_per_partition=4)
    assert ledger.partition_keys() == ["00000-00003", "00004-00007", "00008-00011"]
    assert ledger.partition_shards("00008-00011") == ["00008", "00009"]  # the open last block
    assert ledger.partition_of("00005") == "00004-00007"


def _pipeline_source(tmp_path, image_site, tiny_clip_dir, rows: int, seed: int, samples_per_shard: int,
                     shards_per_partition: int) -> tuple[Path, str, Layout]:
    """(source folder, config path, layout) of a small image pipeline over ``image_site``, in blocks."""
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[rows], n_images=120, seed=seed)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=samples_per_shard, shards_per_partition=shards_per_partition,
                          image_size=32, allow_private_addresses=True, thread_count=8, timeout=5,
                          clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, enable_nemo_text2img=False,
                          enable_nemo_diffusion=False)
    return src, config, Layout(str(tmp_path / "out"))


def _latest(instance: dg.DagsterInstance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1).records
    return records[0].asset_materialization.metadata


def _written_at(layout: Layout, shard: str) -> dict[str, float]:
    return {a: read_stamp(layout, a, shard)["written_at"] for a in PER_SHARD}


def test_blocks_grow_and_a_rerun_does_only_the_new_shards(tmp_path, image_site, tiny_clip_dir):
    src, config, layout = _pipeline_source(tmp_path, image_site, tiny_clip_dir, rows=50, seed=4,
                                           samples_per_shard=20, shards_per_partition=4)
    home = prepare_home(tmp_path / "home")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        first = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert first.ok, first.failed
        assert instance.get_dynamic_partitions("shards") == ["00000-00003"]  # 3 shards: the open block
        assert first.runs == 2  # one block, then the global step
        meta = _latest(instance, "image_shards", "00000-00003")
        # its own figures: its 3 shards (20 + 20 + 10 rows), a row each
        assert meta["shards"].value == 3 and meta["samples"].value == 50
        assert [r.data["shard"] for r in meta["per_shard"].value.records] == ["00000", "00001", "00002"]
        before = {s: _written_at(layout, s) for s in ("00000", "00001", "00002")}

        # a new file: its shards fill the open block (00003) and start the next (00004)
        synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[30], n_images=120,
                                       seed=5, prefix="zz-new")
        second = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert second.ok, second.failed
        assert second.new_shards == ["00003", "00004"]
        assert instance.get_dynamic_partitions("shards") == ["00000-00003", "00004-00007"]
        # the grown block ran again, for its new shard only; the older shards were not touched
        assert {s: _written_at(layout, s) for s in before} == before
        grown = _latest(instance, "image_shards", "00000-00003")
        assert grown["shards"].value == 4 and grown["cached_shards"].value == 3
        new = _latest(instance, "image_shards", "00004-00007")
        assert new["samples"].value == 10  # one shard of its own (rows 20-29 of the new file)

        statuses = {s.asset: s for s in asset_statuses(config)}
        for asset in PER_SHARD:  # status counts shards, not blocks
            assert (statuses[asset].materialized, statuses[asset].total) == (5, 5), asset
        assert state.stamps_equal_index(layout, PER_SHARD) == {}
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).runs == 0


def test_shards_per_partition_is_fixed_by_the_ledger(tmp_path, image_site):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[10], n_images=20, seed=4)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=5, shards_per_partition=100)
    register_sources(load_config(config))
    assert json.loads(Path(tmp_path / "out" / "ledger.json").read_text())["shards_per_partition"] == 100
    assert load_ledger(Layout(str(tmp_path / "out"))).partition_keys() == ["00000-00099"]
    write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                 samples_per_shard=5, shards_per_partition=10)
    with pytest.raises(LedgerError, match="shards_per_partition"):
        register_sources(load_config(config))


def test_kill_9_in_the_middle_of_a_block_and_the_rerun_redoes_only_unfinished_shards(tmp_path, tiny_clip_dir):
    with slow_image_source(tmp_path, tiny_clip_dir, rows=60, samples_per_shard=20, slow_seconds=0.5,
                           thread_count=4, seed=2, shards_per_partition=3) as (config, layout):
        home = tmp_path / "dagster_home"
        proc = shardprep_run(config, home, "--in-process")
        wait_for(proc, layout.stamp("image_shards", "00000"), "shard 00000 of the block finishing")
        time.sleep(1.0)  # shard 00001 of the same block is downloading
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert read_stamp(layout, "image_shards", "00001") is None, "killed too late to test a partial block"
        done = read_stamp(layout, "image_shards", "00000")["written_at"]

        proc = shardprep_run(config, home)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert "shards: 3 in 1 blocks of up to 3" in out
        complete(layout)
        assert read_stamp(layout, "image_shards", "00000")["written_at"] == done  # not redone
        with dg.DagsterInstance.from_config(str(home)) as instance:
            meta = _latest(instance, "image_shards", "00000-00002")
            assert meta["shards"].value == 3 and meta["cached_shards"].value == 1
        assert state.stamps_equal_index(layout, PER_SHARD) == {}


class _Bar:
    def __init__(self):
        self.moves: list[int] = []

    def update(self, n: int) -> None:
        self.moves.append(n)


def test_the_progress_bar_moves_per_shard_as_the_journal_records_outcomes(tmp_path, image_site):
    from types import SimpleNamespace

    from shardprep.versions import write_stamp
    from shardprep_dagster.orchestration.progress import ShardProgress

    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[12], n_images=20, seed=4)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=4, shards_per_partition=3)
    cfg = load_config(config)
    register_sources(cfg)
    layout = Layout(cfg.output_root)
    plan = SimpleNamespace(cfg=cfg, assets_to_do=lambda p: [dg.AssetKey("source_parquet"), dg.AssetKey("image_shards")])
    bar = _Bar()
    progress = ShardProgress(plan, ["00000-00002"], bar)
    assert progress.total == 3
    write_stamp(layout, "source_parquet", "v", "00000")
    progress.poll()
    assert bar.moves == []  # one of its two assets only
    write_stamp(layout, "image_shards", "v", "00000")
    state.record_failed(layout, "source_parquet", "00001", "ValueError: bad rows")
    state.record_failed(layout, "image_shards", "00001", "skipped")
    progress.poll()
    assert bar.moves == [2]  # 00000 done, 00001 failed: both settled, inside one block run
    progress.poll({"00000-00002"})  # Dagster says the block is settled: its last shard too
    assert bar.moves == [2, 1]


def test_run_shards_targets_single_shards_inside_a_block(tmp_path, image_site, tiny_clip_dir):
    src, config, layout = _pipeline_source(tmp_path, image_site, tiny_clip_dir, rows=40, seed=6,
                                           samples_per_shard=10, shards_per_partition=4)
    with dg.instance_for_test() as instance:
        with pytest.raises(Exception, match="not a shard selection"):
            run_pipeline(config, instance=instance, progress=False, in_process=True, shards="3-1")
        some = run_pipeline(config, instance=instance, progress=False, in_process=True, shards="1-2")
        assert some.ok, some.failed  # the truth about the selected shards
        stamped = {s for s in ("00000", "00001", "00002", "00003") if read_stamp(layout, "image_shards", s)}
        assert stamped == {"00001", "00002"}
        # the block is materialized in Dagster, but the index knows two of its shards are not done
        rest = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert rest.ok, rest.failed
        assert all(read_stamp(layout, a, s) for a in PER_SHARD for s in ("00000", "00003"))
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).runs == 0


def test_with_blocks_the_state_index_drives_automation(tmp_path, image_site, tiny_clip_dir):
    from shardprep_dagster.definitions import build_defs
    from shardprep_dagster.resources.dataset import DatasetResource
    from shardprep_dagster.sensors.shard_work import pending_work

    src, config, layout = _pipeline_source(tmp_path, image_site, tiny_clip_dir, rows=50, seed=7,
                                           samples_per_shard=20, shards_per_partition=3)
    defs = build_defs(config)
    sensor = defs.get_sensor_def("shard_work")
    graph = defs.resolve_asset_graph()
    # the per-shard assets have no declarative condition: the sensor carries them (the globals keep theirs)
    assert all(graph.get(dg.AssetKey(a)).automation_condition is None for a in PER_SHARD)
    assert graph.get(dg.AssetKey("dataset_report")).automation_condition is not None
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok

        def tick() -> list[dg.RunRequest]:
            context = dg.build_sensor_context(instance=instance, resources={"dataset": DatasetResource(config_path=config)})
            result = sensor(context)
            return [] if isinstance(result, dg.SkipReason) else list(result)

        assert tick() == []  # everything complete
        synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[30], n_images=120,
                                       seed=8, prefix="zz-new")
        register_sources(load_config(config))  # as new_source_files does: shards 00003, 00004
        (request,) = tick()
        assert request.partition_key == "00003-00005"
        assert [k.path[-1] for k in request.asset_selection] == PER_SHARD
        assert tick()[0].run_key == request.run_key  # a replayed tick asks for nothing new
        # a shard whose last attempt failed is not retried, nor anything downstream of it
        state.record_failed(layout, "source_parquet", "00004", "ValueError: rows changed")
        work = pending_work(DatasetResource(config_path=config))
        assert work == {"00003-00005": {a: ["00003"] for a in PER_SHARD}}
        assert tick()[0].run_key != request.run_key


def test_scattered_blocks_launch_as_ranges_whose_complete_shards_cost_nothing(tmp_path, image_site, tiny_clip_dir,
                                                                              monkeypatch):
    from shardprep.versions import remove_stamp
    from shardprep_dagster.definitions import BLOCKS_PER_RUN, build_defs
    from shardprep_dagster.orchestration.queue_daemon import PLANNED_EVENTS_ENV, one_planned_event_per_asset
    from shardprep_dagster.orchestration.queued import fill_gaps

    order = [f"b{i}" for i in range(12)]
    assert fill_gaps(order, {"b0", "b2", "b3", "b11"}, max_gap=3) == {"b0", "b1", "b2", "b3", "b11"}
    src, config, layout = _pipeline_source(tmp_path, image_site, tiny_clip_dir, rows=80, seed=9,
                                           samples_per_shard=10, shards_per_partition=2)
    defs = build_defs(config)
    node = defs.resolve_asset_graph().get(dg.AssetKey("image_shards"))
    assert node.backfill_policy.max_partitions_per_run == BLOCKS_PER_RUN  # a run takes a range of blocks
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        before = {s: read_stamp(layout, "image_shards", s)["written_at"] for s in ("00000", "00003", "00006")}
        for shard in ("00001", "00007"):  # one shard in the first block, one in the last
            remove_stamp(layout, "image_shards", shard)
        # one run over the range of all four blocks, as a filled backfill gives it, created as in the
        # private daemon: one "planned" event for the asset, not one per block (~9 ms each)
        monkeypatch.delenv(PLANNED_EVENTS_ENV, raising=False)
        one_planned_event_per_asset()
        result = defs.resolve_job_def("shards_job").execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("image_shards")],
            tags={"dagster/asset_partition_range_start": "00000-00001", "dagster/asset_partition_range_end": "00006-00007"})
        assert result.success
        # each block's materialization carries its own shards' figures, not the run's totals
        mats = {m.partition: m.metadata for m in result.asset_materializations_for_node("image_shards")}
        assert {p: (m["shards"].value, m["cached_shards"].value) for p, m in mats.items()} == {
            "00000-00001": (2, 1), "00002-00003": (2, 2), "00004-00005": (2, 2), "00006-00007": (2, 1)}
        assert [r.data["shard"] for r in mats["00006-00007"]["per_shard"].value.records] == ["00006", "00007"]
        assert mats["00006-00007"]["shards_in_run"].value == 8
        assert {s: read_stamp(layout, "image_shards", s)["written_at"] for s in before} == before  # untouched
        (planned,) = instance.all_logs(result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION_PLANNED)
        assert set(planned.dagster_event.event_specific_data.partitions_subset.get_partition_keys()) == {
            "00000-00001", "00002-00003", "00004-00005", "00006-00007"}
        assert read_stamp(layout, "image_shards", "00001") and read_stamp(layout, "image_shards", "00007")
