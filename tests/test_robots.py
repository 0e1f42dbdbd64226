"""robots.txt (RFC 9309) and Retry-After in the download engine, against real HTTP servers on 127.0.0.1:
our group or ``*``, longest match, allow on ties, wildcards; 4xx allows and 5xx/unreachable disallows;
one robots.txt request per site for a shard's many threads; 429/503 waited out within the deadline."""

import email.utils
import io
import threading
import time
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep import robots
from shardprep.config import config_from_dict
from shardprep.failures import classify
from shardprep.fetch import RATE_LIMIT_WAITS, DownloadsAborted, fetch, make_pool, retry_after_seconds
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from tests.fixtures import synthetic
from tests.fixtures.scripted_http import Reply, ScriptedServer

# ours ("shardprep", matched without case) is named, so the "*" group's "Disallow: /" is not ours
RULES = b"""User-agent: *
Disallow: /

User-agent: otherbot
Allow: /

User-agent: ShardPrep
Disallow: /private/
Allow: /private/open
Disallow: /*.gif$
Disallow: /tmp*/secret
Allow: /tie
Disallow: /tie
"""


@pytest.fixture
def server(scripted_server):
    return scripted_server


def _jpeg(i: int = 0) -> bytes:
    buf = io.BytesIO()
    synthetic.render_image(i, 64, 48).save(buf, "JPEG")
    return buf.getvalue()


def _refusal(server: ScriptedServer, path: str, token: str = "shardprep", timeout: float = 2,
             policies: robots.RobotsPolicies | None = None) -> str | None:
    policies = policies or robots.shared(allow_private=True)
    return policies.refusal(server.url(path), pool=make_pool(2), token=token, timeout=timeout)


def test_our_group_wins_the_longest_match_decides_allow_on_ties_and_wildcards(server):
    server.script("/robots.txt", Reply(200, RULES, {"Content-Type": "text/plain"}))
    expected = {
        "/a.jpg": None,  # our group has no rule for it
        "/private/x.jpg": robots.DISALLOWED,
        "/private/open/x.jpg": None,  # the longer allow wins
        "/PRIVATE/x.jpg": None,  # paths match with case
        "/a.gif": robots.DISALLOWED,
        "/a.gifx": None,  # "$": the path ends there
        "/tmp42/secret.jpg": robots.DISALLOWED,  # "*" inside a path
        "/tmp42/public.jpg": None,
        "/tie": None,  # allow and disallow of the same length: allow
    }
    assert {path: _refusal(server, path) for path in expected} == expected
    assert _refusal(server, "/a.jpg", token="somebot") == robots.DISALLOWED  # unnamed: the "*" group
    assert _refusal(server, "/private/x.jpg", token="otherbot") is None
    assert server.hits("/robots.txt") == 1  # one fetch for every question about this site


def test_product_token():
    assert robots.product_token("shardprep/0.1 (+https://github.com/shardprep)") == "shardprep"
    assert robots.product_token("Mozilla/5.0 (compatible; x)") == "Mozilla"
    assert robots.product_token("/0.1") == "shardprep"  # no token: ours


@pytest.mark.parametrize("status", [404, 401, 403, 410])
def test_a_robots_txt_answered_4xx_allows_everything(server, status):
    server.script("/robots.txt", Reply(status, b"User-agent: *\nDisallow: /\n"))  # an error page's body: no rules
    assert _refusal(server, "/private/x.jpg") is None
    assert _refusal(server, "/a.gif") is None
    assert server.hits("/robots.txt") == 1


@pytest.mark.parametrize("status, reason", [(500, "Internal Server Error"), (503, "Service Unavailable"),
                                            (429, "Too Many Requests")])
def test_a_robots_txt_answered_5xx_disallows_everything_and_fetches_nothing(server, status, reason):
    server.script("/robots.txt", Reply(status, b"User-agent: *\nAllow: /\n"))
    server.script("/a.jpg", Reply(200, _jpeg()))
    pool = make_pool(2)
    got = robots.download_allowed(server.url("/a.jpg"), download=partial(fetch, pool=pool, timeout=2, allow_private=True),
                                  policies=robots.shared(allow_private=True), pool=pool, token="shardprep", timeout=2)
    assert got == (None, f"robots.txt unreachable (HTTP Error {status}: {reason})")
    assert server.hits("/a.jpg") == 0
    assert classify(got.error) == "transient"  # the site may answer later, unlike a disallowed path


def test_an_unreachable_robots_txt_disallows_with_the_connections_failure(server):
    server.script("/robots.txt", Reply(200, RULES, delay=3))
    assert _refusal(server, "/a.jpg", timeout=0.5) == "timed out"
    assert _refusal(server, "/b.jpg", timeout=0.5) == "timed out"  # kept: not a timeout per URL
    assert server.hits("/robots.txt") == 1
    server.stop()  # nothing listens there now: refused
    refused = _refusal(server, "/a.jpg", policies=robots.RobotsPolicies(allow_private=True))
    assert refused == "<urlopen error [Errno 111] Connection refused>"  # what the image's fetch would meet
    assert classify(refused) == "transient"


def test_redirects_are_followed_and_a_loop_allows_everything(server):
    server.script("/robots.txt", Reply(301, headers={"Location": "/moved"}))
    server.script("/moved", Reply(302, headers={"Location": "/rules.txt"}))
    server.script("/rules.txt", Reply(200, RULES))
    assert _refusal(server, "/private/x.jpg") == robots.DISALLOWED
    other = ScriptedServer()
    try:
        other.script("/robots.txt", Reply(302, headers={"Location": "/robots.txt"}))  # more than 5 redirects
        assert _refusal(other, "/private/x.jpg") is None
        assert other.hits("/robots.txt") == 6
    finally:
        other.stop()


def test_the_guard_applies_to_robots_txt_and_a_refused_one_leaves_the_refusal_to_fetch(server):
    server.script("/robots.txt", Reply(200, RULES))
    guarded = robots.shared(allow_private=False)
    assert _refusal(server, "/private/x.jpg", policies=guarded) is None  # fetch will refuse the address itself
    assert server.hits() == 0
    assert _refusal(server, "/private/x.jpg") == robots.DISALLOWED  # allowed to reach it: its rules apply


def _shard_cfg(tmp_path, name: str, **fields):
    return config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / name), "url_col": "url",
                             "caption_col": "caption", "samples_per_shard": 64, "image_size": 32, "timeout": 5,
                             "retries": 0, "thread_count": 8, "allow_private_addresses": True, **fields})


def test_a_shard_asks_robots_txt_once_and_records_the_disallowed_rows(server, tmp_path):
    # slow, so the shard's 8 threads all ask while the first one fetches it
    server.script("/robots.txt", Reply(200, RULES, delay=0.5))
    urls = []
    for i in range(32):
        path = f"/private/{i}.jpg" if i % 4 == 3 else f"/img/{i}.jpg"
        server.script(path, Reply(200, _jpeg(i), {"Content-Type": "image/jpeg"}))
        urls.append(server.url(path))
    table = pa.table({"url": urls, "caption": [f"c {i}" for i in range(len(urls))]})

    cfg = _shard_cfg(tmp_path, "out")
    layout = Layout(cfg.output_root)
    report = write_image_shard(table, 0, cfg, layout)
    rows = pq.read_table(layout.shard_parquet("00000")).to_pylist()
    for url, row in zip(urls, rows):
        if "/private/" in url:
            assert (row["status"], row["error_message"]) == ("failed_to_download", "robots.txt disallows"), url
        else:
            assert (row["status"], row["error_message"]) == ("success", None), url
    assert report.status_dict == {"success": 24, "robots.txt disallows": 8}
    assert server.hits("/robots.txt") == 1
    assert sum(server.hits(f"/private/{i}.jpg") for i in range(32)) == 0  # never requested

    write_image_shard(table, 1, cfg, layout)  # another shard of the process: no new fetch
    assert server.hits("/robots.txt") == 1

    off = _shard_cfg(tmp_path, "off", respect_robots_txt=False)
    assert write_image_shard(table, 0, off, Layout(off.output_root)).successes == 32
    assert server.hits("/robots.txt") == 1


# ---------------------------------------------------------------------------------------------- Retry-After


def test_a_429_is_waited_out_as_retry_after_says(server):
    image = _jpeg()
    server.script("/a.jpg", Reply(429, b"slow down", {"Retry-After": "1"}), Reply(200, image))
    start = time.monotonic()
    got = fetch(server.url("/a.jpg"), pool=make_pool(2), timeout=2, allow_private=True)
    assert got == (image, None)
    assert 0.9 < time.monotonic() - start < 3
    assert server.hits("/a.jpg") == 2


def test_a_retry_after_past_the_deadline_fails_at_once(server):
    server.script("/a.jpg", Reply(429, b"", {"Retry-After": "3600"}))
    start = time.monotonic()
    got = fetch(server.url("/a.jpg"), pool=make_pool(2), timeout=2, allow_private=True)
    assert got == (None, "rate limited (HTTP 429, Retry-After 3600 s)")
    assert time.monotonic() - start < 1
    assert server.hits("/a.jpg") == 1
    assert classify(got.error) == "transient"


def test_a_retry_after_http_date(server):
    image = _jpeg()
    soon = email.utils.formatdate(time.time() + 2, usegmt=True)  # whole seconds: 1 to 2 s from now
    server.script("/a.jpg", Reply(503, b"", {"Retry-After": soon}), Reply(200, image))
    start = time.monotonic()
    assert fetch(server.url("/a.jpg"), pool=make_pool(2), timeout=2, allow_private=True) == (image, None)
    assert 0.5 < time.monotonic() - start < 4
    later = email.utils.formatdate(time.time() + 7200, usegmt=True)
    server.script("/b.jpg", Reply(503, b"", {"Retry-After": later}))
    got = fetch(server.url("/b.jpg"), pool=make_pool(2), timeout=2, allow_private=True)
    assert got.error in ("rate limited (HTTP 503, Retry-After 7199 s)", "rate limited (HTTP 503, Retry-After 7200 s)")


def test_rate_limit_waits_are_bounded_and_no_retry_after_is_a_plain_failure(server):
    server.script("/a.jpg", Reply(429, b"", {"Retry-After": "0"}))
    got = fetch(server.url("/a.jpg"), pool=make_pool(2), timeout=2, allow_private=True)
    assert got == (None, "rate limited (HTTP 429, Retry-After 0 s)")
    assert server.hits("/a.jpg") == RATE_LIMIT_WAITS + 1
    server.script("/b.jpg", Reply(429, b""))
    got = fetch(server.url("/b.jpg"), pool=make_pool(2), timeout=2, retries=1, allow_private=True)
    assert got == (None, "HTTP Error 429: Too Many Requests")
    assert server.hits("/b.jpg") == 2  # retries, as before
    server.script("/c.jpg", Reply(404, b"", {"Retry-After": "1"}))  # only 429 and 503 ask to wait
    assert fetch(server.url("/c.jpg"), pool=make_pool(2), timeout=2, allow_private=True).error == \
        "HTTP Error 404: Not Found"
    assert server.hits("/c.jpg") == 1


def test_an_abort_ends_a_retry_after_wait(server):
    server.script("/a.jpg", Reply(429, b"", {"Retry-After": "5"}))
    pool = make_pool(2)
    timer = threading.Timer(0.5, pool.abort)
    timer.start()
    start = time.monotonic()
    with pytest.raises(DownloadsAborted):
        fetch(server.url("/a.jpg"), pool=pool, timeout=5, allow_private=True)
    assert time.monotonic() - start < 2
    timer.join()


def test_retry_after_values():
    assert retry_after_seconds("120") == 120
    assert retry_after_seconds(" 0 ") == 0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("-5") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0  # past: ask again now
    assert 98 < retry_after_seconds(email.utils.formatdate(time.time() + 100, usegmt=True)) <= 100
