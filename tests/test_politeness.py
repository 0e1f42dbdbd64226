"""Per-host politeness in the image download engine, against real HTTP servers on 127.0.0.1 that record
when each request arrived and how many were in flight: a rate per host, connections per host within one
process and across two, a wait past the deadline failing fast, and defaults that leave one host alone."""

import io
import multiprocessing
import threading
import time

import pyarrow as pa
import pytest

from shardprep import politeness
from shardprep.config import ConfigError, config_from_dict
from shardprep.failures import classify
from shardprep.fetch import DownloadsAborted, make_pool
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from tests.fixtures import synthetic
from tests.fixtures.watched_http import WatchedServer


def _jpeg() -> bytes:
    buf = io.BytesIO()
    synthetic.render_image(0, 32, 24).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def serve():
    servers = []

    def start(delay: float = 0.0) -> WatchedServer:
        servers.append(WatchedServer(_jpeg(), delay))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _cfg(tmp_path, name: str = "out", **fields):
    return config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / name), "url_col": "url",
                             "caption_col": None, "samples_per_shard": 64, "image_size": 16, "timeout": 5,
                             "thread_count": 8, "allow_private_addresses": True, "respect_robots_txt": False,
                             "extract_exif": False, "per_host_state_dir": str(tmp_path / "limits"), **fields})


def _write(cfg, urls, shard_id: int = 0):
    return write_image_shard(pa.table({"url": urls}), shard_id, cfg, Layout(cfg.output_root))


def test_a_rate_per_host_holds_across_threads_with_one_burst(tmp_path, serve):
    server = serve()
    began = time.monotonic()
    report = _write(_cfg(tmp_path, per_host_requests_per_second=5.0), server.urls(20))
    assert report.successes == 20 and report.status_dict == {"success": 20}
    starts = sorted(server.starts)
    assert len(starts) == 20
    # a burst of one second's worth (5), then one every 0.2 s: any 1 s window holds at most 5 + 5
    assert max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts) <= 10
    # after the burst, starts are spaced by the rate (a little scheduling slack)
    gaps = [b - a for a, b in zip(starts[5:], starts[6:])]
    assert min(gaps) > 0.15, gaps
    assert time.monotonic() - began >= 15 / 5 - 0.3


def test_b_connections_per_host_within_one_process(tmp_path, serve):
    server = serve(delay=0.15)
    report = _write(_cfg(tmp_path, per_host_connections=2), server.urls(10))
    assert report.successes == 10
    assert server.most == 2  # never more, and the limit was reached


def _download_shard(cfg_fields: dict, urls: list[str], shard_id: int) -> int:
    cfg = config_from_dict(cfg_fields)
    return write_image_shard(pa.table({"url": urls}), shard_id, cfg, Layout(cfg.output_root)).successes


def test_c_connections_per_host_across_processes(tmp_path, serve):
    server = serve(delay=0.15)
    fields = {"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url",
              "caption_col": None, "samples_per_shard": 64, "image_size": 16, "timeout": 10, "thread_count": 4,
              "allow_private_addresses": True, "respect_robots_txt": False, "extract_exif": False,
              "per_host_connections": 2, "per_host_state_dir": str(tmp_path / "limits")}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as procs:
        results = [procs.apply_async(_download_shard, (fields, server.urls(8), shard)) for shard in (0, 1)]
        assert [r.get(timeout=60) for r in results] == [8, 8]
    assert len(server.starts) == 16
    assert server.most == 2  # each process alone would allow 2: together they did not pass 2


def test_d_a_wait_past_the_deadline_fails_fast_as_rate_limited(tmp_path, serve):
    server = serve()
    # one request per second, deadline 3 x 0.1 s: the first row's turn is now, the others' past it
    cfg = _cfg(tmp_path, per_host_requests_per_second=1.0, timeout=0.1, thread_count=4)
    began = time.monotonic()
    report = _write(cfg, server.urls(4))
    assert time.monotonic() - began < 1.0
    assert report.successes == 1
    assert report.status_dict == {"success": 1, politeness.RATE_LIMITED: 3}
    assert len(server.starts) == 1  # the waits asked nothing of the server
    assert classify(politeness.RATE_LIMITED) == "transient"


def test_d_a_slot_wait_ends_at_the_deadline_and_on_abort(tmp_path):
    limits = politeness.HostLimits(str(tmp_path / "limits"), 1, 0.0)
    pool = make_pool(2)
    held = limits.acquire("h:80", time.monotonic() + 5, pool)
    assert held == 0
    began = time.monotonic()
    assert limits.acquire("h:80", time.monotonic() + 0.2, pool) is None
    assert 0.15 < time.monotonic() - began < 1.0
    threading.Timer(0.1, pool.abort).start()
    with pytest.raises(DownloadsAborted):
        limits.acquire("h:80", time.monotonic() + 5, pool)
    limits.release("h:80", held)
    assert limits.acquire("h:80", time.monotonic() + 1, make_pool(2)) == 0  # the slot was given back


def test_e_defaults_leave_one_host_thread_count_concurrency(tmp_path, serve):
    server = serve(delay=0.3)
    cfg = _cfg(tmp_path)
    assert (cfg.per_host_connections, cfg.per_host_requests_per_second) == (64, 0.0)
    assert cfg.per_host_connections >= cfg.thread_count
    report = _write(cfg, server.urls(16))
    assert report.successes == 16
    assert server.most == cfg.thread_count


def test_limits_are_validated(tmp_path):
    for fields in ({"per_host_connections": -1}, {"per_host_requests_per_second": -0.5},
                   {"per_host_requests_per_second": float("inf")}, {"per_host_state_dir": ""}):
        with pytest.raises(ConfigError):
            _cfg(tmp_path, **fields)
    assert _cfg(tmp_path, per_host_connections=0, per_host_requests_per_second=0.5).per_host_connections == 0


def _take_two(folder: str) -> list:
    limits = politeness.shared(folder, 2, 0.0)
    pool = make_pool(2)
    return [limits.acquire("h:80", time.monotonic() + 0.5, pool) for _ in range(2)]


def test_a_forked_child_does_not_inherit_slots_its_parent_held(tmp_path):
    folder = str(tmp_path / "limits")
    limits = politeness.shared(folder, 2, 0.0)
    held = limits.acquire("h:80", time.monotonic() + 1, make_pool(2))
    with multiprocessing.get_context("fork").Pool(1) as procs:
        child = procs.apply_async(_take_two, (folder,))
        time.sleep(0.1)
        limits.release("h:80", held)  # the parent's slot comes free while the child waits for its second
        assert sorted(child.get(timeout=10)) == [0, 1]
