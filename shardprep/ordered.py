"""``map`` on threads, results in input order, with an optional second stage on threads of its own.

The image shards download on many threads (they mostly wait for the network) and decode on one thread per
core (they compute): a download that returns ``Handoff(args)`` goes on to ``then(*args)`` on the second
stage's threads, in the order the downloads finish, and the item's result is that call's.

Built on ``queue.SimpleQueue`` and one lock an item (both C) rather than two ``ThreadPoolExecutor``s:
there each item cost two Futures, a submit that takes the executor's lock and checks its thread count,
and a result handed to the waiting writer through a Python Condition (``bench/IMAGES.md``).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from shardprep.waiting import SLICE_SECONDS


class Handoff(NamedTuple):
    """What a first-stage call returns to have ``then(*args)`` finish its item on the second stage."""

    args: tuple


class _Raised(NamedTuple):
    error: BaseException


_STOP = object()  # a worker's last item


def ordered_map(fn: Callable, items: Iterable, threads: int, max_in_flight: int,
                on_abort: Callable[[], None] | None = None, *, then: Callable | None = None,
                then_threads: int = 1, name: str = "shardprep-dl", then_name: str = "shardprep-decode") -> Iterator:
    """``map(fn, items)`` on ``threads`` threads, results in input order, at most ``max_in_flight`` items
    taken from ``items`` and not yet consumed (so finished-but-unwritten ones cannot pile up in memory).
    With ``then``, an item for which ``fn`` returns ``Handoff(args)`` yields ``then(*args)``, run on
    ``then_threads`` threads of its own. An exception raised by either call is raised here, in its turn.

    When the consumer stops early (an exception, e.g. a KeyboardInterrupt raised while it waits for a
    result, or the generator closed before the end), items not started are dropped at both stages and
    ``on_abort()`` is called before the threads are waited for: it must make the running calls return at
    once (the download pool's ``abort``), or leaving would wait for every one in flight (up to 3 x timeout).
    A wait for a result wakes every ``SLICE_SECONDS``, so a signal that landed on a worker thread is
    handled promptly (``shardprep.waiting``).
    """
    todo: queue.SimpleQueue = queue.SimpleQueue()
    handed: queue.SimpleQueue = queue.SimpleQueue()
    results: dict[int, Any] = {}
    stopping = False  # set on leaving: workers skip what is still queued

    def work(jobs: queue.SimpleQueue, call: Callable, first: bool) -> None:
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            i, args, finished_lock = job
            if stopping:
                continue
            try:
                result = call(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, as a Future would
                result = _Raised(e)
            if first and then is not None and type(result) is Handoff:
                handed.put((i, result.args, finished_lock))
            else:
                results[i] = result
                finished_lock.release()

    firsts: list[threading.Thread] = []
    seconds: list[threading.Thread] = []

    def start(jobs: queue.SimpleQueue, call: Callable, first: bool, into: list, prefix: str) -> None:
        # daemon: a generator dropped without being closed (its ``finally`` joins them) must not keep the
        # interpreter from exiting, its threads waiting for items that never come
        t = threading.Thread(target=work, args=(jobs, call, first), name=f"{prefix}_{len(into)}", daemon=True)
        t.start()
        into.append(t)

    # one held lock an item, released when its result is in: the consumer sleeps on the one it needs
    # next, so it is woken once an item at most, not at every result that comes in out of turn
    pending: deque = deque()
    submitted = taken = 0

    batch = max(1, max_in_flight // 8)

    def take() -> Any:
        nonlocal taken
        finished_lock = pending[0]
        if not finished_lock.acquire(blocking=False):
            # asleep until the next few items are in, not woken for each: on two cores each wake-up of
            # the consumer preempts a decoding thread (and on a VM costs an inter-processor interrupt).
            # The wait is bounded, so a slow item further on never holds back the ones before it.
            later = pending[min(batch, len(pending)) - 1]
            if later is not finished_lock and later.acquire(timeout=SLICE_SECONDS):
                later.release()  # still marks it finished, for its turn
            while not finished_lock.acquire(timeout=SLICE_SECONDS):
                pass
        pending.popleft()
        result = results.pop(taken)
        taken += 1
        if type(result) is _Raised:
            raise result.error
        return result

    finished = False
    try:
        if then is not None:
            for _ in range(then_threads):
                start(handed, then, False, seconds, then_name)
        for item in items:
            if len(firsts) < threads:  # one more thread per item until there are ``threads``
                start(todo, fn, True, firsts, name)
            finished_lock = threading.Lock()
            finished_lock.acquire()
            pending.append(finished_lock)
            todo.put((submitted, (item,), finished_lock))
            submitted += 1
            if submitted - taken >= max_in_flight:
                yield take()
        while taken < submitted:
            yield take()
        finished = True
    finally:
        stopping = True
        try:
            if not finished and on_abort is not None:
                on_abort()
        finally:
            # waited for: no thread outlives the call (they return quickly once aborted); the first stage
            # first, since it may still hand items to the second
            for group, jobs in ((firsts, todo), (seconds, handed)):
                for _ in group:
                    jobs.put(_STOP)
                for t in group:
                    t.join()
