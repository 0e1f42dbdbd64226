"""How a run's process waits for pool slots (``download``, ``gpu``): it sleeps between its claims instead of
spinning, and it waits for one slot at a time.

Dagster 1.13's ``InstanceConcurrencyContext.interval_to_next_pending_claim_check`` returns
``min([0, *time_to_each_check])``: never more than 0, so the executor's ``sleep_til_ready`` never sleeps and
a run whose step waits for a slot spins a core for as long as it waits (upstream noticed it in
dagster#20367, closed unmerged). With `shardprep run`'s 20 x 1,000-row chain on 2 cores, the third download
run waited ~100 s for one of the two ``download`` slots and burnt one of the two cores doing so
(bench/E2E.md). The fix is the interval it meant: the time until the next check, at least 0.

The checks themselves back off from 1 s to 15 s (``_calculate_timeout_interval``); a waiting step then
started up to 15 s after its slot was freed. Here they start at ``FIRST_CLAIM_INTERVAL_SECONDS`` and back
off by Dagster's factor (1.1) to ``MAX_CLAIM_INTERVAL_SECONDS``: the short waits are the ones on the critical
path (two runs' ``gpu`` steps of a fraction of a second each, one after the other, at the end of a chain:
the second started ~1 s after the first had ended, bench/E2E.md), and one claim per waiting step every 2 s
once the wait is long costs nothing beside a step that waits for minutes.

A run executed in one process (the in-process executor, our runs' default) runs one step at a time, but
Dagster 1.13 claims a slot for every step that is ready: a run whose ``image_shards`` and ``video_shards``
were both waiting for a ``download`` slot was given two, ran the one (30 s of downloads) and held the
other idle meanwhile, while a second run's download waited for it (20 x 1,000-row chain: one of the two
download slots idle for 30 s of every 60). So that executor's next step claims a slot only while no other
step of the run is waiting for one; the others claim after it (``_one_claim_at_a_time``). Executors that
run steps side by side (multiprocess, Celery) claim as before.

Applied when the code location is loaded (``definitions``): every process that executes our steps (run
workers, `shardprep run --in-process`, Celery workers) imports it.
"""

import time

from dagster._core.execution.plan import active as _active
from dagster._core.execution.plan import instance_concurrency_context as _icc

FIRST_CLAIM_INTERVAL_SECONDS = 0.05
MAX_CLAIM_INTERVAL_SECONDS = 2.0

_original_interval = _icc._calculate_timeout_interval


def _interval_to_next_pending_claim_check(self) -> float:
    if not self._pending_claims:
        return 0.0
    now = time.time()
    return max(0.0, min((ready_at - now for ready_at in self._pending_timeouts.values()), default=0.0))


def _capped_timeout_interval(sleep_interval, pending_claim_count: int) -> float:
    if sleep_interval is not None:  # the storage said how long to wait: as Dagster does
        return min(MAX_CLAIM_INTERVAL_SECONDS, _original_interval(sleep_interval, pending_claim_count))
    return min(MAX_CLAIM_INTERVAL_SECONDS, FIRST_CLAIM_INTERVAL_SECONDS * _icc.STEP_UP_BASE ** min(pending_claim_count, 60))


_original_claim = _icc.InstanceConcurrencyContext.claim
_original_next_step = _active.ActiveExecution.get_next_step


def _claim(self, concurrency_key: str, step_key: str, step_priority: int = 0) -> bool:
    if getattr(self, "_one_claim_at_a_time", False) and any(k != step_key for k in self._pending_claims):
        return False  # another step of this run waits for a slot: this one claims once that one has run
    return _original_claim(self, concurrency_key, step_key, step_priority)


def _next_step(self):
    """The in-process executor's next step (``execute_plan``: the one caller), claiming one slot at a time."""
    context = self._instance_concurrency_context
    if context is None:
        return _original_next_step(self)
    context._one_claim_at_a_time = True
    try:
        return _original_next_step(self)
    finally:
        context._one_claim_at_a_time = False


def apply() -> None:
    _icc.InstanceConcurrencyContext.interval_to_next_pending_claim_check = _interval_to_next_pending_claim_check
    _icc._calculate_timeout_interval = _capped_timeout_interval
    _icc.InstanceConcurrencyContext.claim = _claim
    _active.ActiveExecution.get_next_step = _next_step
