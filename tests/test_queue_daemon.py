"""The private queue daemon's pacing: what makes it look at the instance at once."""

import time

import dagster as dg
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill

from shardprep_dagster.orchestration.queue_daemon import _state


def _backfill(backfill_id: str) -> PartitionBackfill:
    return PartitionBackfill(backfill_id=backfill_id, status=BulkActionStatus.REQUESTED, from_failure=False,
                             tags={}, backfill_timestamp=time.time(), asset_selection=[dg.AssetKey("x")])


def test_a_backfill_added_as_another_completes_changes_the_daemon_state():
    # `shardprep run` adds its unpartitioned assets' backfill right after its shards' one completes: the
    # active count is 1 before and after, and the daemon used to wait its busy poll (15 s) to notice
    with dg.instance_for_test() as instance:
        first = _backfill("first")
        instance.add_backfill(first)
        before = _state(instance)
        instance.update_backfill(first.with_status(BulkActionStatus.COMPLETED_SUCCESS))
        instance.add_backfill(_backfill("second"))
        after = _state(instance)
        assert before[2] == after[2] == 1
        assert after != before
