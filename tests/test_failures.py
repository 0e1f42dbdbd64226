"""Failure reasons sorted into transient and permanent, on the exact reasons the engine writes: each one is
produced here by a real download from a server on 127.0.0.1 (or the real resizer), not typed in, except
the resolver's messages, which need a DNS answer this machine may not give."""

import io
import socket

import pytest

from shardprep import robots
from shardprep.failures import classify
from shardprep.fetch import fetch, make_pool
from shardprep.images.resize import resize_image
from tests.fixtures import synthetic
from tests.fixtures.scripted_http import Reply

TRANSIENT_STATUSES = [408, 425, 429, 500, 502, 503, 504]
PERMANENT_STATUSES = [400, 401, 403, 404, 410, 451]


@pytest.fixture
def server(scripted_server):
    return scripted_server


def _fetch(url: str, **kw) -> str:
    got = fetch(url, pool=make_pool(2), **{"timeout": 1, "allow_private": True, **kw})
    assert got.data is None
    return got.error


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _jpeg() -> bytes:
    buf = io.BytesIO()
    synthetic.render_image(0, 64, 48).save(buf, "JPEG")
    return buf.getvalue()


def test_http_statuses(server):
    for status in TRANSIENT_STATUSES + PERMANENT_STATUSES:
        server.script(f"/{status}", Reply(status, b"no"))
    reasons = {status: _fetch(server.url(f"/{status}")) for status in TRANSIENT_STATUSES + PERMANENT_STATUSES}
    assert reasons[404] == "HTTP Error 404: Not Found" and reasons[451] == "HTTP Error 451: Unavailable For Legal Reasons"
    assert {s: classify(r) for s, r in reasons.items()} == {
        **{s: "transient" for s in TRANSIENT_STATUSES}, **{s: "permanent" for s in PERMANENT_STATUSES}}


def test_transport_failures(server):
    server.script("/slow", Reply(200, b"late", delay=3))
    server.script("/hang-up", Reply(hang_up=True))
    server.script("/limited", Reply(429, b"", {"Retry-After": "3600"}))
    reasons = {
        "timed out": _fetch(server.url("/slow"), timeout=0.3),
        "refused": _fetch(f"http://127.0.0.1:{_closed_port()}/x.jpg"),
        "hung up": _fetch(server.url("/hang-up")),
        "rate limited": _fetch(server.url("/limited")),
    }
    assert reasons["timed out"] == "timed out"
    assert reasons["refused"] == "<urlopen error [Errno 111] Connection refused>"
    assert reasons["hung up"].startswith("connection broken: RemoteDisconnected(")
    assert reasons["rate limited"] == "rate limited (HTTP 429, Retry-After 3600 s)"
    assert {k: classify(r) for k, r in reasons.items()} == dict.fromkeys(reasons, "transient")
    # the resolver's words (socket.gaierror as fetch writes it): "try again" is transient, "no such host" is not
    assert classify("<urlopen error [Errno -3] Temporary failure in name resolution>") == "transient"
    assert classify("<urlopen error [Errno -2] Name or service not known>") == "permanent"
    assert classify("connection broken: ConnectionResetError(104, 'Connection reset by peer')") == "transient"
    assert classify("connection broken: BadStatusLine('SSH-2.0-OpenSSH_9.6')") == "permanent"


def test_refusals_and_bad_content(server):
    server.script("/big.jpg", Reply(200, b"x" * 1000))
    server.script("/noai.jpg", Reply(200, _jpeg(), {"X-Robots-Tag": "noai"}))
    server.script("/robots.txt", Reply(200, b"User-agent: *\nDisallow: /private/\n"))
    pool = make_pool(2)
    reasons = {
        "too large": _fetch(server.url("/big.jpg"), max_bytes=100),
        "x-robots-tag": _fetch(server.url("/noai.jpg")),
        "guard": _fetch(server.url("/big.jpg"), allow_private=False),
        "scheme": _fetch("file:///etc/passwd"),
        "invalid": fetch(None, pool=pool).error,
        "robots.txt": robots.shared(allow_private=True).refusal(server.url("/private/a.jpg"), pool=pool,
                                                                token="shardprep", timeout=1),
        "not an image": resize_image(b"<html>no</html>").error,
        "truncated": resize_image(_jpeg()[:200]).error,
        "bomb": resize_image(synthetic.bomb_png()).error,
        "takedown": "taken down (takedown list)",
        "unknown": "something new",
    }
    assert reasons["x-robots-tag"] == "Use of image disallowed by X-Robots-Tag directive"
    assert reasons["robots.txt"] == "robots.txt disallows"
    assert reasons["guard"].startswith("refused: host resolves to a loopback address")
    assert reasons["not an image"] == "Image decoding error"
    assert {k: classify(r) for k, r in reasons.items()} == dict.fromkeys(reasons, "permanent")
