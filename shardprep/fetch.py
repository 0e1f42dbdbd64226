"""Download one URL (an image or a video): bounded in time and size, pooled connections, and an address guard.

``fetch`` never raises for network problems: it returns ``Fetched(data, None)`` or
``Fetched(None, message)``. Messages follow img2dataset's (``HTTP Error 404: Not Found``,
``timed out``) where one exists, so status counts read the same.

The guard (unless ``allow_private``): only http/https, and every host, on every redirect hop,
must resolve to public addresses only. The connection then goes to the address that was checked
(the host name is kept for the Host header, SNI and certificate check), so a DNS answer that
changes between check and connect (rebinding) cannot reach a private address.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import NamedTuple
from urllib.parse import urljoin

import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    LocationParseError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util import parse_url

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


def make_pool(thread_count: int = 16) -> urllib3.PoolManager:
    """One pool per shard, shared by its download threads (keep-alive connections are reused).

    ``retries=False`` and ``redirect=False`` because ``fetch`` follows redirects itself, so that
    it can check every hop; certificates are verified (img2dataset's default).
    """
    return urllib3.PoolManager(
        num_pools=max(64, 2 * thread_count),
        maxsize=max(1, thread_count),
        block=False,
        retries=False,
        cert_reqs="CERT_REQUIRED",
    )


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


def _resolve(host: str, port: int, seconds: float) -> list[str]:
    """getaddrinfo with a time limit (it has none of its own); a literal IP costs no lookup."""
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
    if not done.wait(max(0.0, seconds)):
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
        ips = _resolve(host, port, min(timeout, remaining))
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
    """
    if not isinstance(url, str) or not url.strip():
        return Fetched(None, f"invalid url: {url!r}")
    deadline = time.monotonic() + (total_timeout if total_timeout is not None else default_deadline(timeout, retries))
    trusted = frozenset(trusted_hosts)
    error = "timed out"
    for _attempt in range(retries + 1):
        if time.monotonic() >= deadline:
            break
        try:
            return Fetched(
                _fetch_once(url.strip(), pool, timeout, max_bytes, deadline, allow_private, trusted,
                            user_agent, user_agent_token, disallowed_directives),
                None,
            )
        except _Refused as e:
            return Fetched(None, str(e))
        except _Failed as e:
            error = str(e)
        except NewConnectionError as e:  # before ConnectTimeoutError: urllib3 derives it from that
            reason = str(e).rsplit(": ", 1)[-1]  # "[Errno 111] Connection refused"
            error = f"<urlopen error {reason}>"
        except (ConnectTimeoutError, ReadTimeoutError, socket.timeout, TimeoutError):
            error = "timed out"
        except SSLError as e:
            error = f"<urlopen error {e}>"
        except ProtocolError as e:
            error = f"connection broken: {e.args[-1] if e.args else e}"
        except (HTTPError, OSError, ValueError) as e:  # any other transport-level problem
            error = f"{type(e).__name__}: {e}"
    return Fetched(None, error)
