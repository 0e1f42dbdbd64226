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
        time.sleep(3.0)
        busy = _thread_cpu(runner)
        assert runner.is_alive()  # still waiting for the slot
        storage.free_concurrency_slot_for_step("another-run", "its-step")
        runner.join(timeout=60)
        assert not runner.is_alive() and outcome["result"].success
    if fixed:
        assert busy < 0.5, f"the waiting run used {busy:.2f} CPU-seconds in 3 s"
    else:
        assert busy > 1.0, f"Dagster's own loop used only {busy:.2f} CPU-seconds in 3 s: the fix may be moot"
