"""The per-host limits kept in Redis (``per_host_limits_url``: shardprep.politeness.RedisHostLimits), so
they hold across machines: two separate processes (as two machines' workers would be) downloading from
one real HTTP server on 127.0.0.1 that watches its requests, a holder killed while it held slots, the
rate's wait past the deadline, and an unreachable Redis. Each test has its own key prefix, deleted after.

Needs the Redis on 127.0.0.1:6379 (``SHARDPREP_TEST_REDIS_URL`` for another). Bounds are loose where a
loaded machine could only slow things down; the invariants (never more than N at once, never faster than
the rate) are checked exactly."""

from __future__ import annotations

import io
import multiprocessing
import os
import threading
import time
import uuid

import pyarrow as pa
import pytest

from shardprep import politeness
from shardprep.config import config_from_dict
from shardprep.fetch import DownloadsAborted, make_pool
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from tests.fixtures import synthetic
from tests.fixtures.watched_http import WatchedServer

REDIS_URL = os.environ.get("SHARDPREP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def prefix(monkeypatch):
    """A key prefix of this test's own, for ``shared()`` too; its keys are deleted after."""
    import redis

    name = f"shardprep-test:{uuid.uuid4().hex}:"
    monkeypatch.setattr(politeness, "KEY_PREFIX", name)
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()  # no Redis: the test errors here, saying so
    yield name
    keys = list(client.scan_iter(match=name + "*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def serve():
    buf = io.BytesIO()
    synthetic.render_image(0, 32, 24).save(buf, "JPEG")
    servers = []

    def start(delay: float = 0.0) -> WatchedServer:
        servers.append(WatchedServer(buf.getvalue(), delay))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _fields(tmp_path, **fields) -> dict:
    return {"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url",
            "caption_col": None, "samples_per_shard": 64, "image_size": 16, "timeout": 10, "thread_count": 4,
            "allow_private_addresses": True, "respect_robots_txt": False, "extract_exif": False,
            "per_host_state_dir": str(tmp_path / "limits"), "per_host_limits_url": REDIS_URL, **fields}


# --- in the spawned workers: each its own process, as on two machines (no shared files: own state dirs)

_START = None  # the start barrier both workers wait at (multiprocessing's)


def _worker_init(prefix: str, start, scratch: dict) -> None:
    global _START
    politeness.KEY_PREFIX, _START = prefix, start
    # a shard of no rows first: the imports a first shard makes (~1 s, more on a busy machine) are done
    # before the start, so the two processes' requests overlap
    cfg = config_from_dict({**scratch, "output_root": f"{scratch['output_root']}-{os.getpid()}"})
    write_image_shard(pa.table({"url": pa.array([], pa.string())}), 0, cfg, Layout(cfg.output_root))


def _shard_when_both_are_ready(fields: dict, urls: list[str], shard_id: int) -> int:
    _START.wait(timeout=120)  # both start together: their requests overlap
    cfg = config_from_dict(fields)
    return write_image_shard(pa.table({"url": urls}), shard_id, cfg, Layout(cfg.output_root)).successes


def _in_two_processes(prefix: str, *runs: tuple[list[dict], list[list[str]]]) -> None:
    """Each run, one after the other: shards 0 and 1 written at once by two spawned processes, with
    their own config fields (own state dirs, so only Redis can share a limit) and URLs."""
    ctx = multiprocessing.get_context("spawn")
    scratch = {**runs[0][0][0], "output_root": runs[0][0][0]["output_root"] + "-warm"}
    with ctx.Pool(2, initializer=_worker_init, initargs=(prefix, ctx.Barrier(2), scratch)) as procs:
        for fields, urls in runs:
            results = [procs.apply_async(_shard_when_both_are_ready, (fields[i], urls[i], i)) for i in (0, 1)]
            assert [r.get(timeout=180) for r in results] == [len(urls[0]), len(urls[1])]


def _overlap(spans: list[tuple[str, float, float]]) -> float:
    """Seconds during which both processes' requests (paths /p0/..., /p1/...) were under way."""
    first = [(s, e) for p, s, e in spans if p.startswith("/p0/")]
    second = [(s, e) for p, s, e in spans if p.startswith("/p1/")]
    return (min(max(e for _, e in first), max(e for _, e in second))
            - max(min(s for s, _ in first), min(s for s, _ in second)))


def test_two_processes_share_a_connection_limit_through_redis(tmp_path, prefix, serve):
    limited, unlimited = serve(delay=0.2), serve(delay=0.2)
    each = [_fields(tmp_path, per_host_state_dir=str(tmp_path / f"limits{i}"), output_root=str(tmp_path / f"o{i}"),
                    per_host_connections=2) for i in (0, 1)]
    free = [{**f, "per_host_connections": 0} for f in each]
    # 20 requests of 0.2 s each through 2 slots: >= 2 s of work per process, so a start delayed by a busy
    # machine still leaves the two processes' requests overlapping
    _in_two_processes(prefix, (each, [limited.urls(20, "/p0"), limited.urls(20, "/p1")]),
                      (free, [unlimited.urls(20, "/p0"), unlimited.urls(20, "/p1")]))
    assert len(limited.starts) == len(unlimited.starts) == 40
    assert _overlap(limited.spans) > 0  # they did run at once, each with 4 threads and a limit of 2
    assert limited.most == 2  # together never more than 2 (and the limit was reached)
    assert unlimited.most > 2  # the same without the limit: more at once, so the check above can fail


def test_two_processes_share_a_rate_through_redis(tmp_path, prefix, serve):
    server = serve()
    rate, n = 4.0, 12  # requests per second per host; rows per process
    each = [_fields(tmp_path, per_host_state_dir=str(tmp_path / f"limits{i}"), output_root=str(tmp_path / f"o{i}"),
                    per_host_connections=0, per_host_requests_per_second=rate) for i in (0, 1)]
    _in_two_processes(prefix, (each, [server.urls(n, "/p0"), server.urls(n, "/p1")]))
    starts = sorted(server.starts)
    assert len(starts) == 2 * n
    assert _overlap(server.spans) > 0  # they did run at once
    # GCRA with a burst of max(1, rate): any k consecutive requests span at least (k - burst) / rate.
    # SLACK: an arrival is later than its reserved start, by more when the machine is busy. Per-process
    # buckets would fail this: 24 requests within (12 - 4) / 4 = 2 s is over 4 x (2 + 0.5) + 4 = 14
    burst, slack = max(1.0, rate), 0.5
    worst = max((j - i + 1) - (rate * (starts[j] - starts[i] + slack) + burst)
                for i in range(len(starts)) for j in range(i, len(starts)))
    assert worst <= 0, [round(t - starts[0], 3) for t in starts]


def _hold_two_then_hang(url: str, prefix: str, held) -> None:
    limits = politeness.RedisHostLimits(url, 2, 0.0, prefix=prefix, grace=0.5)
    pool = make_pool(2)
    slots = [limits.acquire("h:80", time.monotonic() + 1.0, pool) for _ in range(2)]
    held.put(slots)
    time.sleep(120)  # killed meanwhile, its slots never released


def test_a_killed_holders_slots_lapse_at_its_deadline(prefix):
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Queue()
    child = ctx.Process(target=_hold_two_then_hang, args=(REDIS_URL, prefix, held), daemon=True)
    child.start()
    try:
        assert all(held.get(timeout=60))
    finally:
        child.kill()
        child.join(timeout=10)
    assert child.exitcode is not None and child.exitcode < 0
    limits = politeness.RedisHostLimits(REDIS_URL, 2, 0.0, prefix=prefix)
    pool = make_pool(2)
    # held by the dead process until its deadline (1 s after it took them) plus the grace (0.5 s)
    began = time.monotonic()
    got = [limits.acquire("h:80", time.monotonic() + 30, pool) for _ in range(2)]
    assert all(got) and len(set(got)) == 2
    assert time.monotonic() - began < 20
    assert limits.acquire("h:80", time.monotonic() + 0.1, pool) is None  # and now they are ours
    for slot in got:
        limits.release("h:80", slot)


def test_slots_are_released_waited_for_until_the_deadline_and_abort(prefix):
    import redis

    limits = politeness.RedisHostLimits(REDIS_URL, 1, 0.0, prefix=prefix)
    pool = make_pool(2)
    held = limits.acquire("h:80", time.monotonic() + 5, pool)
    assert held
    ttl = redis.Redis.from_url(REDIS_URL).pttl(prefix + "h:80:slots")
    assert 0 < ttl <= (5 + politeness.LEASE_GRACE) * 1000  # the key lapses too: a host nobody asks leaves none
    began = time.monotonic()
    assert limits.acquire("h:80", time.monotonic() + 0.2, pool) is None
    assert 0.15 < time.monotonic() - began < 5
    threading.Timer(0.1, pool.abort).start()
    with pytest.raises(DownloadsAborted):
        limits.acquire("h:80", time.monotonic() + 5, pool)
    limits.release("h:80", held)
    pool = make_pool(2)
    again = limits.acquire("h:80", time.monotonic() + 1, pool)
    assert again and again != held  # the slot was given back
    limits.release("h:80", again)
    assert limits.acquire("other:80", time.monotonic() + 1, pool)  # hosts are limited apart


def test_slots_go_in_turn_a_busy_machine_cannot_keep_them_from_another(prefix):
    import redis

    # two instances: two machines' limits on one host, one slot. The busy one's 4 threads give the slot
    # back and ask again at once; the other's single request must get it within a turn or two, where
    # (before the line) its polls every 50 ms only ever found the slot taken again
    busy, other = (politeness.RedisHostLimits(REDIS_URL, 1, 0.0, prefix=prefix) for _ in range(2))
    pool, stop, turns = make_pool(2), threading.Event(), []

    def hammer() -> None:
        while not stop.is_set():
            slot = busy.acquire("h:80", time.monotonic() + 30, pool)
            time.sleep(0.02)
            busy.release("h:80", slot)
            turns.append(time.monotonic())

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        waits = []
        for _ in range(10):
            began = time.monotonic()
            slot = other.acquire("h:80", began + 3.0, pool)
            assert slot, f"no slot in 3 s while the busy machine took {len(turns)} turns"
            waits.append(time.monotonic() - began)
            other.release("h:80", slot)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=35)
    # ahead of it at most the holder and the busy machine's 3 other waiters (20 ms each), plus polls
    assert max(waits) < 1.0, waits
    assert len(turns) > 20  # the busy machine did keep the slot busy meanwhile
    # a waiter that gives up at its deadline leaves the line at once, not when its place lapses
    held = other.acquire("h:80", time.monotonic() + 5, pool)
    assert held and busy.acquire("h:80", time.monotonic() + 0.1, pool) is None
    assert redis.Redis.from_url(REDIS_URL).zcard(prefix + "h:80:line") == 0
    other.release("h:80", held)


def test_the_line_keeps_its_order_and_a_waiter_that_stops_asking_loses_its_place(prefix):
    # the slot script asked directly, as waiters of any machine would: 0 is "taken", else the place in line
    limits = politeness.RedisHostLimits(REDIS_URL, 1, 0.0, prefix=prefix)
    keys = [prefix + "h:80:" + name for name in ("slots", "line", "waiting")]

    def ask(who: str, lapse: float = 30.0) -> int:
        return limits._run(limits._take, keys, 1, who, "30", f"{lapse}")

    assert ask("holder") == 0
    assert (ask("first"), ask("second")) == (1, 2)
    limits.release("h:80", "holder")
    assert ask("second") == 2  # the slot given back is the first waiter's: the second cannot jump it
    assert ask("first") == 0
    limits.release("h:80", "first")
    assert ask("second") == 0
    limits.release("h:80", "second")
    # a waiter that stops asking (a dead one) holds its place only for its lapse
    assert ask("holder") == 0
    assert (ask("gone", lapse=1.0), ask("next")) == (1, 2)
    limits.release("h:80", "holder")
    assert ask("next") == 2
    time.sleep(1.5)
    assert ask("next") == 0


def test_a_rate_wait_past_the_deadline_fails_fast_through_redis(tmp_path, prefix, serve):
    server = serve()
    # one request per second, deadline 3 x 0.3 s: the first row's turn is now, the others' past it
    cfg = config_from_dict(_fields(tmp_path, per_host_requests_per_second=1.0, timeout=0.3, thread_count=4))
    began = time.monotonic()
    report = write_image_shard(pa.table({"url": server.urls(4)}), 0, cfg, Layout(cfg.output_root))
    assert time.monotonic() - began < 5
    assert report.status_dict == {"success": 1, politeness.RATE_LIMITED: 3}
    assert len(server.starts) == 1
    assert isinstance(politeness.shared(None, 64, 1.0, REDIS_URL), politeness.RedisHostLimits)


def test_an_unreachable_redis_fails_loudly_and_the_url_is_checked(tmp_path):
    limits = politeness.RedisHostLimits("redis://user:hunter2@127.0.0.1:1/0", 2, 1.0)
    with pytest.raises(politeness.PolitenessError, match="Redis at redis://127.0.0.1:1/0") as err:
        limits.acquire("h:80", time.monotonic() + 1, make_pool(2))
    assert "hunter2" not in str(err.value)
    # a shard fails rather than download without the limits
    cfg = config_from_dict(_fields(tmp_path, per_host_limits_url="redis://127.0.0.1:1/0"))
    with pytest.raises(politeness.PolitenessError):
        write_image_shard(pa.table({"url": ["http://127.0.0.1:1/a.jpg"]}), 0, cfg, Layout(cfg.output_root))
    cfg = config_from_dict(_fields(tmp_path, per_host_limits_url="redis://:secret@127.0.0.1:6379/0"))
    assert "secret" not in repr(cfg) and "per_host_limits_url" not in repr(cfg)
    assert config_from_dict(_fields(tmp_path, per_host_limits_url=None)).per_host_limits_url is None
