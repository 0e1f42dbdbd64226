"""An embedded instance's changes are seen from its files (``orchestration.storage_watch``), so `shardprep run`
and the queue daemon query it only when it has changed, and see a run's end within a tick."""

import time

import dagster as dg
from dagster._core.test_utils import create_run_for_test

from shardprep_dagster.orchestration import storage_watch
from shardprep_dagster.orchestration.storage_watch import FRESH_NS, watch

SETTLE = 2 * FRESH_NS / 1e9


def _settled(look, settle: float = SETTLE) -> bool:
    """Whether ``look`` (a watch's ``changed``, or another question put to it) answers no once the files have
    stopped being written (two looks: the first after a write still counts it)."""
    time.sleep(settle)
    look()
    time.sleep(settle)
    return not look()


def test_a_new_run_an_event_and_a_runs_end_are_each_seen_and_quiet_files_are_not():
    with dg.instance_for_test() as instance:
        w = watch(instance)
        assert w is not None
        assert w.changed()  # the first look
        assert _settled(w.changed)
        run = create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.STARTED)
        assert w.changed()
        assert _settled(w.changed)
        instance.report_runless_asset_event(dg.AssetMaterialization("tiles"))  # the event index
        assert w.changed()
        assert _settled(w.changed)
        instance.run_storage.handle_run_event(run.run_id, dg.DagsterEvent(event_type_value="PIPELINE_SUCCESS",
                                                                          job_name="j"))
        assert w.changed()
        # reading changes nothing
        assert _settled(w.changed)
        instance.get_runs_count()
        instance.event_log_storage.get_maximum_record_id()
        assert not w.changed()


def test_a_write_right_after_a_look_is_seen_at_the_next_one(monkeypatch):
    # a second write within the filesystem's timestamp tick can leave mtime and size as they were: a file
    # written within FRESH_NS of a look counts as changed at the next look too (widened here, so a loaded
    # machine's delay between the write and the first look stays inside it)
    monkeypatch.setattr(storage_watch, "FRESH_NS", 500_000_000)
    with dg.instance_for_test() as instance:
        w = watch(instance, ("runs",))
        assert _settled(w.changed, 1.0)
        create_run_for_test(instance, job_name="j")
        assert w.changed()
        assert w.changed()  # still fresh
        assert _settled(w.changed, 1.0)


def test_storage_that_is_not_sqlite_has_no_watch():
    with dg.DagsterInstance.ephemeral() as instance:
        assert watch(instance) is None


def test_the_follower_queries_only_when_the_files_change():
    from shardprep_dagster.orchestration.queued import POLL_SECONDS, WATCH_SECONDS, _Follower

    with dg.instance_for_test() as instance:
        run = create_run_for_test(instance, job_name="j", status=dg.DagsterRunStatus.STARTED)
        queries = []
        count = instance.get_runs_count
        instance.get_runs_count = lambda *a, **kw: queries.append(1) or count(*a, **kw)
        follower = _Follower(instance, stop=None, bar=None, progress=None)
        assert follower._news()
        time.sleep(POLL_SECONDS)
        follower._news()  # the files were fresh at the first look: queried once more
        before = len(queries)
        for _ in range(10):  # half a second of looks with nothing written
            time.sleep(WATCH_SECONDS)
            assert not follower._news()
        assert len(queries) == before
        time.sleep(POLL_SECONDS)
        instance.run_storage.handle_run_event(run.run_id, dg.DagsterEvent(event_type_value="PIPELINE_SUCCESS",
                                                                          job_name="j"))
        assert follower._news()  # the first look after the write: the run is no longer in flight
        assert len(queries) == before + 1


def test_due_keeps_a_change_until_the_owner_queries_and_spaces_queries_by_the_interval():
    with dg.instance_for_test() as instance:
        w = watch(instance, ("runs",))
        assert w.due(since_query=float("inf"), min_interval=0.2)  # nothing queried yet
        assert _settled(lambda: w.due(since_query=float("inf"), min_interval=0.0))
        create_run_for_test(instance, job_name="j")
        # changed, but queried 0.1 s ago: not yet; the change is kept for when the interval has passed
        assert not w.due(since_query=0.1, min_interval=0.2)
        assert _settled(w.changed)  # the files are quiet again (these looks do not clear what due() keeps)
        assert w.due(since_query=0.3, min_interval=0.2)
        assert not w.due(since_query=0.3, min_interval=0.2)  # taken: nothing new since
        assert w.due(since_query=0.0, min_interval=0.2, overdue=True)  # the owner's own reason
