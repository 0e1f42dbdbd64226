"""fetch's own HTTP transport: HTTPS to the checked address with the host name for SNI and the
certificate, kept-alive connections the server closed meanwhile replaced, and nothing reused after a
body left unread."""

from __future__ import annotations

import http.server
import os
import ssl
import subprocess
import threading
import time

import pytest

from shardprep.fetch import fetch, make_pool

BODY = os.urandom(200_000)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 0.3  # idle kept-alive connections are closed after this long

    def log_message(self, format, *args):  # noqa: A002
        pass

    def finish(self):
        super().finish()
        self.server.closed.set()  # the connection is closed (idle past ``timeout``, or the client left)

    def do_GET(self):  # noqa: N802
        if self.path == "/error":
            self.send_response(500)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    accepted = 0

    def handle_error(self, request, client_address):
        pass  # the refused TLS handshakes of the test

    def get_request(self):
        sock, address = super().get_request()
        self.accepted += 1
        if getattr(self, "tls", None) is not None:
            sock = self.tls.wrap_socket(sock, server_side=True)
        return sock, address


@pytest.fixture
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.closed = threading.Event()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for the name "localhost" (openssl's CLI)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_kept_alive_connections_are_reused_and_replaced_once_the_server_closed_them(server):
    url = f"http://127.0.0.1:{server.server_port}/x"
    pool = make_pool(2)
    assert fetch(url, pool=pool, timeout=5, allow_private=True).data == BODY
    assert fetch(url, pool=pool, timeout=5, allow_private=True).data == BODY
    assert (pool.connections_made, server.accepted) == (1, 1)
    # the server closes the idle connection: the next download opens a new one
    assert server.closed.wait(30)
    time.sleep(0.1)  # the FIN reaches the client's socket
    assert fetch(url, pool=pool, timeout=5, allow_private=True) == (BODY, None)
    assert (pool.connections_made, server.accepted) == (2, 2)
    # an error's body is never read: that connection is closed, not reused
    assert fetch(url.replace("/x", "/error"), pool=pool, timeout=5, allow_private=True).error == \
        "HTTP Error 500: Internal Server Error"
    assert pool.idle_connections() == 0
    pool.clear()


def test_https_connects_to_the_checked_address_and_verifies_the_host_name(server, certificate, monkeypatch):
    cert, key = certificate
    server.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.tls.load_cert_chain(cert, key)
    url = f"https://localhost:{server.server_port}/x"
    # not trusted: urllib's wording of the verification failure
    got = fetch(url, pool=make_pool(2), timeout=5, allow_private=True)
    assert got.data is None and got.error.startswith("<urlopen error") and "CERTIFICATE_VERIFY_FAILED" in got.error
    # trusted (the certificate is its own CA): the download works through the pool's TLS context
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    pool = make_pool(2)
    assert fetch(url, pool=pool, timeout=5, allow_private=True) == (BODY, None)
    assert fetch(url, pool=pool, timeout=5, allow_private=True) == (BODY, None)
    assert pool.connections_made == 1  # kept alive over TLS too
    # the certificate names "localhost", not the address: asked for 127.0.0.1 the check fails
    wrong = fetch(f"https://127.0.0.1:{server.server_port}/x", pool=pool, timeout=5, allow_private=True)
    assert wrong.data is None and "CERTIFICATE_VERIFY_FAILED" in wrong.error
    pool.clear()


HEADER_LINES = ["Content-Type: image/jpeg", "Content-Length: 12", "X-Robots-Tag: noai", "X-Robots-Tag: otherbot: noindex",
                "Set-Cookie: a=b; Path=/", "Empty:", "Spaces:    padded   ", "Tab:\tvalue", "Latin: caf\xe9",
                "Colon: a:b:c", " continued line", "\tcontinued too", "no colon here", ": empty name",
                "Bad Name: x", "From someone", "Dup: 1", "dup: 2", "Bare\rCR: x"]


@pytest.mark.parametrize("seed", range(40))
def test_header_parsing_equals_http_clients(seed):
    import http.client
    import io
    import random

    from shardprep.fetch import parse_headers

    rng = random.Random(seed)
    lines = rng.sample(HEADER_LINES, rng.randint(0, 8))
    end = rng.choice(["\r\n", "\n"])
    raw = "".join(line + end for line in lines).encode("iso-8859-1") + rng.choice([b"\r\n", b"\n", b""])
    theirs = http.client.parse_headers(io.BytesIO(raw))
    ours = parse_headers(io.BytesIO(raw))
    assert type(ours) is type(theirs)
    assert ours.items() == theirs.items()
    assert ours.get_all("x-robots-tag") == theirs.get_all("x-robots-tag")
    assert ours.get("content-length") == theirs.get("content-length")


STATUS_LINES = [b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.0 200 OK", b"HTTP/1.1 204 No Content",
                b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 200", b"HTTP/1.1 302 Found  ", b"HTTP/2 200 OK",
                b"SSH-2.0-OpenSSH_9.6", b"HTTP/1.1 99 Low", b"HTTP/1.1 abc Nope", b""]
CONNECTION = [[], [b"Connection: close"], [b"Connection: keep-alive"], [b"Keep-Alive: timeout=5"]]


def _response(rng) -> bytes:
    """A response as a server might send it: one of STATUS_LINES (an interim 100 before it at times), a
    framing (Content-Length, possibly cut short, chunked with extensions and a trailer, or none: to the
    close), connection headers, \\r\\n or \\n line ends; the connection is closed after it."""
    body = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 700, 70_000])))
    end = rng.choice([b"\r\n", b"\n"])
    headers = list(rng.choice(CONNECTION)) + [b"Content-Type: image/jpeg"]
    framing = rng.choice(["length", "short", "chunked", "close"])
    if framing in ("length", "short"):
        headers.append(b"Content-Length: %d" % len(body))
        payload = body if framing == "length" else body[:len(body) // 2]
    elif framing == "chunked":
        headers.append(b"Transfer-Encoding: chunked")
        pieces, i = [], 0
        while i < len(body):
            n = rng.randint(1, 30_000)
            pieces.append(b"%x%s\r\n%s\r\n" % (n if i + n <= len(body) else len(body) - i,
                                                rng.choice([b"", b";ext=1"]), body[i:i + n]))
            i += n
        payload = b"".join(pieces) + b"0\r\n" + rng.choice([b"", b"X-Trailer: 1\r\n"]) + b"\r\n"
    else:
        payload = body
    head = rng.choice(STATUS_LINES) + end + b"".join(h + end for h in headers) + end
    if rng.random() < 0.2:
        head = b"HTTP/1.1 100 Continue" + end + end + head
    return head + payload


def _parsed(read) -> tuple:
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - the exception is the answer to compare
        return type(e).__name__


@pytest.mark.parametrize("plain", [True, False], ids=["kernel-timeout", "python-timeout"])
@pytest.mark.parametrize("seed", range(60))
def test_response_reading_equals_http_clients(seed, plain):
    """fetch reads responses off the socket itself (``_Reply``): status, reason, version, headers, whether
    the connection may be kept, the body and the exception of a bad answer are http.client's. Both ways
    it reads: a plain connection's blocking socket (the head peeked at, a body of known length in
    ``MSG_WAITALL`` reads) and a socket with Python's own timeout, as TLS reads."""
    import http.client
    import io
    import random
    import socket

    from shardprep.fetch import _kernel_timeout, _Reply

    raw = _response(random.Random(seed))

    class _Sock:
        def makefile(self, mode):
            return io.BytesIO(raw)

    def theirs():
        resp = http.client.HTTPResponse(_Sock(), method="GET")
        resp.begin()
        head = (resp.status, resp.reason, resp.version, resp.will_close, resp.headers.items())
        return head, resp.read()

    def ours():
        a, b = socket.socketpair()

        cuts = sorted(random.Random(seed).sample(range(1, 200), 8)) if seed % 2 else []  # the head in pieces

        def serve():  # the server's side: the response (at times its start in pieces), then the close
            try:
                for start, end in zip([0, *cuts], [*cuts, len(raw)]):
                    b.sendall(raw[start:end])
                    if end < len(raw):
                        time.sleep(0.002)  # each piece its own read
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the client stopped reading (a bad status line) and left

        writer = threading.Thread(target=serve, daemon=True)
        writer.start()
        try:
            if plain:
                _kernel_timeout(a, 5)
            else:
                a.settimeout(5)
            resp = _Reply(a)
            assert resp._plain == plain
            head = (resp.status, resp.reason, resp.version, resp.will_close, resp.headers.items())
            return head, resp.read(1 << 30, time.monotonic() + 30)
        finally:
            a.close()
            writer.join(10)
            b.close()

    assert _parsed(ours) == _parsed(theirs)


def test_a_pool_keeps_a_hosts_addresses_and_the_guard_still_checks_them(server, monkeypatch):
    import shardprep.fetch as fetch_module

    url = f"http://localhost:{server.server_port}/x"
    pool = make_pool(2)
    assert fetch(url, pool=pool, timeout=5, allow_private=True) == (BODY, None)
    assert fetch(url, pool=pool, timeout=5, allow_private=True) == (BODY, None)
    assert pool.lookups == 1  # the second download took the first one's answer
    # the cached addresses go through the address guard like fresh ones
    for _ in range(2):
        refused = fetch(url, pool=pool, timeout=5)
        assert refused.data is None and refused.error.startswith("refused: host resolves to a loopback")
    assert pool.lookups == 1
    # past its time the answer is asked for again
    monkeypatch.setattr(fetch_module, "DNS_CACHE_SECONDS", 0.0)
    fresh = make_pool(2)
    for _ in range(2):
        assert fetch(url, pool=fresh, timeout=5, allow_private=True) == (BODY, None)
    assert fresh.lookups == 2
    pool.clear()
    fresh.clear()


def test_a_head_that_trickles_in_fails_at_the_deadline():
    """A server that sends its status line and headers a byte at a time, each within the read timeout,
    is cut off at the URL's deadline, as a body that trickles in is."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip():
        conn, _ = listener.accept()
        with conn:
            for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"x" * 10_000:
                if stop.wait(0.05):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return  # the client left

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        got = fetch(f"http://127.0.0.1:{listener.getsockname()[1]}/x", pool=make_pool(1), timeout=1,
                    total_timeout=1.0, allow_private=True)
        assert got == (None, "timed out")
        assert time.monotonic() - t0 < 3  # the deadline, not the 10,000 bytes' ~8 minutes
    finally:
        stop.set()
        listener.close()
        thread.join(5)


def test_a_kept_connection_reads_with_one_system_call_and_each_downloads_own_timeout():
    """A plain connection's socket is blocking, its timeout kept by the kernel (SO_RCVTIMEO/SO_SNDTIMEO):
    a read is one ``recv``, not a ``poll`` and a ``recv``. Kept alive, it takes the next download's
    timeout: a second request the server never answers fails at that download's 0.3 s, not the first's 5 s."""
    import socket
    import struct

    def send(conn, served):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        conn.recv(65536)  # the second request: never answered
        served.wait(10)

    url, served, thread, listener = _one_answer(send)
    pool = make_pool(1)
    try:
        assert fetch(url, pool=pool, timeout=5, allow_private=True) == (BODY, None)
        [kept] = [conn for idle in pool._idle.values() for conn in idle]
        assert kept.sock.gettimeout() is None  # blocking: Python polls before each read only with its own timeout
        assert struct.unpack("ll", kept.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (5, 0)
        t0 = time.monotonic()
        assert fetch(url, pool=pool, timeout=0.3, allow_private=True) == (None, "timed out")
        assert 0.25 < time.monotonic() - t0 < 3
        assert pool.connections_made == 1  # the kept connection, not a new one
    finally:
        served.set()
        pool.clear()
        listener.close()
        thread.join(5)


def _one_answer(send) -> tuple[str, threading.Event, threading.Thread, object]:
    """A server on 127.0.0.1 that answers one request with ``send(conn, stop)``; (url, stop, thread, listener)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                send(conn, stop)
            except OSError:
                pass  # the client left

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/x", stop, thread, listener


@pytest.mark.parametrize("pause, whole", [(0.2, True), (0.6, True), (30, False)])
def test_a_body_that_pauses_is_read_whole_within_its_deadline_and_one_that_stops_times_out(pause, whole):
    """A plain connection reads a body of known length in ``MSG_WAITALL`` reads, each bounded by the read
    timeout (0.5 s here): a pause shorter than that costs nothing; a longer one ends a read with what came,
    and the next read waits again (0.6 s: the body still arrives, in two reads joined); a server that stops
    fails as "timed out" by the URL's deadline (3 x 0.5 s), as before."""
    body = os.urandom(300_000)

    def send(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:120_000])
        if stop.wait(pause):
            return
        conn.sendall(body[120_000:])
        stop.wait(10)

    url, stop, thread, listener = _one_answer(send)
    try:
        t0 = time.monotonic()
        got = fetch(url, pool=make_pool(1), timeout=0.5, allow_private=True)
        elapsed = time.monotonic() - t0
        if whole:
            assert got == (body, None) and elapsed < pause + 1
        else:
            assert got == (None, "timed out") and 0.9 < elapsed < 2.5
    finally:
        stop.set()
        listener.close()
        thread.join(5)


def test_a_body_cut_short_by_the_close_is_a_broken_connection_not_a_hang():
    def send(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 40_000)
        conn.shutdown(socket.SHUT_WR)

    import socket

    url, stop, thread, listener = _one_answer(send)
    try:
        t0 = time.monotonic()
        data, error = fetch(url, pool=make_pool(1), timeout=5, allow_private=True)
        assert data is None and error.startswith("connection broken: IncompleteRead(40000 bytes read, 60000 more")
        assert time.monotonic() - t0 < 2
    finally:
        stop.set()
        listener.close()
        thread.join(5)
