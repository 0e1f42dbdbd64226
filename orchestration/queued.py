"""`shardprep run`'s default execution: the plan's (asset, shard) pairs as an asset backfill run by
Dagster's daemons through the instance's run queue (``orchestration.launch``), followed here with one
progress bar; then the unpartitioned assets, as a run executed in this process with the in-process
executor (the default: ``_globals_here``), else as a second backfill (Celery workers).

Several `shardprep run` processes, the UI, backfills and automation may work on one instance at once:
planning and launching happen under a lock of the instance, and pairs some other backfill or run
already has in flight are not launched again: this run waits for them instead, then plans those
shards once more (they may have failed there). SIGTERM and Ctrl-C cancel this run's backfills (their
queued runs are dropped, running ones terminated) and wait for the cancellation.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time

import dagster as dg
from dagster._core.execution.backfill import BulkActionsFilter

from shardprep.artifacts import ARTIFACTS
from shardprep_dagster.assets.follow import IN_PROCESS
from shardprep_dagster.assets.shard_runs import REBUILD_TAG, SHARDS_TAG
from shardprep_dagster.orchestration.instance import instance_lock
from shardprep_dagster.orchestration.launch import (
    Pairs,
    cancel,
    ensure_daemon,
    failures,
    in_flight,
    launch,
    progress,
    run_failures,
    settled,
)
from shardprep_dagster.orchestration.plan import Plan, globals_needed, newest_materialization
from shardprep_dagster.orchestration.progress import ShardProgress
from shardprep_dagster.orchestration.queue_daemon import ACTIVE_BACKFILLS, IN_FLIGHT
from shardprep_dagster.orchestration.recovery import recover_dead_runs
from shardprep_dagster.orchestration.stop import Stop
from shardprep_dagster.orchestration.storage_watch import watch
from shardprep_dagster.orchestration.summary import RunSummary
from shardprep_dagster.resources.dataset import CONFIG_TAG, HOST_TAG, PID_TAG

POLL_SECONDS = 0.2  # the queries that tell news (_Follower._news), at most this often
WATCH_SECONDS = 0.05  # the look at an embedded instance's files that tells whether to query (storage_watch)
READ_SECONDS = 5.0  # the backfills are read at least this often while waited for, news or not (_Follower._news)
DAEMON_CHECK_SECONDS = 5.0
# after SIGTERM: how long the cancellation is waited for (a run's downloads stop at once and it is
# usually over by then; Kubernetes kills 30 s after SIGTERM); what is not cancelled by then the daemon
# finishes cancelling after this process has exited
CANCEL_WAIT_SECONDS = 2.5
STOPPING_POLL_SECONDS = 0.1
MAX_DAEMON_STARTS = 3
# planning again after waiting on another process's backfill, at most this often (it may keep failing)
MAX_ROUNDS = 4
LAUNCHED_BY_TAG = "shardprep/launched_by"


def _tags(plan: Plan) -> dict[str, str]:
    # (the process executing a run tags it with its own pid: ``resources.dataset``)
    tags = {CONFIG_TAG: plan.config_path, LAUNCHED_BY_TAG: f"shardprep run, pid {os.getpid()} on {socket.gethostname()}"}
    if plan.rebuild:
        tags[REBUILD_TAG] = "true"
    if plan.only_spec is not None:
        tags[SHARDS_TAG] = plan.only_spec
    return tags


# With blocks, complete blocks lying between blocks to do, at most this many in a row, are added to the
# backfill: Dagster makes a run of a contiguous range only, so 1% of shards failed at random (a third of
# the blocks of 100 or more) would be thousands of one-block runs at ~1 s each to submit; filled, they are
# a few long ranges, cut into runs of BLOCKS_PER_RUN. A block step skips the complete shards by the state
# index without reading them.
MAX_GAP_BLOCKS = 8


def fill_gaps(order: list[str], todo: set[str], max_gap: int = MAX_GAP_BLOCKS) -> set[str]:
    """``todo`` plus the partitions of ``order`` between two of them, where at most ``max_gap`` lie between."""
    out, last = set(todo), None
    for i, p in enumerate(order):
        if p in todo:
            if last is not None and 0 < i - last - 1 <= max_gap:
                out.update(order[last + 1:i])
            last = i
    return out


def _shard_pairs(plan: Plan, shards: list[str]) -> Pairs:
    pairs: Pairs = {}
    for shard in shards:
        for key in plan.assets_to_do(shard):
            pairs.setdefault(key, set()).add(shard)
    if plan.registration.shards_per_partition > 1 and not plan.rebuild:
        pairs = {key: fill_gaps(plan.shards, todo) for key, todo in pairs.items()}
    return pairs


def spread(partitions: list[str], slots: int, per_run: float) -> list[list[str]]:
    """``partitions`` (in order) cut into contiguous groups, one backfill each, so that their runs keep
    every download slot busy. Dagster cuts a backfill into runs of ``per_run`` partitions (the assets'
    BackfillPolicy) and a run does its shards one after the other, so fewer partitions than ``slots`` x
    ``per_run`` made fewer runs than slots: 2 shards of 10,000 rows were one run downloading for 83 s while
    the pool's second slot idled (bench/E2E.md). They go into ``slots`` groups then (one run each). More
    partitions make enough runs already: cutting them finer measured slower (20 x 1,000 rows: 4 runs of 5
    shards 136.6 s, Dagster's 8, 8 and 4 122.2 s: a process start and a model load per run)."""
    n = len(partitions)
    groups = min(n, slots) if n < slots * per_run else 1
    if groups <= 1:
        return [partitions] if partitions else []
    return [partitions[i * n // groups:(i + 1) * n // groups] for i in range(groups)]


def _download_spread(plan: Plan, instance: dg.DagsterInstance, pairs: Pairs) -> list[Pairs]:
    """``pairs`` as one or more backfills (``spread``) when they download; as one otherwise (a GPU step
    holds its pool's one slot per device, and each extra run loads the models again)."""
    downloads = [k for k in pairs if ARTIFACTS[k.path[-1]].pool == "download"]
    if not downloads:
        return [pairs]
    graph = plan.defs.resolve_asset_graph()
    # no policy: a run per partition; a single-run policy (no maximum): every partition in one run
    per_run = min(1 if p is None else p.max_partitions_per_run or math.inf
                  for p in (graph.get(k).backfill_policy for k in downloads))
    info = instance.event_log_storage.get_concurrency_info("download")
    slots = info.slot_count if info.slot_count else 1
    order = {p: i for i, p in enumerate(plan.shards)}
    partitions = sorted(set().union(*pairs.values()), key=order.__getitem__)
    groups = [set(g) for g in spread(partitions, slots, per_run)]
    return [{k: v & g for k, v in pairs.items() if v & g} for g in groups]


def _overlaps(pairs: Pairs, busy: Pairs) -> set[str]:
    """Shards of ``pairs`` that have some asset in ``busy``."""
    return {s for key, shards in pairs.items() for s in shards & busy.get(key, set())}


class _Follower:
    """Waits for backfills, keeping the daemon alive, the bar current and the stop signal honoured."""

    def __init__(self, instance: dg.DagsterInstance, stop: Stop, bar, progress: ShardProgress) -> None:
        self.instance, self.stop, self.bar, self.progress = instance, stop, bar, progress
        self._daemon_checked = 0.0
        self._starts = 0
        self._cancelled: set[str] = set()
        self.unmarked: set[str] = set()  # ours, left materialized out before the daemon marked them done
        # found materialized out (``launch.materialized_out``), which stays so: not looked at again, neither
        # while the other backfills finish nor for their failures at the end (each look reads every asset's
        # materializations: ~25 ms a backfill on 2 cores, between the last shard and the unpartitioned assets)
        self.materialized_out: set[str] = set()
        self._seen, self._read_at = None, -math.inf  # what _news saw last, and when the backfills were read
        # None: not SQLite, the queries on a timer are the test. Two watches: the run storage's file changes
        # when a run or backfill changes state (rarely while shards download), the event index's at every
        # step's events
        self._runs_watch, self._watch = watch(instance, ("runs",)), watch(instance, ("index",))
        self._tick = POLL_SECONDS if self._watch is None else WATCH_SECONDS
        self._queried_at = -math.inf  # when the news was last queried

    def _check_daemon(self) -> None:
        recover_dead_runs(self.instance)  # a killed run worker must not hold its backfill (and slots) forever
        started = ensure_daemon(self.instance) == "started"
        self._starts = self._starts + 1 if started else 0
        self._daemon_checked = time.monotonic()
        if self._starts > MAX_DAEMON_STARTS:  # it keeps dying: say why instead of waiting forever
            log = os.path.join(self.instance.root_directory, "shardprep_daemon.log")
            with open(log, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"the Dagster daemon for this instance does not stay up; its log {log} ends:\n{tail}")

    def _news(self) -> bool:
        """Whether the backfills are worth reading now: since they were last read an event was logged (a run
        started or ended, a step materialized a shard), the runs in flight or the active backfills changed
        in number, or READ_SECONDS passed. Reading them (each backfill's state deserialized, runs counted)
        every POLL_SECONDS cost `shardprep run` ~4.5% of a core for as long as it waited (2 x 10,000-row
        chain on the slower benchmark machine); these are three indexed queries. The counts, because a run's
        success is logged before its status is stored: a read between the two saw the last run still in
        flight, and no event came after it to read again, so the unpartitioned assets waited the 5 s.
        On an embedded instance the queries run only once its files have changed (``storage_watch``), looked
        at every WATCH_SECONDS: a run's end is seen within that, and while nothing is written (a shard
        downloading) nothing is queried. A run's or backfill's change of state is queried at once, events at
        most every POLL_SECONDS: the last shard run's end came in the middle of the steps' events, and waited
        for the period's end (0.1 s on average, between the shards and the unpartitioned assets)."""
        now = time.monotonic()
        if self._watch is not None:
            since = now - self._queried_at
            runs = self._runs_watch.due(since, 0.0)  # (a query reads the events too: taken with it)
            if not self._watch.due(since, POLL_SECONDS, overdue=runs or now - self._read_at >= READ_SECONDS):
                return False
        self._queried_at = now
        news = (self.instance.event_log_storage.get_maximum_record_id() or 0,
                self.instance.get_runs_count(filters=dg.RunsFilter(statuses=IN_FLIGHT)),
                self.instance.get_backfills_count(filters=BulkActionsFilter(statuses=ACTIVE_BACKFILLS)))
        if news == self._seen and time.monotonic() - self._read_at < READ_SECONDS:
            return False
        self._seen, self._read_at = news, time.monotonic()
        return True

    def wait_out(self, keys: list[dg.AssetKey]) -> None:
        """Until no run has any of ``keys`` in flight (or a stop signal came): a run another `shardprep run`
        executes in its own process (``_globals_here``); one whose process died is closed by the daemon
        check (``recover_dead_runs``), so this ends."""
        self._poll_while(lambda: any(k in in_flight(self.instance)[0] for k in keys))

    def _poll_while(self, pending) -> None:
        """Until ``pending()`` is false or a stop signal came, keeping the daemon alive meanwhile."""
        while self.stop.received() is None and pending():
            if time.monotonic() - self._daemon_checked > DAEMON_CHECK_SECONDS:
                self._check_daemon()
            time.sleep(POLL_SECONDS)

    def wait(self, ours: list[str], others: list[str], shards_of: dict[str, set[str]] | None = None) -> None:
        """Until every backfill in ``ours`` and ``others`` has finished. ``shards_of``: shard -> its pairs
        in ``ours`` as ``asset/shard`` strings, for the progress bar."""
        counted: set[str] = set()
        self._read_at = -math.inf  # the new backfills are read at once (launching one logs no event)
        while True:
            stopping = self.stop.received() is not None
            if stopping:
                for backfill_id in ours:
                    if backfill_id not in self._cancelled:
                        cancel(self.instance, backfill_id)
                        self._cancelled.add(backfill_id)
                if time.monotonic() > self.stop.at + CANCEL_WAIT_SECONDS:
                    return
            elif time.monotonic() - self._daemon_checked > DAEMON_CHECK_SECONDS:
                self._check_daemon()
            if not stopping and not self._news():
                time.sleep(self._tick)
                continue
            states = {b: progress(self.instance, b) for b in ours + others}
            settled_partitions: set[str] = set()
            if shards_of:
                done_pairs = set()
                for state in (states[b] for b in ours):
                    done_pairs |= {f"{k.to_user_string()}/{s}" for k, shards in state.done.items() for s in shards}
                    done_pairs |= {f"{k.to_user_string()}/{s}" for k, shards in state.failed.items() for s in shards}
                newly = [s for s, pairs in shards_of.items() if s not in counted and pairs <= done_pairs]
                counted.update(newly)
                settled_partitions.update(newly)
            cut_short = not stopping and self._materialized_out(ours, others, states)
            if cut_short and shards_of:
                settled_partitions = set(shards_of)  # every pair was materialized
            # the bar moves per shard, as the steps record outcomes (a block's shards one by one)
            self.progress.poll(settled_partitions)
            if cut_short or all(state.finished for state in states.values()):
                return
            time.sleep(STOPPING_POLL_SECONDS if stopping else self._tick)

    def _materialized_out(self, ours: list[str], others: list[str], states: dict) -> bool:
        """Every backfill finished, ours but for the daemon's mark (``launch.materialized_out``): the run goes
        on at once, and ``wait_marked`` waits for the marks after the unpartitioned assets' run."""
        if not ours or not all(states[b].finished for b in others):
            return False
        unmarked = [b for b in ours if not states[b].finished]
        # (one the daemon marked finished since ``states`` were read is finished: read as unmarked, it kept
        # the run waiting a poll period for the next read, 0.2 s between the shards and the globals)
        if not unmarked or not all(self._out(b) for b in unmarked):
            return False
        self.unmarked.update(unmarked)
        return True

    def _out(self, backfill_id: str) -> bool:
        """Finished, or materialized out (``launch.settled``; the latter remembered)."""
        if backfill_id in self.materialized_out:
            return True
        how = settled(self.instance, backfill_id)
        if how == "materialized out":
            self.materialized_out.add(backfill_id)
        return how is not None

    def wait_marked(self) -> None:
        """Until the daemon has marked ``unmarked`` finished (it usually has, by the end of the run): a run
        leaves no backfill of its own in flight, which another run would wait for."""
        def still_unmarked() -> bool:
            self.unmarked = {b for b in self.unmarked if not progress(self.instance, b).finished}
            return bool(self.unmarked)

        self._poll_while(still_unmarked)


def _launch_shards(plan: Plan, instance: dg.DagsterInstance, shards: list[str], summary: RunSummary,
                   follower: _Follower) -> list[str]:
    """Launch the pairs of ``shards`` no one else has in flight; wait for ours and theirs. Returns the
    shards that were someone else's (to plan again once that work is over)."""
    with instance_lock(instance, "submit"):
        busy, busy_ids = in_flight(instance)
        pairs = _shard_pairs(plan, shards)
        theirs = _overlaps(pairs, busy)
        mine = _shard_pairs(plan, [s for s in shards if s not in theirs])
        parts = _download_spread(plan, instance, mine) if mine else []
        ours = [launch(instance, part, tags=_tags(plan),
                       title="shardprep run: shards" + (f" ({i} of {len(parts)})" if len(parts) > 1 else ""))
                for i, part in enumerate(parts, 1)]
    summary.backfills += ours
    if theirs:
        summary.waited_for(busy_ids)
    shards_of = {}
    for key, keys in mine.items():
        for s in keys:
            shards_of.setdefault(s, set()).add(f"{key.to_user_string()}/{s}")
    follower.wait(ours, busy_ids if theirs else [], shards_of)
    return sorted(theirs)


def _launch_globals(plan: Plan, instance: dg.DagsterInstance, summary: RunSummary, follower: _Follower,
                    newest_shard: int | None) -> bool:
    """Run the unpartitioned assets (here, or as a backfill: ``_globals_here``) when they must run and no
    one else runs them; else wait for theirs. True when it waited on someone else's (whose result must be
    checked: it may have failed, or died with its process). ``newest_shard``: the newest shard
    materialization's storage id, if known (``plan.globals_needed``)."""
    here = None
    with instance_lock(instance, "submit"):
        busy, busy_ids = in_flight(instance)
        if any(k in busy for k in plan.global_keys):  # another run updates them now: wait, then look again
            summary.waited_for(busy_ids)
            ours = []
        elif plan.rebuild or globals_needed(instance, plan.shard_keys, plan.global_keys, plan.versions, newest_shard):
            follower.bar.write("updating balanced tars, wdinfo, precached encodings and energon indexes ...")
            if _globals_here(plan):
                # created under the lock, so other processes see it in flight from now on
                here = _global_run(plan, instance)
                ours = []
            else:
                ours = [launch(instance, {k: {""} for k in plan.global_keys}, tags=_tags(plan),
                               title="shardprep run: unpartitioned assets")]
        else:
            return False
    if here is not None:
        _execute_here(here, instance, summary, follower.stop)
        return False
    summary.backfills += ours
    follower.wait(ours, [] if ours else busy_ids)
    if not ours:  # another process may run them in its own process: a run, not a backfill
        follower.wait_out(plan.global_keys)
    return not ours


def _globals_here(plan: Plan) -> bool:
    """Whether the unpartitioned assets run in this process. With the in-process executor (the default) a
    run executes all its steps in one process anyway, and the CLI is one: running them here saves what a
    backfill costs between the last shard and the first global step (the backfill daemon's tick, the
    queue, a run worker's start: 2.9 s of a 2 x 10,000-row chain's 85 s, bench/E2E.md) and the wait for
    the daemon to mark it done. Steps on Celery workers (or any other executor) go through a backfill."""
    return plan.defs.resolve_job_def("global_job").executor_def.name in IN_PROCESS


def _global_run(plan: Plan, instance: dg.DagsterInstance) -> tuple[dg.JobDefinition, dg.DagsterRun]:
    """The unpartitioned assets' run, created (not started) with this process's pid, so that a kill of this
    process leaves a run that ``recover_dead_runs`` closes, as for ``--in-process`` runs."""
    from shardprep_dagster.orchestration.in_process import QUIET_RUN_CONFIG

    job = plan.defs.resolve_job_def("global_job")
    keys = frozenset(plan.global_keys)
    if keys != job.asset_layer.selected_asset_keys:
        job = job.get_subset(asset_selection=set(keys))
    tags = {**_tags(plan), PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}
    return job, instance.create_run_for_job(job, run_config=QUIET_RUN_CONFIG, tags=tags, asset_selection=keys)


def _execute_here(job_run: tuple[dg.JobDefinition, dg.DagsterRun], instance: dg.DagsterInstance,
                  summary: RunSummary, stop: Stop) -> None:
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import execute_run

    job, run = job_run
    result = execute_run(InMemoryJob(job), run, instance)
    summary.runs += 1
    summary.global_run = run.run_id
    if stop.received() is not None:
        instance.report_run_canceled(result.dagster_run, stop.reason)
    elif not result.success:
        run_failures(instance, run, summary.failed)  # (reads the run's id, tags and events)


def execute(plan: Plan, instance: dg.DagsterInstance, summary: RunSummary, progress_bar: bool) -> None:
    from tqdm import tqdm

    if getattr(instance, "root_directory", None) is None:
        raise ValueError("queued execution needs a persistent Dagster instance ($DAGSTER_HOME); "
                         "use --in-process with an ephemeral one")
    todo = plan.todo_shards()
    bar = tqdm(total=0, desc="shards", unit="shard", disable=not progress_bar, file=sys.stderr)
    shard_progress = ShardProgress(plan, todo, bar)
    bar.total = shard_progress.total
    bar.refresh()
    with Stop(raise_between=False) as stop:
        # the daemon was started before planning (runner.run_pipeline); the follower checks it as it waits
        follower = _Follower(instance, stop, bar, shard_progress)
        for _ in range(MAX_ROUNDS):  # others had some in flight: what is left of them is ours
            if not todo or stop.received() is not None:
                break
            waited = _launch_shards(plan, instance, todo, summary, follower)
            if not waited:  # none was someone else's: nothing to plan again (0.25 s between shards and globals)
                break
            plan.replan(instance)
            todo = [s for s in waited if plan.todo[s]]
        summary.shards_settled = newest_materialization(instance, plan.shard_keys)
        newest_shard = summary.shards_settled
        for _ in range(MAX_ROUNDS):  # another process's update of them may have failed or died
            if stop.received() is not None or not _launch_globals(plan, instance, summary, follower, newest_shard):
                break
            newest_shard = None  # (others may have materialized shards while this one waited)
        follower.wait_marked()
    bar.close()
    if stop.signum is None:  # (stopping: be quick; the daemon frees what the cancelled runs held)
        recover_dead_runs(instance)  # slots a killed worker's run left claimed go back now, not a tick later
    summary.stopped_by = stop.signum
    for backfill_id in summary.backfills:
        summary.runs += instance.get_runs_count(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        for shard, error in failures(instance, backfill_id,
                                     materialized=backfill_id in follower.materialized_out).items():
            summary.failed.setdefault(shard, error)
