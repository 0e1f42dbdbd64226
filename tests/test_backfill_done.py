"""`shardprep run` goes on once its backfill's runs are over and every pair it targets is materialized
(``launch.materialized_out``), without waiting for the daemon's next pass to mark it completed."""

import time

import dagster as dg
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.test_utils import create_run_for_test

from shardprep_dagster.orchestration.launch import materialized_out

TILES = dg.StaticPartitionsDefinition(["a", "b"])
KEY = dg.AssetKey("tiles")


def _backfill(instance: dg.DagsterInstance, backfill_id: str) -> PartitionBackfill:
    subset = AssetGraphSubset(partitions_subsets_by_asset_key={KEY: TILES.subset_with_partition_keys(["a", "b"])})
    backfill = PartitionBackfill.from_asset_graph_subset(
        backfill_id=backfill_id, backfill_timestamp=time.time(), tags={}, dynamic_partitions_store=instance,
        asset_graph_subset=subset, title=None, description=None, run_config=None)
    instance.add_backfill(backfill)
    return backfill


def _materialize(instance: dg.DagsterInstance, partition: str) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(KEY, partition=partition))


def test_a_backfill_is_materialized_out_once_its_runs_are_over_and_every_pair_is_there():
    with dg.instance_for_test() as instance:
        backfill = _backfill(instance, "b1")
        assert not materialized_out(instance, "b1")  # no run yet: the daemon has not begun
        run = create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.STARTED,
                                  tags={"dagster/backfill": "b1"})
        _materialize(instance, "a")
        _materialize(instance, "b")
        assert not materialized_out(instance, "b1")  # its run is still in flight
        instance.handle_run_event(run.run_id, dg.DagsterEvent(event_type_value="PIPELINE_SUCCESS", job_name="j"))
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS
        assert materialized_out(instance, "b1")
        # what the daemon then does: marked, it is no longer the follower's to cut short
        instance.update_backfill(backfill.with_status(BulkActionStatus.COMPLETED_SUCCESS))
        assert not materialized_out(instance, "b1")


def test_a_pair_materialized_before_the_backfill_began_does_not_count():
    with dg.instance_for_test() as instance:
        _materialize(instance, "b")  # an older materialization: not this backfill's
        time.sleep(0.01)
        _backfill(instance, "b2")
        create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.SUCCESS, tags={"dagster/backfill": "b2"})
        _materialize(instance, "a")
        assert not materialized_out(instance, "b2")
        _materialize(instance, "b")
        assert materialized_out(instance, "b2")


def test_the_follower_reads_again_when_the_last_run_ends_after_its_event():
    # Dagster logs a run's success, then stores its status: a read in between saw the run in flight, and
    # with no event after it the follower waited READ_SECONDS (5 s, between the shards and the globals)
    from shardprep_dagster.orchestration.queued import POLL_SECONDS, _Follower

    with dg.instance_for_test() as instance:
        _backfill(instance, "b1")
        run = create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.STARTED,
                                  tags={"dagster/backfill": "b1"})
        follower = _Follower(instance, stop=None, bar=None, progress=None)
        assert follower._news()
        time.sleep(POLL_SECONDS)  # (the queries run at most this often)
        assert not follower._news()  # nothing new: the backfills are not read again
        # the status alone, as the run storage stores it after the success event was logged
        instance.run_storage.handle_run_event(run.run_id, dg.DagsterEvent(event_type_value="PIPELINE_SUCCESS",
                                                                          job_name="j"))
        time.sleep(POLL_SECONDS)
        assert follower._news()
        time.sleep(POLL_SECONDS)
        assert not follower._news()
        instance.update_backfill(instance.get_backfill("b1").with_status(BulkActionStatus.COMPLETED_SUCCESS))
        time.sleep(POLL_SECONDS)
        assert follower._news()  # the daemon's mark logs no event either


def test_a_backfill_the_daemon_marks_done_after_it_was_read_does_not_hold_the_follower():
    # read as active, marked completed by the daemon a moment later: no longer "materialized out" (the
    # daemon's), finished all the same; the follower waited a poll period for its next read
    from shardprep_dagster.orchestration.launch import progress
    from shardprep_dagster.orchestration.queued import _Follower

    with dg.instance_for_test() as instance:
        for backfill_id in ("b1", "b2"):
            _backfill(instance, backfill_id)
            create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.SUCCESS,
                                tags={"dagster/backfill": backfill_id})
        _materialize(instance, "a")
        _materialize(instance, "b")
        states = {b: progress(instance, b) for b in ("b1", "b2")}
        assert not any(state.finished for state in states.values())
        instance.update_backfill(instance.get_backfill("b1").with_status(BulkActionStatus.COMPLETED_SUCCESS))
        follower = _Follower(instance, stop=None, bar=None, progress=None)
        assert follower._materialized_out(["b1", "b2"], [], states)
        assert follower.unmarked == {"b1", "b2"}  # (``wait_marked`` waits for b2's mark only)


def test_a_runs_end_is_read_at_once_and_events_at_most_every_poll_period(monkeypatch):
    from shardprep_dagster.orchestration import queued

    monkeypatch.setattr(queued, "POLL_SECONDS", 3.0)  # (far longer than the test's steps take)
    with dg.instance_for_test() as instance:
        _backfill(instance, "b1")
        run = create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.STARTED,
                                  tags={"dagster/backfill": "b1"})
        time.sleep(0.2)  # (files written just before a look count as changed at the next one too)
        follower = queued._Follower(instance, stop=None, bar=None, progress=None)
        assert follower._news()
        _materialize(instance, "a")  # a step's event: not read again within the poll period
        assert not follower._news()
        instance.run_storage.handle_run_event(run.run_id, dg.DagsterEvent(event_type_value="PIPELINE_SUCCESS",
                                                                          job_name="j"))
        assert follower._news()  # the run's end: read at once


def test_a_backfill_found_materialized_out_is_not_read_again(monkeypatch):
    # each look at a backfill reads every asset's materializations since it began (~25 ms a backfill on 2
    # cores), between the last shard and the unpartitioned assets: one found materialized out stays so, and
    # neither the follower's next look nor the run's failures at the end read it again. One the daemon marked
    # finished is not taken for materialized out (it may have failed): its failures are read
    from shardprep_dagster.orchestration.launch import failures, progress
    from shardprep_dagster.orchestration.queued import _Follower

    with dg.instance_for_test() as instance:
        for backfill_id in ("b1", "b2"):
            _backfill(instance, backfill_id)
        create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.SUCCESS, tags={"dagster/backfill": "b1"})
        running = create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.STARTED,
                                      tags={"dagster/backfill": "b2"})
        _materialize(instance, "a")
        _materialize(instance, "b")
        states = {b: progress(instance, b) for b in ("b1", "b2")}
        follower = _Follower(instance, stop=None, bar=None, progress=None)
        assert not follower._materialized_out(["b1", "b2"], [], states)  # b2's run is still in flight
        assert follower.materialized_out == {"b1"}

        reads = []
        fetch = instance.fetch_materializations
        monkeypatch.setattr(instance, "fetch_materializations", lambda *a, **k: reads.append(a) or fetch(*a, **k))
        instance.run_storage.handle_run_event(running.run_id, dg.DagsterEvent(event_type_value="PIPELINE_SUCCESS",
                                                                              job_name="j"))
        assert follower._materialized_out(["b1", "b2"], [], states)
        assert follower.materialized_out == {"b1", "b2"} and len(reads) == 1  # b2's one asset, not b1's again
        assert failures(instance, "b1", materialized=True) == {} and len(reads) == 1

        # b3: begun after those materializations, none of its own, marked failed by the daemon
        time.sleep(0.01)
        _backfill(instance, "b3")
        create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.FAILURE, tags={"dagster/backfill": "b3"})
        instance.update_backfill(instance.get_backfill("b3").with_status(BulkActionStatus.COMPLETED_FAILED))
        assert follower._out("b3") and "b3" not in follower.materialized_out
        assert failures(instance, "b3") == {"a": "tiles: not materialized", "b": "tiles: not materialized"}
