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
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
import time
import weakref
from typing import Any, NamedTuple
from urllib.parse import urljoin

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    LocationParseError,
    NameResolutionError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util import parse_url
from urllib3.util.connection import allowed_gai_family

from shardprep.errors import ShardprepError

MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# img2dataset's default disallowed X-Robots-Tag directives
DISALLOWED_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "noimageindex"})
DEFAULT_USER_AGENT = "shardprep/0.1 (+https://github.com/shardprep)"
_CHUNK = 64 * 1024


class Fetched(NamedTuple):
    data: bytes | None
    error: str | None


class _Refused(Exception):
    """The URL or its address is not allowed; retrying cannot help."""


class _Failed(Exception):
    """A failure with an img2dataset-like message (retried like img2dataset does)."""


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


class _TrackedConnection:
    """A connection whose socket ``abort()`` can shut down, from before connect() to the last read.

    The switch tracks a second descriptor of the socket (``dup``): TLS wrapping detaches the original
    socket object (its fileno becomes -1) during the handshake, the duplicate stays valid, and
    shutdown() acts on the socket, whichever descriptor names it. It is closed with the connection, or
    the TCP connection would outlive close()."""

    abort_switch: _AbortSwitch | None = None
    _abort_handle: socket.socket | None = None
    # HTTPConnection's, for the type checker (annotations only: nothing here shadows them)
    host: str
    port: int
    timeout: Any
    source_address: tuple[str, int] | None
    socket_options: Any
    _dns_host: str

    def _new_conn(self) -> socket.socket:
        """urllib3's ``_new_conn`` (same errors), but the socket is tracked before connect()."""
        if self.abort_switch is None:
            return super()._new_conn()  # type: ignore[misc]
        try:
            sock = self._connect_tracked()
        except socket.gaierror as e:
            raise NameResolutionError(self.host, self, e) from e  # type: ignore[arg-type]
        except socket.timeout as e:
            message = f"Connection to {self.host} timed out. (connect timeout={self.timeout})"
            raise ConnectTimeoutError(self, message) from e
        except OSError as e:
            message = f"Failed to establish a new connection: {e}"
            raise NewConnectionError(self, message) from e  # type: ignore[arg-type]
        sys.audit("http.client.connect", self, self.host, self.port)
        return sock

    def _connect_tracked(self) -> socket.socket:
        """``urllib3.util.connection.create_connection`` with the socket tracked before connecting."""
        addresses = socket.getaddrinfo(self._dns_host.strip("[]"), self.port, allowed_gai_family(), socket.SOCK_STREAM)
        error: OSError | None = None
        for family, kind, proto, _name, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                self._track(sock)
                for option in self.socket_options or ():
                    sock.setsockopt(*option)
                # urllib3's "default" sentinel (neither a number nor None) leaves the socket's own timeout
                if self.timeout is None or isinstance(self.timeout, (int, float)):
                    sock.settimeout(self.timeout)
                if self.source_address:
                    sock.bind(self.source_address)
                sock.connect(address)
                return sock
            except OSError as e:
                error = e
                sock.close()
                self._untrack()
        raise error if error is not None else OSError("getaddrinfo returns an empty list")

    def _track(self, sock: socket.socket) -> None:
        self._untrack()  # a reconnect: the old socket's duplicate goes
        handle = sock.dup()
        if not self.abort_switch.add_socket(handle):  # type: ignore[union-attr]
            handle.close()
            raise ConnectionAbortedError(ABANDONED)
        self._abort_handle = handle

    def _untrack(self) -> None:
        handle, self._abort_handle = self._abort_handle, None
        if handle is not None:
            self.abort_switch.close_socket(handle)  # type: ignore[union-attr]

    def close(self) -> None:
        try:
            super().close()  # type: ignore[misc]
        finally:
            self._untrack()


class _TrackedHTTPConnection(_TrackedConnection, HTTPConnection):
    pass


class _TrackedHTTPSConnection(_TrackedConnection, HTTPSConnection):
    pass


class _TrackedPool:
    """A host's connection pool that hands its pool manager's abort switch to each new connection."""

    abort_switch: _AbortSwitch | None = None

    def _new_conn(self):
        conn = super()._new_conn()  # type: ignore[misc]
        conn.abort_switch = self.abort_switch
        return conn


class _TrackedHTTPPool(_TrackedPool, HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSPool(_TrackedPool, HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


class AbortablePool(urllib3.PoolManager):
    """A ``PoolManager`` whose downloads ``abort()`` abandons at once (see the module's docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._switch = _AbortSwitch()
        self.pool_classes_by_scheme = {"http": _TrackedHTTPPool, "https": _TrackedHTTPSPool}

    def _new_pool(self, scheme, host, port, request_context=None):
        pool = super()._new_pool(scheme, host, port, request_context)
        pool.abort_switch = self._switch
        return pool

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


# every pool of the process that may have downloads in flight: abort_all() reaches them from a
# shutdown hook that has no reference to the shard being written
_LIVE_POOLS: weakref.WeakSet[AbortablePool] = weakref.WeakSet()
_LIVE_LOCK = threading.RLock()  # reentrant: abort_all() may run in a signal handler
_REFUSE_NEW = threading.Event()


def make_pool(thread_count: int = 16) -> AbortablePool:
    """One pool per shard, shared by its download threads (keep-alive connections are reused).

    ``retries=False`` and ``redirect=False`` because ``fetch`` follows redirects itself, so that
    it can check every hop; certificates are verified (img2dataset's default). Born aborted after
    ``abort_all(refuse_new=True)``.
    """
    pool = AbortablePool(
        num_pools=max(64, 2 * thread_count),
        maxsize=max(1, thread_count),
        block=False,
        retries=False,
        cert_reqs="CERT_REQUIRED",
    )
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


def _raise_if_aborted(pool: urllib3.PoolManager) -> None:
    if getattr(pool, "aborted", False):
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


def _resolve(host: str, port: int, seconds: float, pool: urllib3.PoolManager) -> list[str]:
    """getaddrinfo with a time limit (it has none of its own) that ``pool.abort()`` also ends; a literal
    IP costs no lookup."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
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
    if isinstance(pool, AbortablePool):
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


def _host_header(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == (443 if scheme == "https" else 80) else f"{shown}:{port}"


def _read_body(resp, max_bytes: int, deadline: float) -> bytes:
    length = resp.headers.get("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise _Refused(f"file too large to download (> {max_bytes} bytes)")
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise _Failed("timed out")
        # read1: at most one socket read, so the deadline is checked even when bytes trickle in
        chunk = resp.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise _Refused(f"file too large to download (> {max_bytes} bytes)")
        chunks.append(chunk)


def _finish(resp, body_read: bool) -> None:
    """Give the connection back for reuse only when no unread body is left on it.

    An unread body (error, redirect, or a read cut off) is never drained: it could trickle in
    forever. Closing costs one new connection, only off the success path.
    """
    if not body_read:
        resp.close()
    resp.release_conn()


def _fetch_once(
    url: str,
    pool: urllib3.PoolManager,
    timeout: float,
    max_bytes: int,
    deadline: float,
    allow_private: bool,
    trusted_hosts: frozenset[str],
    user_agent: str,
    user_agent_token: str | None,
    disallowed: frozenset[str],
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
        port = parts.port or (443 if scheme == "https" else 80)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Failed("timed out")
        ips = _resolve(host, port, min(timeout, remaining), pool)
        if not allow_private and host not in trusted_hosts:
            for ip in ips:
                problem = address_problem(ip)
                if problem is not None:
                    raise _Refused(f"refused: host resolves to a {problem} address (allow_private_addresses is off)")
        path = parts.request_uri
        headers = {"User-Agent": user_agent, "Host": _host_header(host, port, scheme)}
        resp = None
        last_connect_error: Exception | None = None
        for ip in ips[:3]:  # like socket.create_connection: try the next address if one is unreachable
            _raise_if_aborted(pool)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Failed("timed out")
            t = min(timeout, remaining)
            kw = {"server_hostname": host} if scheme == "https" else {}
            conn_pool = pool.connection_from_host(ip, port, scheme, pool_kwargs=kw)
            try:
                resp = conn_pool.urlopen(
                    "GET", path, headers=headers, redirect=False, retries=False,
                    preload_content=False, assert_same_host=False,
                    timeout=urllib3.Timeout(connect=t, read=t),
                )
                break
            except (NewConnectionError, ConnectTimeoutError) as e:
                last_connect_error = e
        if resp is None:
            raise last_connect_error  # type: ignore[misc]
        body_read = False
        try:
            if resp.status in REDIRECT_STATUSES and resp.headers.get("Location"):
                current = urljoin(current, resp.headers["Location"])
                continue
            if not 200 <= resp.status < 300:
                # urllib's HTTPError text, as img2dataset records it
                raise _Failed(f"HTTP Error {resp.status}: {resp.reason}")
            if disallowed and _is_disallowed(resp.headers.getlist("X-Robots-Tag"), user_agent_token, disallowed):
                raise _Failed("Use of image disallowed by X-Robots-Tag directive")
            data = _read_body(resp, max_bytes, deadline)
            body_read = True
            return data
        finally:
            _finish(resp, body_read)
    raise _Refused(f"too many redirects (more than {MAX_REDIRECTS})")


def fetch(
    url: str,
    *,
    pool: urllib3.PoolManager,
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
    Raises ``DownloadsAborted`` (at once, without network) when ``pool`` is or gets aborted: whatever
    the attempt saw then (an error, a body cut short) is the abort's doing, not the URL's.
    """
    if not isinstance(url, str) or not url.strip():
        return Fetched(None, f"invalid url: {url!r}")
    deadline = time.monotonic() + (total_timeout if total_timeout is not None else default_deadline(timeout, retries))
    trusted = frozenset(trusted_hosts)
    error = "timed out"
    for _attempt in range(retries + 1):
        _raise_if_aborted(pool)
        if time.monotonic() >= deadline:
            break
        final, error = _attempt_once(url.strip(), pool, timeout, max_bytes, deadline, allow_private, trusted,
                                     user_agent, user_agent_token, disallowed_directives)
        # a body read up to the EOF that abort()'s shutdown caused can look complete (no Content-Length)
        _raise_if_aborted(pool)
        if final is not None:
            return final
    return Fetched(None, error)


def _attempt_once(url: str, pool: urllib3.PoolManager, *args) -> tuple[Fetched | None, str]:
    """One attempt: (the answer, "") when it is final (data or a refusal), else (None, why it failed)."""
    try:
        return Fetched(_fetch_once(url, pool, *args), None), ""
    except _Refused as e:
        return Fetched(None, str(e)), ""
    except _Failed as e:
        return None, str(e)
    except NewConnectionError as e:  # before ConnectTimeoutError: urllib3 derives it from that
        reason = str(e).rsplit(": ", 1)[-1]  # "[Errno 111] Connection refused"
        return None, f"<urlopen error {reason}>"
    except (ConnectTimeoutError, ReadTimeoutError, socket.timeout, TimeoutError):
        return None, "timed out"
    except SSLError as e:
        return None, f"<urlopen error {e}>"
    except ProtocolError as e:
        return None, f"connection broken: {e.args[-1] if e.args else e}"
    except (HTTPError, OSError, ValueError) as e:  # any other transport-level problem
        return None, f"{type(e).__name__}: {e}"
