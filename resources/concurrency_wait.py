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

A step can also wait for ever with its pool's slot free: a lost wake-up in Dagster 1.13's SQL storage
(``claim_concurrency_slot``). A step first asks whether the pool has a slot no step is assigned to, and
then enters the queue (``pending_steps``), assigned at once if there was one; a step that frees its slot
assigns the queue's head. When run B's step counts the slots while run A's still holds the last one, and A
frees it (and finds the queue empty) before B's entry is written, B's entry is never assigned: the slot
stays free and B's claims, which only look at their own entry, block for ever. Seen in the 2 x 10,000-row
chain: the second shard's ``clip_embeddings`` blocked on the free ``gpu`` slot, the `shardprep run` hung.
``_claim_slot`` repairs it where it shows: a step whose entry is unassigned while the pool has a free slot,
on two of its claims in a row (a free in progress assigns within milliseconds; the claims are at least
``FIRST_CLAIM_INTERVAL_SECONDS`` apart), assigns the queue's head as a free would, and claims again.

Applied when the code location is loaded (``definitions``): every process that executes our steps (run
workers, `shardprep run --in-process`, Celery workers) imports it.
"""

import time

from dagster._core.execution.plan import active as _active
from dagster._core.execution.plan import instance_concurrency_context as _icc
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

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


_original_claim_slot = SqlEventLogStorage.claim_concurrency_slot


def _claim_slot(self, concurrency_key: str, run_id: str, step_key: str, priority: int | None = None):
    """``SqlEventLogStorage.claim_concurrency_slot``, and the lost wake-up's repair (module doc)."""
    status = _original_claim_slot(self, concurrency_key, run_id, step_key, priority)
    stuck = self.__dict__.setdefault("_shardprep_stuck_claims", set())
    entry = (concurrency_key, run_id, step_key)
    if status.is_claimed or status.is_assigned or status.enqueued_timestamp is None \
            or not self.has_unassigned_slots(concurrency_key):
        stuck.discard(entry)
        return status
    if entry not in stuck:  # perhaps a free in progress: look again at the next claim
        stuck.add(entry)
        return status
    stuck.discard(entry)
    self.assign_pending_steps([concurrency_key])  # what the free would have done: the queue's head
    return _original_claim_slot(self, concurrency_key, run_id, step_key, priority)


def apply() -> None:
    _icc.InstanceConcurrencyContext.interval_to_next_pending_claim_check = _interval_to_next_pending_claim_check
    _icc._calculate_timeout_interval = _capped_timeout_interval
    _icc.InstanceConcurrencyContext.claim = _claim
    _active.ActiveExecution.get_next_step = _next_step
    SqlEventLogStorage.claim_concurrency_slot = _claim_slot
