"""A step waiting for a pool slot (``download``, ``gpu``) sleeps between its claims instead of spinning.

Dagster 1.13's ``InstanceConcurrencyContext.interval_to_next_pending_claim_check`` returns
``min([0, *time_to_each_check])``: never more than 0, so the executor's ``sleep_til_ready`` never sleeps and
a run whose step waits for a slot spins a core for as long as it waits (upstream noticed it in
dagster#20367, closed unmerged). With `shardprep run`'s 20 x 1,000-row chain on 2 cores, the third download
run waited ~100 s for one of the two ``download`` slots and burnt one of the two cores doing so
(bench/E2E.md). The fix is the interval it meant: the time until the next check, at least 0.

The checks themselves back off from 1 s to 15 s (``_calculate_timeout_interval``); a waiting step then
started up to 15 s after its slot was freed. They are capped at ``MAX_CLAIM_INTERVAL_SECONDS`` here: one
query of the instance per waiting step every 2 s costs nothing beside a step that waits for minutes.

Applied when the code location is loaded (``definitions``): every process that executes our steps (run
workers, `shardprep run --in-process`, Celery workers) imports it.
"""

import time

from dagster._core.execution.plan import instance_concurrency_context as _icc

MAX_CLAIM_INTERVAL_SECONDS = 2.0

_original_interval = _icc._calculate_timeout_interval


def _interval_to_next_pending_claim_check(self) -> float:
    if not self._pending_claims:
        return 0.0
    now = time.time()
    return max(0.0, min((ready_at - now for ready_at in self._pending_timeouts.values()), default=0.0))


def _capped_timeout_interval(sleep_interval, pending_claim_count: int) -> float:
    return min(MAX_CLAIM_INTERVAL_SECONDS, _original_interval(sleep_interval, pending_claim_count))


def apply() -> None:
    _icc.InstanceConcurrencyContext.interval_to_next_pending_claim_check = _interval_to_next_pending_claim_check
    _icc._calculate_timeout_interval = _capped_timeout_interval
