"""A hostile site (issue 23's "done when"): it has a robots.txt, answers some images with 429 + Retry-After
first, and punishes a client that goes faster than its rate limit or opens too many connections with more
429s. One image shard is crawled from it within every limit, and every row is accounted for."""

import http.server
import io
import threading
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep import robots
from shardprep.config import config_from_dict
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from shardprep.tars import sample_keys
from tests.fixtures import synthetic

RATE = 8.0  # requests per second the client is configured for
SITE_RATE = 2 * RATE  # what the site punishes: more than this many requests in any one second
CONNECTIONS = 3


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "HostileSite"

    def log_message(self, format, *args):  # noqa: A002 - quiet server
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        site, path, now = self.server, self.path, time.monotonic()
        with site.lock:
            site.hits[path] += 1
            site.starts.append(now)
            site.in_flight += 1
            site.most = max(site.most, site.in_flight)
            recent = sum(1 for t in site.starts if now - t < 1.0)
            punished = path != "/robots.txt" and (recent > SITE_RATE or site.in_flight > CONNECTIONS)
            site.punished += punished
            first_flaky = path.startswith("/flaky/") and site.hits[path] == 1
        time.sleep(0.02)
        with site.lock:
            site.in_flight -= 1
        if path == "/robots.txt":
            self._answer(200, b"User-agent: *\nDisallow: /private/\n", "text/plain")
        elif punished or first_flaky:
            self._answer(429, b"slow down", "text/plain", {"Retry-After": "1"})
        else:
            self._answer(200, site.image, "image/jpeg")

    def _answer(self, status: int, body: bytes, kind: str, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": kind, **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class HostileSite(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        buf = io.BytesIO()
        synthetic.render_image(3, 48, 32).save(buf, "JPEG")
        self.image = buf.getvalue()
        self.lock = threading.Lock()
        self.hits: Counter = Counter()
        self.starts: list[float] = []
        self.in_flight = self.most = self.punished = 0
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_port}{path}"


@pytest.fixture
def site():
    robots.forget_all()
    s = HostileSite()
    yield s
    s.shutdown()
    s.server_close()
    robots.forget_all()


def test_a_hostile_site_is_crawled_within_its_limits_and_every_row_is_accounted(site, tmp_path):
    paths = [f"/ok/{i}.jpg" for i in range(16)] + [f"/flaky/{i}.jpg" for i in range(4)] + \
            [f"/private/{i}.jpg" for i in range(4)]
    order = [paths[(i * 7) % len(paths)] for i in range(len(paths))]  # kinds interleaved
    cfg = config_from_dict({
        "source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url", "caption_col": None,
        "samples_per_shard": 64, "image_size": 16, "timeout": 10, "thread_count": 16, "allow_private_addresses": True,
        "extract_exif": False, "per_host_state_dir": str(tmp_path / "limits"), "respect_robots_txt": True,
        "per_host_connections": CONNECTIONS, "per_host_requests_per_second": RATE})
    layout = Layout(cfg.output_root)
    report = write_image_shard(pa.table({"url": [site.url(p) for p in order]}), 0, cfg, layout)

    # within the site's limits: never punished, never more connections than allowed, robots.txt once
    assert site.punished == 0 and site.most <= CONNECTIONS
    assert site.hits["/robots.txt"] == 1
    assert not any(site.hits[p] for p in paths if p.startswith("/private/"))  # disallowed: never requested
    assert all(site.hits[p] == 2 for p in paths if p.startswith("/flaky/"))  # the 429, then after Retry-After
    assert all(site.hits[p] == 1 for p in paths if p.startswith("/ok/"))
    # the rate held: any k consecutive image requests span at least (k - 1 - burst) / rate, the burst being
    # one second's worth (shardprep.politeness)
    starts = sorted(site.starts)[1:]  # robots.txt's fetch is not rate limited
    for k in (int(RATE) + 4, len(starts)):
        for i in range(len(starts) - k + 1):
            assert starts[i + k - 1] - starts[i] >= (k - 1 - RATE) / RATE - 0.2, (k, i)

    # every row accounted: a status per input row, the tar holding exactly the successes
    rows = pq.read_table(layout.shard_parquet("00000")).to_pylist()
    assert len(rows) == len(order) == report.count
    outcome = {row["url"].split(str(site.server_port))[1]: (row["status"], row["error_message"]) for row in rows}
    assert {p: outcome[p] for p in paths if not p.startswith("/private/")} == dict.fromkeys(
        [p for p in paths if not p.startswith("/private/")], ("success", None))
    assert {outcome[p] for p in paths if p.startswith("/private/")} == {("failed_to_download", "robots.txt disallows")}
    assert report.successes == 20 and report.failed_to_download == 4
    assert sample_keys(layout.tar("00000")) == [r["key"] for r in rows if r["status"] == "success"]


@pytest.mark.parametrize("directives, refused", [
    (None, {"/noai.jpg", "/ours.jpg"}),  # img2dataset's default list, for everyone or for our product token
    ([], set()),  # no header check
    (["NoFollow"], {"/nofollow.jpg"}),
])
def test_x_robots_tag_directives_are_configurable(scripted_server, tmp_path, directives, refused):
    from tests.fixtures.scripted_http import Reply

    buf = io.BytesIO()
    synthetic.render_image(1, 32, 24).save(buf, "JPEG")
    headers = {"/noai.jpg": "noai", "/ours.jpg": "shardprep: noai, noindex", "/theirs.jpg": "otherbot: noai",
               "/nofollow.jpg": "nofollow", "/plain.jpg": None}
    for path, value in headers.items():
        scripted_server.script(path, Reply(200, buf.getvalue(), {"X-Robots-Tag": value} if value else {}))
    fields = {"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url",
              "caption_col": None, "image_size": 16, "allow_private_addresses": True, "respect_robots_txt": False,
              "extract_exif": False, "per_host_state_dir": str(tmp_path / "limits")}
    if directives is not None:
        fields["disallowed_header_directives"] = directives
    cfg = config_from_dict(fields)
    layout = Layout(cfg.output_root)
    write_image_shard(pa.table({"url": [scripted_server.url(p) for p in headers]}), 0, cfg, layout)
    rows = pq.read_table(layout.shard_parquet("00000")).to_pylist()
    got = {p for p, r in zip(headers, rows) if r["error_message"] == "Use of image disallowed by X-Robots-Tag directive"}
    assert got == refused
    assert all(r["status"] == "success" for p, r in zip(headers, rows) if p not in refused)
