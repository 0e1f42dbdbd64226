"""Download one URL (an image or a video): bounded in time and size, pooled connections, and an address guard.

``fetch`` never raises for network problems: it returns ``Fetched(data, None)`` or
``Fetched(None, message)``. Messages follow img2dataset's (``HTTP Error 404: Not Found``,
``timed out``) where one exists, so status counts read the same.

The guard (unless ``allow_private``): only http/https, and every host, on every redirect hop,
must resolve to public addresses only. The connection then goes to the address that was checked
(the host name is kept for the Host header, SNI and certificate check), so a DNS answer that
changes between check and connect (rebinding) cannot reach a private address.

Abandoning downloads (the process is stopping: SIGTERM/SIGINT, a Celery warm shutdown): a pool from
``make_pool`` can be aborted (``pool.abort()``, or ``abort_all()`` for every pool of the process). Its
sockets are shut down, so reads blocked on a server that drips bytes or never answers return at once,
and every ``fetch`` on it raises ``DownloadsAborted`` instead of returning a per-URL failure: an
abandoned download is not a failed one, and a shard must not be written with it.

Rate limits: an HTTP 429 or 503 with a ``Retry-After`` (delta-seconds or an HTTP-date, RFC 9110
§10.2.3) is waited out and asked again, within the URL's deadline and at most ``RATE_LIMIT_WAITS``
times (a wait is not one of the ``retries``); a wait that would pass the deadline fails the URL at
once with ``rate limited (HTTP 429, Retry-After N s)``. Without the header they are plain failures
(``HTTP Error 429: Too Many Requests``), retried like any other.
"""

from __future__ import annotations

import datetime
import email.parser
import email.utils
import http.client
import io
import ipaddress
import math
import re
import select
import socket
import ssl
import struct
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple
from urllib.parse import urljoin

from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

from shardprep.errors import ShardprepError

MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# img2dataset's default disallowed X-Robots-Tag directives
DISALLOWED_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "noimageindex"})
DEFAULT_USER_AGENT = "shardprep/0.1 (+https://github.com/shardprep)"
# answers whose Retry-After is honoured (RFC 9110 §10.2.3 names 503 and 3xx; 429 is RFC 6585's)
RETRY_AFTER_STATUSES = (429, 503)
RATE_LIMIT_WAITS = 3  # per URL: a server that keeps asking to wait is not waited on forever
# A shard's pool keeps each host's addresses this long (a browser's order of magnitude: Chrome keeps
# them a minute): LAION-like sources repeat hosts, and every lookup otherwise costs a thread and a
# resolver round trip (img2dataset's README has users run a caching resolver for it). The address
# guard still checks every address before each connection. Failed lookups are not kept.
DNS_CACHE_SECONDS = 60.0
DNS_CACHE_ENTRIES = 100_000


class Fetched(NamedTuple):
    data: bytes | None
    error: str | None


class _Refused(Exception):
    """The URL or its address is not allowed; retrying cannot help."""


class _Failed(Exception):
    """A failure with an img2dataset-like message (retried like img2dataset does)."""


class _HTTPError(_Failed):
    """A final answer that is not 2xx: urllib's ``HTTP Error 404: Not Found`` text, with the status and
    the seconds its ``Retry-After`` asks to wait (``None``: not asked, or not a 429/503)."""

    def __init__(self, status: int, reason: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP Error {status}: {reason}")
        self.status, self.retry_after = status, retry_after


class DownloadsAborted(ShardprepError, RuntimeError):
    """The pool's downloads were abandoned because the process is stopping: nothing may be written from
    them (a shard written now would record the abandoned URLs as failed downloads)."""


ABANDONED = "downloads abandoned (the process is stopping)"


def abandoned_shard(shard: str) -> DownloadsAborted:
    """The error a shard writer raises instead of writing ``shard``."""
    return DownloadsAborted(f"shard {shard}: {ABANDONED}; the shard is left for the next run")


class _AbortSwitch:
    """What ``abort()`` must reach, shared by a pool and its connections: the sockets they opened and
    the events download threads wait on (name resolution). Once tripped, it stays tripped."""

    def __init__(self) -> None:
        # reentrant: abort() may run in a signal handler on a thread that is inside this lock already
        self._lock = threading.RLock()
        self.tripped = False
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._events: weakref.WeakSet[threading.Event] = weakref.WeakSet()

    def add_socket(self, sock: socket.socket) -> bool:
        """Track ``sock``; False (not tracked) once tripped: the caller must not connect."""
        with self._lock:
            if self.tripped:
                return False
            self._sockets.add(sock)
            return True

    def close_socket(self, sock: socket.socket) -> None:
        # under the lock: trip() never shuts a descriptor down while it is closed and its number reused
        with self._lock:
            self._sockets.discard(sock)
            sock.close()

    def wake_on_trip(self, event: threading.Event) -> None:
        with self._lock:
            if self.tripped:
                event.set()
            else:
                self._events.add(event)

    def trip(self) -> None:
        with self._lock:
            self.tripped = True
            for sock in list(self._sockets):
                try:
                    # SHUT_RDWR, not close(): a thread blocked in recv/connect on it returns at once
                    # (EOF or an error), while close() from another thread does not wake it on Linux
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed or never connected: nothing is blocked on it
            for event in list(self._events):
                event.set()


class _ConnectFailed(Exception):
    """connect() to one address failed (refused, unreachable, timed out): the next address is tried."""


# a header line as email's parser splits it (name: no controls, space or colon), with nothing it would
# treat otherwise (a continuation, a bare CR, a line without a colon)
_PLAIN_HEADER = re.compile(r"[\x21-\x39\x3b-\x7e]+:[^\r\n]*\r?\n\Z")


def parse_headers(fp, _class=http.client.HTTPMessage) -> http.client.HTTPMessage:
    """``http.client.parse_headers``, the same message, without running email's feed parser over
    plain header lines (~20 us of a response's ~250 us); anything else goes through it as before."""
    lines = http.client._read_headers(fp)
    msg = _class()
    for raw in lines[:-1]:  # the last is the blank line (or the EOF) that ended them
        line = raw.decode("iso-8859-1")
        if not _PLAIN_HEADER.match(line):
            return email.parser.Parser(_class=_class).parsestr(b"".join(lines).decode("iso-8859-1"))
        name, value = line.split(":", 1)
        msg._headers.append((name, value.lstrip(" \t").rstrip("\r\n")))  # compat32's header_source_parse
    return msg


_MAXLINE = 65536  # http.client's limits on a status, header, chunk-size or trailer line
_MAX_HEAD = 100 * _MAXLINE  # its 100 header lines of at most _MAXLINE each
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_RECV = 64 * 1024  # one socket read at most (a body of known length is read into its own buffer instead)
_DISALLOWED_PATH = re.compile("[\x00-\x20\x7f]")  # http.client's control characters in a URL
_ILLEGAL_HEADER_VALUE = re.compile(rb"\n(?![ \t])|\r(?![ \t\n])")  # http.client's check (header injection)


class _Reply:
    """One HTTP/1.x response read straight off a connection's socket, by http.client's rules: its status
    line (``_read_status``: 1xx skipped, ``BadStatusLine``, ``RemoteDisconnected`` for no answer at all),
    its header parser (``parse_headers`` above) and framing (``begin``: chunked, Content-Length, or the
    body runs to the close; HTTP/1.0 keep-alive) and its exceptions (``IncompleteRead``, ``LineTooLong``).
    http.client's own response reads through a buffered file and several layers per read: ~0.2 ms of CPU
    a download on the benchmark site, where this reads the head in one or two ``recv`` calls and a body
    with a known length into one buffer of its size (``bench/IMAGES.md``).

    On a plain socket (blocking, its timeout kept by the kernel: ``_kernel_timeout``) the head is
    peeked at and only its own bytes taken, so the body is still all in the socket; a body of known
    length then comes in one ``recv(n, MSG_WAITALL)``: the kernel fills one new ``bytes`` object of the
    body's size as the data arrives, where a read into a buffer would zero it first and copy it out
    after, and wakes the thread once, not at each segment (~40 us of CPU a 240 KB body, bench/IMAGES.md).
    A TLS socket takes no flags: it reads as before."""

    def __init__(self, sock: socket.socket, deadline: float = math.inf) -> None:
        self._sock = sock
        # an SSLSocket refuses recv flags; a plain one without its own timeout is blocking (_kernel_timeout)
        self._plain = not isinstance(sock, ssl.SSLSocket) and sock.gettimeout() is None
        self._buf = b""  # read from the socket, not consumed yet
        self.closed = False  # the body was read to its end
        while True:
            head = self._head(deadline)
            version, status, reason = _status_line(head)
            if status != 100:
                break
        self.status, self.reason = status, reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        line_end = head.find(b"\n") + 1
        self.headers = parse_headers(io.BytesIO(head[line_end:]))
        encoding = self.headers.get("transfer-encoding")
        self.chunked = bool(encoding) and encoding.lower() == "chunked"
        self.will_close = self._check_close()
        self.length: int | None = None
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if status in (204, 304) or 100 <= status < 200:
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True
        if self.length == 0 and not self.chunked:
            self.closed = True

    _check_close = http.client.HTTPResponse._check_close

    def getheader(self, name: str) -> str | None:
        values = self.headers.get_all(name)  # http.client's: several values joined
        return None if values is None else ", ".join(values)

    def _recv(self) -> bytes:
        return self._sock.recv(_RECV)

    def _head(self, deadline: float) -> bytes:
        """The next status line and header lines, up to the blank line that ends them (or the EOF); a head
        that trickles in fails at ``deadline``, as a body does."""
        buf = self._buf
        start = 0
        peek = self._plain and not buf
        while True:
            end = _HEAD_END.search(buf, start)
            if end is not None:
                self._buf = buf[end.end():]
                return buf[:end.end()]
            if len(buf) > _MAX_HEAD:
                raise http.client.HTTPException("got more than 100 headers")
            if buf and time.monotonic() > deadline:
                raise _Failed("timed out")
            start = max(0, len(buf) - 3)
            if peek:  # take what is in the socket only up to the head's end (or all of it, none there)
                data = self._sock.recv(_RECV, socket.MSG_PEEK)
                if data:
                    end = _HEAD_END.search(buf[start:] + data)
                    data = self._sock.recv(len(data) if end is None else end.end() - (len(buf) - start))
            else:
                data = self._recv()
            if not data:
                self._buf = b""
                return buf  # the EOF ends the head (http.client: the status line decides)
            buf += data

    def _line(self, what: str) -> bytes:
        """One line (chunk size, trailer), its end included; b"" at the EOF."""
        buf = self._buf
        while True:
            i = buf.find(b"\n")
            if i >= 0:
                if i + 1 > _MAXLINE:
                    raise http.client.LineTooLong(what)
                self._buf = buf[i + 1:]
                return buf[:i + 1]
            if len(buf) > _MAXLINE:
                raise http.client.LineTooLong(what)
            data = self._recv()
            if not data:
                self._buf = b""
                return buf
            buf += data

    def read(self, max_bytes: int, deadline: float, truncate: bool = False) -> bytes:
        """The body, refused past ``max_bytes`` (``truncate``: cut there instead, the rest left unread:
        ``closed`` stays False). ``deadline`` is checked between socket reads, so a body that trickles in
        cannot outlast it."""
        if self.length is not None and not self.chunked:  # http.client reads a chunked body even of a 204
            if self.length > max_bytes and not truncate:
                raise _Refused(f"file too large to download (> {max_bytes} bytes)")
            return self._read_length(min(self.length, max_bytes), deadline)
        chunks: list[bytes] = []
        size = 0
        for chunk in (self._chunks(deadline) if self.chunked else self._to_close(deadline)):
            size += len(chunk)
            if size > max_bytes:
                if truncate:
                    chunks.append(chunk)
                    return b"".join(chunks)[:max_bytes]
                raise _Refused(f"file too large to download (> {max_bytes} bytes)")
            chunks.append(chunk)
        self.closed = True
        return b"".join(chunks)

    def _read_length(self, n: int, deadline: float) -> bytes:
        have = self._buf[:n]
        self._buf = self._buf[len(have):]
        if len(have) == n:
            self.closed = n == self.length
            return have
        if self._plain:
            return self._read_waiting(n, have, deadline)
        out = bytearray(n)
        out[:len(have)] = have
        view, got = memoryview(out), len(have)
        while got < n:
            if time.monotonic() > deadline:
                raise _Failed("timed out")
            k = self._sock.recv_into(view[got:], min(n - got, 1 << 20))
            if not k:
                raise http.client.IncompleteRead(bytes(out[:got]), n - got)
            got += k
        self.closed = n == self.length
        return bytes(out)

    def _read_waiting(self, n: int, have: bytes, deadline: float) -> bytes:
        """The rest of a body of ``n`` bytes (``have`` read already) by ``MSG_WAITALL`` reads: each returns
        when all is in, or with what came when the socket's timeout, the EOF or ``abort()``'s shutdown
        ends its wait; ``deadline`` is checked between them, as between any reads. Each read still waits
        at most the timeout, but one that got part of the body returns it instead of failing, so a server
        may pause for up to twice the timeout between two bytes (the URL's deadline bounds it all)."""
        parts, got = ([have] if have else []), len(have)
        while got < n:
            if time.monotonic() > deadline:
                raise _Failed("timed out")
            data = self._sock.recv(n - got, socket.MSG_WAITALL)
            if not data:
                raise http.client.IncompleteRead(b"".join(parts), n - got)
            parts.append(data)
            got += len(data)
        self.closed = n == self.length
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _to_close(self, deadline: float) -> Iterator[bytes]:
        if self._buf:
            yield self._buf
            self._buf = b""
        while True:
            if time.monotonic() > deadline:
                raise _Failed("timed out")
            data = self._recv()
            if not data:
                return
            yield data

    def _chunks(self, deadline: float) -> Iterator[bytes]:
        while True:
            if time.monotonic() > deadline:
                raise _Failed("timed out")
            line = self._line("chunk size")
            i = line.find(b";")
            size = int(line[:i] if i >= 0 else line, 16)  # ValueError: http.client's, as it raises it
            if size == 0:
                break
            left = size
            while left:
                if not self._buf:
                    if time.monotonic() > deadline:
                        raise _Failed("timed out")
                    self._buf = self._recv()
                    if not self._buf:
                        raise http.client.IncompleteRead(b"", left)
                piece = self._buf[:left]
                self._buf = self._buf[len(piece):]
                left -= len(piece)
                yield piece
            self._line("chunk end")  # the CRLF after the data
        while True:  # the trailer, read and discarded up to its blank line (or the EOF)
            line = self._line("trailer line")
            if line in (b"\r\n", b"\n", b""):
                return


def _status_line(head: bytes) -> tuple[str, int, str]:
    """http.client's ``_read_status`` on the first line of ``head``."""
    end = head.find(b"\n")
    raw = head if end < 0 else head[:end + 1]
    if len(raw) > _MAXLINE:
        raise http.client.LineTooLong("status line")
    line = str(raw, "iso-8859-1")
    if not line:
        raise http.client.RemoteDisconnected("Remote end closed connection without response")
    try:
        version, status, reason = line.split(None, 2)
    except ValueError:
        try:
            version, status = line.split(None, 1)
            reason = ""
        except ValueError:
            version = ""
    if not version.startswith("HTTP/"):
        raise http.client.BadStatusLine(line)
    try:
        code = int(status)
    except ValueError:
        raise http.client.BadStatusLine(line) from None
    if code < 100 or code > 999:
        raise http.client.BadStatusLine(line)
    return version, code, reason


def _request_bytes(path: str, headers: dict[str, str]) -> bytes:
    """The request http.client would send for ``GET path`` with ``headers`` (Accept-Encoding: identity
    added; a control character in the path, or a header value that would inject a header, refused as
    it refuses them)."""
    bad = _DISALLOWED_PATH.search(path)
    if bad:
        raise http.client.InvalidURL(f"URL can't contain control characters. {path!r} (found at least "
                                     f"{bad.group()!r})")
    out = [f"GET {path} HTTP/1.1\r\n".encode("ascii"), b"Accept-Encoding: identity\r\n"]
    for name, value in headers.items():
        raw = value.encode("latin-1")
        if _ILLEGAL_HEADER_VALUE.search(raw):
            raise ValueError(f"Invalid header value {raw!r}")
        out.append(name.encode("latin-1") + b": " + raw + b"\r\n")
    out.append(b"\r\n")
    return b"".join(out)


class _Connection(http.client.HTTPConnection):
    """http.client's connection to an address already checked (the host name only goes into the Host
    header and, for HTTPS, SNI and the certificate check), with its socket tracked by the pool's abort
    switch from before connect() until close().

    The switch tracks a second descriptor of the socket (``dup``): TLS wrapping detaches the original
    socket object (its fileno becomes -1) during the handshake, the duplicate stays valid, and
    shutdown() acts on the socket, whichever descriptor names it. It is closed with the connection, or
    the TCP connection would outlive close()."""

    def __init__(self, ip: str, port: int, timeout: float, switch: _AbortSwitch) -> None:
        super().__init__(ip, port, timeout=timeout)
        self._switch = switch
        self._handle: socket.socket | None = None

    def connect(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            handle = sock.dup()
            if not self._switch.add_socket(handle):
                handle.close()
                raise ConnectionAbortedError(ABANDONED)
            self._handle = handle
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sys.audit("http.client.connect", self, self.host, self.port)
            sock.connect((self.host, self.port))
        except OSError as e:
            sock.close()
            self._untrack()
            raise _ConnectFailed(e) from e
        self.sock = self._wrap(sock)

    def _wrap(self, sock: socket.socket) -> socket.socket:
        _kernel_timeout(sock, self.timeout)
        return sock

    def set_timeout(self, timeout: float) -> None:
        """Bound each later read and write of a kept connection by ``timeout`` seconds."""
        if timeout != self.timeout:  # each change is a system call (and a hand-off of the GIL)
            self.timeout = timeout
            self._apply_timeout(timeout)

    def _apply_timeout(self, timeout: float) -> None:
        _kernel_timeout(self.sock, timeout)

    def _untrack(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._switch.close_socket(handle)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._untrack()


class _TLSConnection(_Connection):
    def __init__(self, ip: str, port: int, timeout: float, switch: _AbortSwitch, server_hostname: str,
                 context: ssl.SSLContext) -> None:
        super().__init__(ip, port, timeout, switch)
        self._server_hostname, self._context = server_hostname, context

    def _wrap(self, sock: socket.socket) -> socket.socket:
        try:
            return self._context.wrap_socket(sock, server_hostname=self._server_hostname)
        except BaseException:
            sock.close()
            self._untrack()
            raise

    def _apply_timeout(self, timeout: float) -> None:
        # ssl's reads try first and poll only when nothing is there: Python's own timeout costs nothing
        self.sock.settimeout(timeout)


def _kernel_timeout(sock: socket.socket, timeout: float) -> None:
    """Make a plain connected ``sock`` blocking, with ``timeout`` on each read and write kept by the kernel
    (``SO_RCVTIMEO``/``SO_SNDTIMEO``). With Python's own timeout every ``recv`` and ``send`` is two system
    calls, a ``poll`` and then the call, each handing the GIL over: ~15% of ``fetch``'s CPU a URL on 32
    threads (bench/IMAGES.md). A read that times out now fails with ``EAGAIN`` (``BlockingIOError``),
    which ``_attempt_once`` reports as "timed out", as before; ``abort()``'s shutdown still ends it at once."""
    seconds, micro = divmod(max(1, round(timeout * 1e6)), 1_000_000)  # a zero timeval would mean none at all
    value = struct.pack("ll", seconds, micro)  # struct timeval
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.settimeout(None)


def _dropped(conn: _Connection) -> bool:
    """An idle keep-alive connection the server closed (or sent something unasked on): not reusable."""
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN)
    return bool(poller.poll(0))


class AbortablePool:
    """One shard's keep-alive connections (``http.client``, by scheme, address, port and host name),
    whose downloads ``abort()`` abandons at once (see the module's docstring).

    Our own rather than urllib3's: per download, urllib3's layers (pool manager, connection pool,
    response wrappers around http.client's) cost ~2x http.client's own CPU, measured at ~0.4 ms of a
    ~5.5 ms image row."""

    def __init__(self, per_host: int, max_idle: int) -> None:
        self._switch = _AbortSwitch()
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple, list[_Connection]] = OrderedDict()  # oldest used first
        self._idle_count = 0
        self._per_host, self._max_idle = per_host, max_idle
        self._tls: ssl.SSLContext | None = None
        self.connections_made = 0
        self._addresses: dict[tuple[str, int], tuple[float, list[str]]] = {}  # (host, port) -> (expiry, ips)
        self.lookups = 0  # name lookups made (not answered from the cache)

    @property
    def aborted(self) -> bool:
        return self._switch.tripped

    def abort(self) -> None:
        """Shut down every socket of this pool and refuse new downloads; idempotent, any thread (or a
        signal handler)."""
        self._switch.trip()

    def wake_on_abort(self, event: threading.Event) -> None:
        """Set ``event`` when the pool is aborted (at once if it is), so a wait on it ends then."""
        self._switch.wake_on_trip(event)

    def connection(self, key: tuple[str, str, int, str], timeout: float) -> tuple[_Connection, bool]:
        """``(connection, reused)`` for ``key`` = (scheme, ip, port, host): an idle one still open, or a
        new one, not yet connected."""
        with self._lock:
            idle = self._idle.get(key)
            while idle:
                conn = idle.pop()
                self._idle_count -= 1
                if not _dropped(conn):
                    conn.set_timeout(timeout)
                    return conn, True
                conn.close()
            self.connections_made += 1
        scheme, ip, port, host = key
        if scheme == "https":
            if self._tls is None:
                # certificates verified against the host name, as img2dataset's urllib does by default
                self._tls = ssl.create_default_context()
            return _TLSConnection(ip, port, timeout, self._switch, host, self._tls), False
        return _Connection(ip, port, timeout, self._switch), False

    def release(self, key: tuple[str, str, int, str], conn: _Connection) -> None:
        """Keep ``conn`` (its last response read to the end) for the next download from ``key``."""
        with self._lock:
            if self._switch.tripped or conn.sock is None or len(self._idle.get(key, ())) >= self._per_host:
                conn.close()
                return
            self._idle.setdefault(key, []).append(conn)
            self._idle.move_to_end(key)
            self._idle_count += 1
            while self._idle_count > self._max_idle:  # many hosts (a web crawl): the oldest go
                oldest = next(iter(self._idle))
                for old in self._idle.pop(oldest):
                    old.close()
                    self._idle_count -= 1

    def addresses(self, host: str, port: int) -> list[str] | None:
        """The addresses a lookup of ``host`` gave less than ``DNS_CACHE_SECONDS`` ago (``None``: none)."""
        hit = self._addresses.get((host, port))
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def remember(self, host: str, port: int, ips: list[str]) -> None:
        if len(self._addresses) >= DNS_CACHE_ENTRIES:
            self._addresses.clear()  # a crawl over more hosts than that: start again, never grow
        self._addresses[(host, port)] = (time.monotonic() + DNS_CACHE_SECONDS, ips)

    def idle_connections(self) -> int:
        return self._idle_count

    def clear(self) -> None:
        """Close every idle connection."""
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            self._idle_count = 0
        for conn in conns:
            conn.close()


# every pool of the process that may have downloads in flight: abort_all() reaches them from a
# shutdown hook that has no reference to the shard being written
_LIVE_POOLS: weakref.WeakSet[AbortablePool] = weakref.WeakSet()
_LIVE_LOCK = threading.RLock()  # reentrant: abort_all() may run in a signal handler
_REFUSE_NEW = threading.Event()


def make_pool(thread_count: int = 16) -> AbortablePool:
    """One pool per shard, shared by its download threads (keep-alive connections are reused, up to
    one per thread per host). Born aborted after ``abort_all(refuse_new=True)``."""
    pool = AbortablePool(per_host=max(1, thread_count), max_idle=max(64, 2 * thread_count))
    with _LIVE_LOCK:
        _LIVE_POOLS.add(pool)
        if _REFUSE_NEW.is_set():
            pool.abort()
    return pool


def abort_all(refuse_new: bool = False) -> int:
    """Abort every live pool of this process (a shutdown hook: the downloads in flight are abandoned);
    returns how many. ``refuse_new``: the process is going away, so pools made from now on start
    aborted too (a step writing several shards catches each shard's error and would go on to the
    next one, downloading again). Safe from a signal handler."""
    with _LIVE_LOCK:
        if refuse_new:
            _REFUSE_NEW.set()
        pools = list(_LIVE_POOLS)
    for pool in pools:
        pool.abort()
    return len(pools)


def _raise_if_aborted(pool: AbortablePool) -> None:
    if pool.aborted:
        raise DownloadsAborted(ABANDONED)


def default_deadline(timeout: float, retries: int = 0) -> float:
    """Total seconds one URL may take, redirects and retries included.

    ``timeout`` bounds each connect/read like img2dataset's socket timeout; the total bound stops
    a server that drips bytes just fast enough to never trip it.
    """
    return 3 * timeout * (retries + 1)


def address_problem(ip: str) -> str | None:
    """Why ``ip`` is not a public unicast address (``None`` when it is)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    for label, bad in (
        ("unspecified", addr.is_unspecified),
        ("loopback", addr.is_loopback),
        ("link-local", addr.is_link_local),
        ("multicast", addr.is_multicast),
        ("reserved", addr.is_reserved),
        ("private", addr.is_private),
        ("non-global", not addr.is_global),
    ):
        if bad:
            return label
    return None


def _resolve(host: str, port: int, seconds: float, pool: AbortablePool) -> list[str]:
    """getaddrinfo with a time limit (it has none of its own) that ``pool.abort()`` also ends, its answer
    kept by the pool for ``DNS_CACHE_SECONDS``; a literal IP costs no lookup."""
    cached = pool.addresses(host, port)
    if cached is not None:
        return cached
    try:
        ips = [str(ipaddress.ip_address(host))]
        pool.remember(host, port, ips)
        return ips
    except ValueError:
        pass
    pool.lookups += 1
    result: dict = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            result["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            result["error"] = e
        done.set()

    # a daemon thread: a resolver stuck past our deadline is abandoned, never waited for
    threading.Thread(target=lookup, name="shardprep-dns", daemon=True).start()
    pool.wake_on_abort(done)
    finished = done.wait(max(0.0, seconds))
    _raise_if_aborted(pool)
    if not finished:
        raise _Failed("timed out")
    if "error" in result:
        raise _Failed(f"<urlopen error {result['error']}>")
    ips: list[str] = []
    for _family, _type, _proto, _name, sockaddr in result["infos"]:
        if sockaddr[0] not in ips:
            ips.append(sockaddr[0])
    if not ips:
        raise _Failed(f"<urlopen error no address for {host}>")
    pool.remember(host, port, ips)
    return ips


def _is_disallowed(values: list[str], user_agent_token: str | None, directives: frozenset[str]) -> bool:
    """img2dataset's X-Robots-Tag rule: ``[token:] directive, directive`` with a matching or no token."""
    for value in values:
        token_and_directives = value.split(":", 1)
        found = [x.strip().lower() for x in token_and_directives[-1].split(",")]
        token = token_and_directives[0].lower() if len(token_and_directives) == 2 else None
        if (token is None or token == user_agent_token) and any(x in directives for x in found):
            return True
    return False


# the scheme and authority at the start of a URL, as spelled: a cache key found without parsing the URL
_PREFIX = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]*)")


def url_prefix(url: Any) -> str | None:
    """``scheme://authority`` as ``url`` spells it (``None``: not such a URL): what per-site caches key on
    before they parse it once with ``authority``."""
    match = _PREFIX.match(url) if isinstance(url, str) else None
    return match.group(1) if match else None


def default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def authority(prefix: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of the server ``fetch`` would ask for a URL starting with ``prefix``, lower-cased,
    by fetch's own parser (``None``: not an http(s) URL with a host, which ``fetch`` refuses unasked)."""
    try:
        parts = parse_url(prefix)
    except (LocationParseError, ValueError):
        return None
    scheme, host = (parts.scheme or "").lower(), (parts.host or "").strip("[]").lower()
    if scheme not in ("http", "https") or not host:
        return None
    return scheme, host, parts.port or default_port(scheme)


def _host_header(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == default_port(scheme) else f"{shown}:{port}"


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait: delta-seconds or an HTTP-date (0 when it is past);
    ``None`` when absent or unreadable (then nothing was asked)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, as every HTTP-date is
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - time.time())


def rate_limited(status: int, seconds: float) -> str:
    """The failure of a URL whose server asks to wait longer than its deadline allows."""
    return f"rate limited (HTTP {status}, Retry-After {math.ceil(seconds)} s)"


def _request(pool: AbortablePool, key: tuple[str, str, int, str], request: bytes,
             timeout: float, deadline: float) -> tuple[_Connection, _Reply]:
    """Send ``request`` on a connection for ``key`` and read the answer's head. A kept-alive connection
    the server closed meanwhile (its answer: none at all) is replaced by the next idle one or a new one,
    as browsers and urllib3 do; a new connection's failure is the answer."""
    while True:
        _raise_if_aborted(pool)
        conn, reused = pool.connection(key, timeout)
        try:
            if conn.sock is None:
                conn.connect()
            conn.sock.sendall(request)
            return conn, _Reply(conn.sock, deadline)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            conn.close()
            if not reused:
                raise
        except BaseException:
            conn.close()
            raise


def _fetch_once(
    url: str,
    pool: AbortablePool,
    timeout: float,
    max_bytes: int,
    deadline: float,
    allow_private: bool,
    trusted_hosts: frozenset[str],
    user_agent: str,
    user_agent_token: str | None,
    disallowed: frozenset[str],
    truncate: bool = False,
) -> bytes:
    current = url
    for _hop in range(MAX_REDIRECTS + 1):
        try:
            # urllib3's parser: IDNA hosts, percent-encodes what may not appear raw in a request line
            parts = parse_url(current)
        except (LocationParseError, ValueError) as e:
            raise _Refused(f"invalid url: {e}") from None
        scheme = (parts.scheme or "").lower()
        if scheme not in ("http", "https"):
            raise _Refused(f"refused: unsupported URL scheme '{scheme}' (only http and https)")
        host = (parts.host or "").strip("[]")
        if not host:
            raise _Refused("invalid url: no host")
        port = parts.port or default_port(scheme)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Failed("timed out")
        ips = _resolve(host, port, min(timeout, remaining), pool)
        if not allow_private and host not in trusted_hosts:
            for ip in ips:
                problem = address_problem(ip)
                if problem is not None:
                    raise _Refused(f"refused: host resolves to a {problem} address (allow_private_addresses is off)")
        request = _request_bytes(parts.request_uri, {"User-Agent": user_agent, "Host": _host_header(host, port, scheme)})
        answer = None
        connect_error: _ConnectFailed | None = None
        for ip in ips[:3]:  # like socket.create_connection: try the next address if one is unreachable
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Failed("timed out")
            key = (scheme, ip, port, host)
            try:
                answer = _request(pool, key, request, min(timeout, remaining), deadline)
                break
            except _ConnectFailed as e:
                connect_error = e
        if answer is None:
            raise connect_error  # type: ignore[misc]
        conn, resp = answer
        body_read = False
        try:
            location = resp.getheader("Location") if resp.status in REDIRECT_STATUSES else None
            if location:
                current = urljoin(current, location)
                continue
            if not 200 <= resp.status < 300:
                # urllib's HTTPError text, as img2dataset records it
                wait = (retry_after_seconds(resp.getheader("Retry-After"))
                        if resp.status in RETRY_AFTER_STATUSES else None)
                raise _HTTPError(resp.status, resp.reason, wait)
            if disallowed and _is_disallowed(resp.headers.get_all("X-Robots-Tag") or [], user_agent_token,
                                             disallowed):
                raise _Failed("Use of image disallowed by X-Robots-Tag directive")
            data = resp.read(max_bytes, deadline, truncate)
            body_read = resp.closed  # a body cut short has bytes left unread
            return data
        finally:
            # the connection is kept only when no unread body is left on it: an unread one (error,
            # redirect, a read cut off) is never drained, it could trickle in forever
            if body_read and not resp.will_close:
                pool.release(key, conn)
            else:
                conn.close()
    raise _Refused(f"too many redirects (more than {MAX_REDIRECTS})")


def fetch(
    url: str,
    *,
    pool: AbortablePool,
    timeout: float = 10.0,
    max_bytes: int = 50_000_000,
    retries: int = 0,
    allow_private: bool = False,
    user_agent: str = DEFAULT_USER_AGENT,
    user_agent_token: str | None = None,
    disallowed_directives: frozenset[str] = DISALLOWED_DIRECTIVES,
    total_timeout: float | None = None,
    trusted_hosts: frozenset[str] | tuple[str, ...] = (),
) -> Fetched:
    """Download ``url`` (``retries + 1`` attempts, like img2dataset, while no bytes came back).

    ``trusted_hosts``: host names exempt from the address guard (e.g. an internal mirror).
    Refusals (guard, scheme, size cap, redirect loop) are not retried: the answer would not change.
    A 429 or 503 with ``Retry-After`` is waited out and asked again within the deadline (see the
    module's docstring).
    Raises ``DownloadsAborted`` (at once, without network) when ``pool`` is or gets aborted: whatever
    the attempt saw then (an error, a body cut short) is the abort's doing, not the URL's.
    """
    if not isinstance(url, str) or not url.strip():
        return Fetched(None, f"invalid url: {url!r}")
    deadline = time.monotonic() + (total_timeout if total_timeout is not None else default_deadline(timeout, retries))
    trusted = frozenset(trusted_hosts)
    error = "timed out"
    attempts = waits = 0
    while attempts <= retries:
        _raise_if_aborted(pool)
        if time.monotonic() >= deadline:
            break
        final, error, answer = _attempt_once(url.strip(), pool, timeout, max_bytes, deadline, allow_private, trusted,
                                             user_agent, user_agent_token, disallowed_directives)
        # a body read up to the EOF that abort()'s shutdown caused can look complete (no Content-Length)
        _raise_if_aborted(pool)
        if final is not None:
            return final
        wait = answer.retry_after if answer is not None else None
        if wait is None:
            attempts += 1
            continue
        # the server said when to ask again: asking sooner (a plain retry) would only be refused again
        if waits >= RATE_LIMIT_WAITS or time.monotonic() + wait >= deadline:
            return Fetched(None, rate_limited(answer.status, wait))
        waits += 1
        pause(pool, wait)
    return Fetched(None, error)


def pause(pool: AbortablePool, seconds: float) -> None:
    """Sleep ``seconds``; ``pool.abort()`` ends it at once (``DownloadsAborted``)."""
    woken = threading.Event()
    pool.wake_on_abort(woken)
    woken.wait(seconds)
    _raise_if_aborted(pool)


class Document(NamedTuple):
    """What ``fetch_document`` got: ``data`` for a 2xx answer; else ``status``, a final answer that was
    not 2xx (redirects followed), or only ``error`` (no answer: img2dataset's wording), ``refused`` when
    the URL or a redirect was refused (guard, scheme, redirect loop: asking again would not change it)."""

    data: bytes | None
    status: int | None
    error: str | None
    refused: bool = False


def fetch_document(
    url: str,
    *,
    pool: AbortablePool,
    timeout: float,
    max_bytes: int,
    allow_private: bool = False,
    trusted_hosts: frozenset[str] | tuple[str, ...] = (),
    user_agent: str = DEFAULT_USER_AGENT,
) -> Document:
    """One GET of a small text (robots.txt) through ``fetch``'s transport, pool and address guard:
    redirects followed, the body cut at ``max_bytes`` rather than refused, the status of an answer that
    is not 2xx kept, no retry and no X-Robots-Tag check. Raises ``DownloadsAborted`` as ``fetch`` does."""
    _raise_if_aborted(pool)
    deadline = time.monotonic() + default_deadline(timeout)
    final, error, answer = _attempt_once(url, pool, timeout, max_bytes, deadline, allow_private,
                                         frozenset(trusted_hosts), user_agent, None, frozenset(), True)
    _raise_if_aborted(pool)
    if final is not None:
        return Document(final.data, None, final.error, refused=final.error is not None)
    return Document(None, answer.status if answer is not None else None, error)


def _attempt_once(url: str, pool: AbortablePool, *args) -> tuple[Fetched | None, str, _HTTPError | None]:
    """One attempt: (the answer, "", None) when it is final (data or a refusal), else (None, why it
    failed, the answer when it was an HTTP status)."""
    try:
        return Fetched(_fetch_once(url, pool, *args), None), "", None
    except _Refused as e:
        return Fetched(None, str(e)), "", None
    except _HTTPError as e:
        return None, str(e), e
    except _Failed as e:
        return None, str(e), None
    except _ConnectFailed as e:
        cause = e.args[0]
        if isinstance(cause, (socket.timeout, TimeoutError)):
            return None, "timed out", None
        return None, f"<urlopen error {cause}>", None  # urllib's wording: "<urlopen error [Errno 111] ...>"
    except (socket.timeout, TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO (_kernel_timeout)
        return None, "timed out", None
    except ssl.SSLError as e:  # before OSError, which it is
        return None, f"<urlopen error {e}>", None
    except (http.client.HTTPException, ConnectionError) as e:  # cut off, reset, not HTTP
        return None, f"connection broken: {e!r}", None
    except (OSError, ValueError) as e:  # any other transport-level problem
        return None, f"{type(e).__name__}: {e}", None
