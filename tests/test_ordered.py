"""shardprep.ordered: results in input order from two stages of threads, bounded, and stopped cleanly."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest

from shardprep.ordered import Handoff, ordered_map


def _alive(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def test_two_stages_give_every_result_in_input_order():
    rng = random.Random(0)
    delays = [rng.random() / 500 for _ in range(400)]

    def first(i):
        time.sleep(delays[i])
        return Handoff((i, i * i)) if i % 3 else ("first", i)

    def second(i, square):
        time.sleep(delays[-1 - i])
        return ("second", square)

    got = list(ordered_map(first, range(400), 8, 16, then=second, then_threads=2,
                           name="t-first", then_name="t-second"))
    assert got == [("second", i * i) if i % 3 else ("first", i) for i in range(400)]
    assert not _alive("t-first") and not _alive("t-second")


def test_without_then_a_handoff_is_a_plain_result():
    assert list(ordered_map(lambda i: Handoff((i,)), range(5), 2, 4)) == [Handoff((i,)) for i in range(5)]


def test_the_second_stage_runs_on_its_own_threads_at_most_then_threads_at_once():
    running, most, lock = 0, 0, threading.Lock()

    def second(i):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        assert threading.current_thread().name.startswith("t-decode")
        time.sleep(0.002)
        with lock:
            running -= 1
        return i

    got = list(ordered_map(lambda i: Handoff((i,)), range(60), 16, 32, then=second, then_threads=3,
                           then_name="t-decode"))
    assert got == list(range(60))
    assert most == 3


@pytest.mark.parametrize("stage", ["first", "second"])
def test_an_exception_is_raised_in_its_turn_after_the_items_before_it(stage):
    def first(i):
        if stage == "first" and i == 7:
            raise KeyError(i)
        return Handoff((i,))

    def second(i):
        if stage == "second" and i == 7:
            raise KeyError(i)
        return i

    got = []
    with pytest.raises(KeyError) as raised:
        for x in ordered_map(first, range(50), 4, 8, then=second, then_threads=2, name="t-raise"):
            got.append(x)
    assert got == list(range(7)) and raised.value.args == (7,)
    assert not _alive("t-raise")


def test_at_most_max_in_flight_items_are_taken_and_not_yet_consumed():
    taken = 0

    def items():
        nonlocal taken
        for i in range(300):
            taken += 1
            yield i

    consumed = 0
    for _ in ordered_map(lambda i: Handoff((i,)), items(), 8, 12, then=lambda i: i, then_threads=2):
        assert taken - consumed <= 12
        consumed += 1
    assert consumed == 300


def test_closing_early_drops_what_is_queued_calls_on_abort_and_leaves_no_thread():
    second_calls, aborted = [], threading.Event()

    def second(i):
        second_calls.append(i)
        time.sleep(0.05)
        return i

    results = ordered_map(lambda i: Handoff((i,)), range(1000), 8, 64, on_abort=aborted.set,
                          then=second, then_threads=1, name="t-close", then_name="t-close-2")
    with closing(results):
        assert next(results) == 0
    started = len(second_calls)
    assert aborted.is_set()
    assert started < 10, f"{started} decodes ran after the close: the queued ones were not dropped"
    time.sleep(0.2)
    assert len(second_calls) == started
    assert not _alive("t-close")


def test_a_slow_item_further_on_does_not_hold_back_the_ones_before_it():
    """The consumer sleeps until a few items are in rather than waking for each; that wait is bounded."""
    def first(i):
        time.sleep(2.0 if i == 7 else 0.1)  # item 0 is not in yet when first asked for
        return i

    start = time.monotonic()
    results = ordered_map(first, range(16), 16, 64, name="t-slow")
    with closing(results):
        assert [next(results) for _ in range(7)] == list(range(7))
        early = time.monotonic() - start
        assert next(results) == 7
    assert early < 1.0, f"the first 7 items waited {early:.1f}s for item 7"


def test_a_generator_left_unclosed_does_not_keep_the_interpreter_from_exiting():
    code = ("from shardprep.ordered import Handoff, ordered_map\n"
            "g = ordered_map(lambda i: Handoff((i,)), range(100), 4, 8, then=lambda i: i)\n"
            "assert next(g) == 0\n")  # g stays referenced, suspended, until the interpreter goes
    done = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
