"""A run whose step waits for a pool slot sleeps while it waits (``resources.concurrency_wait``): Dagster
1.13's executor loop spun a core for as long as the wait lasted."""

import threading
import time

import dagster as dg
import pytest

from shardprep_dagster.resources import concurrency_wait


def _thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@pytest.mark.parametrize("fixed", [True, False], ids=["ours", "dagster-1.13"])
def test_a_step_waiting_for_a_pool_slot_sleeps_instead_of_spinning(monkeypatch, fixed):
    from dagster._core.execution.plan import instance_concurrency_context as icc

    if fixed:
        concurrency_wait.apply()
    else:  # what Dagster does without it: the same test must see the spinning, or it proves nothing
        monkeypatch.setattr(icc.InstanceConcurrencyContext, "interval_to_next_pending_claim_check",
                            lambda self: min([0, *[t - time.time() for t in self._pending_timeouts.values()]])
                            if self._pending_claims else 0.0)

    @dg.op(pool="download")
    def fetch() -> int:
        return 1

    @dg.job
    def downloads():
        fetch()

    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("download", 1)
        assert storage.claim_concurrency_slot("download", "another-run", "its-step").is_claimed  # the only slot
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(result=downloads.execute_in_process(instance=instance)))
        runner.start()
        # measured from the moment the step waits in the pool's queue: the run's own start (plan, events)
        # costs CPU too, and more of it on a slower machine, which has nothing to do with how it waits
        deadline = time.monotonic() + 60
        while storage.get_concurrency_info("download").pending_step_count < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert storage.get_concurrency_info("download").pending_step_count == 1, "the step never queued for the slot"
        waiting_from = _thread_cpu(runner)
        time.sleep(3.0)
        busy = _thread_cpu(runner) - waiting_from
        assert runner.is_alive()  # still waiting for the slot
        storage.free_concurrency_slot_for_step("another-run", "its-step")
        runner.join(timeout=60)
        assert not runner.is_alive() and outcome["result"].success
    if fixed:  # ~0.2 here, the claims' step-up from 0.05 s to 2 s included; Dagster's own spin: a whole core
        assert busy < 0.75, f"the waiting run used {busy:.2f} CPU-seconds in 3 s"
    else:
        assert busy > 1.0, f"Dagster's own loop used only {busy:.2f} CPU-seconds in 3 s: the fix may be moot"


@pytest.mark.parametrize("fixed", [True, False], ids=["ours", "dagster-1.13"])
def test_a_run_in_one_process_waits_for_one_slot_at_a_time(monkeypatch, fixed):
    """Two ready steps of one in-process run in one pool (image_shards and video_shards): the run asks for
    one slot, not two. With two, a freed slot went to the step the run could not start yet, and sat idle
    while its sibling ran (and another run's download waited for it)."""
    from dagster._core.execution.plan import active
    from dagster._core.execution.plan import instance_concurrency_context as icc

    if fixed:
        concurrency_wait.apply()
    else:
        monkeypatch.setattr(icc.InstanceConcurrencyContext, "claim", concurrency_wait._original_claim)
        monkeypatch.setattr(active.ActiveExecution, "get_next_step", concurrency_wait._original_next_step)
    ran: list[str] = []
    running = threading.Event()  # set in the middle of a step's work (not as it starts or ends)

    def body(name: str) -> int:
        time.sleep(0.3)
        running.set()
        time.sleep(1.5)
        running.clear()
        time.sleep(0.3)
        ran.append(name)
        return 1

    @dg.op(pool="download")
    def images() -> int:
        return body("images")

    @dg.op(pool="download")
    def videos() -> int:
        return body("videos")

    @dg.job
    def shards():
        images()
        videos()

    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("download", 2)
        for step in ("a", "b"):  # both slots held by another run's steps
            assert storage.claim_concurrency_slot("download", "another-run", step).is_claimed
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(result=shards.execute_in_process(instance=instance)))
        runner.start()

        def ours_waiting() -> set[str]:
            return {p.step_key for p in storage.get_concurrency_info("download").pending_steps
                    if p.run_id != "another-run" and p.assigned_timestamp is None}

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not ours_waiting():
            time.sleep(0.2)
        time.sleep(3.0)  # the executor's next claim checks (up to 2 s apart): time for a second claim
        waiting = ours_waiting()
        storage.free_concurrency_slot_for_step("another-run", "a")
        storage.free_concurrency_slot_for_step("another-run", "b")
        held_while_running = set()
        while runner.is_alive():  # while a step runs, how many slots are ours: claimed, or assigned to a step
            if not running.wait(0.1):  # not started yet
                continue
            info = storage.get_concurrency_info("download")
            held_while_running.add(len({s.step_key for s in info.claimed_slots if s.run_id != "another-run"}
                                       | {p.step_key for p in info.pending_steps
                                          if p.run_id != "another-run" and p.assigned_timestamp is not None}))
            time.sleep(0.1)
        runner.join(timeout=60)
        assert outcome["result"].success and sorted(ran) == ["images", "videos"]
    if fixed:
        assert len(waiting) == 1, f"the run waited for {len(waiting)} slots at once: {waiting}"
        assert max(held_while_running) == 1
    else:  # Dagster's own claims: both steps wait, and the run is given both slots (the test can fail)
        assert len(waiting) == 2 and max(held_while_running) == 2


def test_a_waiting_step_looks_for_its_slot_soon_then_less_often():
    """The first claims come FIRST_CLAIM_INTERVAL_SECONDS apart (Dagster's: 1 s), backing off by Dagster's
    factor to MAX_CLAIM_INTERVAL_SECONDS (Dagster's: 15 s); an interval the storage asks for is kept."""
    intervals = [concurrency_wait._capped_timeout_interval(None, n) for n in range(100)]
    assert intervals[0] == concurrency_wait.FIRST_CLAIM_INTERVAL_SECONDS < 1
    assert all(a <= b for a, b in zip(intervals, intervals[1:]))
    assert intervals[-1] == concurrency_wait.MAX_CLAIM_INTERVAL_SECONDS
    assert sum(intervals[:8]) < 3  # eight looks within the first 3 s of a wait
    assert concurrency_wait._capped_timeout_interval(0.7, 3) == 0.7


def _lose_a_wake_up(storage, pool: str, run_id: str, step_key: str) -> None:
    """The interleaving that strands a step: its claim counts the pool's slots while another run's step holds
    the last one (none unassigned), that step frees it and finds the queue empty, then the entry is written
    unassigned (``SqlEventLogStorage.claim_concurrency_slot``, its steps one by one)."""
    storage.set_concurrency_slots(pool, 1)
    assert storage.claim_concurrency_slot(pool, "another-run", "its-step").is_claimed
    assert not storage.has_unassigned_slots(pool)  # B counts: no slot free
    storage.free_concurrency_slot_for_step("another-run", "its-step")  # A frees; no one queued yet
    storage.add_pending_step(concurrency_key=pool, run_id=run_id, step_key=step_key, should_assign=False)
    info = storage.get_concurrency_info(pool)
    assert not info.claimed_slots and [p.assigned_timestamp for p in info.pending_steps] == [None]


@pytest.mark.parametrize("fixed", [True, False], ids=["ours", "dagster-1.13"])
def test_a_step_whose_wake_up_was_lost_claims_the_free_slot(monkeypatch, fixed):
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

    if fixed:
        concurrency_wait.apply()
    else:
        monkeypatch.setattr(SqlEventLogStorage, "claim_concurrency_slot", concurrency_wait._original_claim_slot)
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        _lose_a_wake_up(storage, "gpu", "run-b", "clip_embeddings")
        claims = [storage.claim_concurrency_slot("gpu", "run-b", "clip_embeddings").is_claimed for _ in range(3)]
        info = storage.get_concurrency_info("gpu")
    if fixed:  # the first claim looks again later (a free may be half done); the second repairs and claims
        assert claims == [False, True, True]
        assert [(s.run_id, s.step_key) for s in info.claimed_slots] == [("run-b", "clip_embeddings")]
    else:  # Dagster's own claims never see the free slot (the test can fail)
        assert claims == [False, False, False] and not info.claimed_slots


def test_a_queued_step_is_not_assigned_past_the_pool_limit():
    """The repair assigns only while a slot is free: with the slot held, a queued step keeps waiting, and
    once it is freed the usual free -> assign hands it over (no step is assigned twice)."""
    concurrency_wait.apply()
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", "run-a", "clip_embeddings").is_claimed
        assert not any(storage.claim_concurrency_slot("gpu", "run-b", "clip_embeddings").is_claimed for _ in range(4))
        info = storage.get_concurrency_info("gpu")
        assert [p.assigned_timestamp is None for p in info.pending_steps if p.run_id == "run-b"] == [True]
        storage.free_concurrency_slot_for_step("run-a", "clip_embeddings")
        assert storage.claim_concurrency_slot("gpu", "run-b", "clip_embeddings").is_claimed


def test_a_run_stranded_by_a_lost_wake_up_finishes():
    """End to end: a run whose ``gpu`` step entered the queue in the lost wake-up's state runs it and
    succeeds (with Dagster's own claims it waited for ever: the chain benchmark's hang)."""
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import execute_run

    concurrency_wait.apply()

    @dg.op(pool="gpu")
    def embed() -> int:
        return 1

    @dg.job(executor_def=dg.in_process_executor)  # our runs' executor
    def shard():
        embed()

    with dg.instance_for_test() as instance:
        run = instance.create_run_for_job(shard)
        _lose_a_wake_up(instance.event_log_storage, "gpu", run.run_id, "embed")
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(result=execute_run(InMemoryJob(shard), run, instance)))
        runner.start()
        runner.join(timeout=30)
        assert not runner.is_alive(), "the run still waits for the free gpu slot"
        assert outcome["result"].success
