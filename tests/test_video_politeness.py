"""robots.txt and the per-host limits in the video download engine (shardprep.video.shards), the same
wrappers as the images' (shardprep.politeness.polite_downloader), against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep import politeness, robots
from shardprep.config import config_from_dict
from shardprep.video.shards import video_shard_files, write_video_shard
from tests.fixtures import videos
from tests.fixtures.scripted_http import Reply
from tests.fixtures.watched_http import WatchedServer


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return videos.encode("mp4", "libx264", n_frames=12, options={"preset": "ultrafast"})


@pytest.fixture
def watched(mp4):
    servers = []

    def start(delay: float = 0.0) -> WatchedServer:
        servers.append(WatchedServer(mp4, delay, content_type="video/mp4"))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _cfg(tmp_path, **fields):
    return config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"),
                             "video_url_col": "url", "video_caption_col": None, "samples_per_shard": 64,
                             "timeout": 5, "video_thread_count": 4, "video_decode_threads": 1,
                             "allow_private_addresses": True, "max_video_bytes": 1_000_000,
                             "per_host_state_dir": str(tmp_path / "limits"), **fields})


def _write(cfg, urls: list[str], out: str):
    return write_video_shard(pa.table({"url": urls}), 0, cfg, out)


def test_robots_txt_disallows_a_video_path_and_only_that_row_fails(tmp_path, scripted_server, mp4):
    server = scripted_server
    server.script("/robots.txt", Reply(200, b"User-agent: *\nDisallow: /private/\n", {"Content-Type": "text/plain"}))
    for path in ("/a.mp4", "/b.mp4", "/private/c.mp4"):
        server.script(path, Reply(200, mp4, {"Content-Type": "video/mp4"}))
    urls = [server.url(p) for p in ("/a.mp4", "/private/c.mp4", "/b.mp4")]

    report = _write(_cfg(tmp_path), urls, str(tmp_path / "robots"))
    assert report.successes == 2
    assert report.status_dict == {"success": 2, robots.DISALLOWED: 1}
    rows = pq.read_table(video_shard_files(str(tmp_path / "robots"), "00000")[1]).to_pylist()
    assert [(r["status"], r["error_message"]) for r in rows] == [
        ("success", None), ("failed_to_download", robots.DISALLOWED), ("success", None)]
    assert server.hits("/private/c.mp4") == 0  # never asked
    assert server.hits("/robots.txt") == 1  # once for the site, before its videos

    # respect_robots_txt: false asks it all
    report = _write(_cfg(tmp_path, respect_robots_txt=False), urls, str(tmp_path / "ignored"))
    assert report.successes == 3 and server.hits("/private/c.mp4") == 1


def test_one_connection_per_host_for_videos(tmp_path, watched):
    server = watched(delay=0.15)
    cfg = _cfg(tmp_path, per_host_connections=1, respect_robots_txt=False)
    report = _write(cfg, server.urls(6), str(tmp_path / "one"))
    assert report.successes == 6
    assert len(server.starts) == 6 and server.most == 1  # 4 download threads, never 2 requests at once


def test_a_video_rate_wait_past_its_deadline_is_rate_limited(tmp_path, watched):
    server = watched()
    # one request per second; the video's deadline: 3 x 0.2 s + 0.2 MB at 2 MB/s = 0.7 s
    cfg = _cfg(tmp_path, per_host_requests_per_second=1.0, timeout=0.2, max_video_bytes=200_000,
               respect_robots_txt=False)
    report = _write(cfg, server.urls(3), str(tmp_path / "rate"))
    assert report.status_dict == {"success": 1, politeness.RATE_LIMITED: 2}
    assert report.failed_to_download == 2 and len(server.starts) == 1
