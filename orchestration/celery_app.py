"""The Celery app shardprep workers run (``celery -A shardprep_dagster.orchestration.celery_app worker``; ``shardprep worker``
starts it): dagster-celery's step task, with the broker, backend and settings of
``orchestration.distributed`` (``SHARDPREP_CELERY_BROKER`` / ``SHARDPREP_CELERY_BACKEND``), so the
runs and the workers always agree.

A warm shutdown (SIGTERM, a first Ctrl+C) waits for the running task; a shard downloading from slow
hosts would hold it for up to 3 x timeout per URL, past Kubernetes' SIGKILL 30 s later. So
``abandon_downloads`` runs on ``worker_shutting_down``: the downloads in flight in this process are
abandoned, the shard being written raises ``DownloadsAborted`` (nothing is written; the step fails and
the next run fetches the shard again), the task ends, and the worker's event loop is woken so that it
stops then, not at the end of its next poll (up to 10 s later).

Celery sends that signal from its signal handler, in the worker's MainProcess only. With ``--pool
solo`` (``shardprep worker``'s default, ``orchestration.distributed.worker_argv``) the task runs there,
in the main thread, which the handler interrupts. With ``--pool prefork`` (``--concurrency`` > 1) the
tasks run in child processes that never get the signal (Celery resets SIGTERM and ignores SIGINT in
them): the hook aborts nothing there and the parent waits for the children's tasks as before."""

import _thread
import time

from celery.signals import worker_shutting_down
from dagster._core.execution.retries import RetryMode
from dagster_celery.executor import CeleryExecutor
from dagster_celery.make_app import make_app
from dagster_celery.tasks import create_task
from kombu.asynchronous import get_event_loop

from shardprep import fetch
from shardprep_dagster.resources.executor import celery_config
from shardprep_dagster.resources.settings import load_settings


def abandon_downloads(**_signal_kwargs) -> None:
    """``worker_shutting_down`` receiver: abort every download pool of this process, and the ones a
    step would still make (``materialize_shards`` goes on to the next shard after a failed one)."""
    fetch.abort_all(refuse_new=True)
    _wake_event_loop()


def _wake_event_loop() -> None:
    """Have the worker's event loop look at its shutdown flag soon: it checks it between polls, and a
    poll lasts up to 10 s (a signal does not end it: Python resumes the wait). ``Hub.call_soon`` wakes a
    poll, but only from another thread, so a thread does it; started with ``_thread``, which takes none
    of ``threading``'s locks (this runs in a signal handler, maybe while the main thread holds one)."""
    hub = get_event_loop()
    if hub is not None:
        _thread.start_new_thread(_keep_waking, (hub,))


def _keep_waking(hub, seconds: float = 10.0, every: float = 0.2) -> None:
    # repeated: a loop that has not made its waker yet (a task taken at start-up runs before the loop's
    # first turn) misses a wake-up; the callbacks themselves do nothing
    for _ in range(int(seconds / every)):
        hub.call_soon(_nothing)
        time.sleep(every)


def _nothing() -> None:
    pass


# connected at import, so any worker that loads this module (``-A shardprep_dagster.orchestration.celery_app``) has it;
# weak=False: the signal must keep the receiver; dispatch_uid: one connection however often imported
worker_shutting_down.connect(abandon_downloads, weak=False, dispatch_uid="shardprep.abandon_downloads")

app = make_app(CeleryExecutor(retries=RetryMode(RetryMode.DISABLED), **celery_config(load_settings())).app_args())
execute_plan = create_task(app)
