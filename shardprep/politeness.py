"""Per-host politeness for the download engine: at most ``connections`` requests in flight to one host,
and at most ``rate`` requests started per second per host (a token bucket holding one second's worth,
so a burst of ``max(1, rate)`` and then one every ``1 / rate`` s), for every thread and process of one
machine together, or of every machine that shares one Redis. ``polite_downloader`` wraps an image or video
download in them and in robots.txt (``shardprep.robots``), as the config says.

Keyed like robots.txt policies, by the server a request reaches: the URL's host, lower-cased, and its
port (``example.com:443``); not the registrable domain: ``a.example.com`` and ``b.example.com`` are
limited apart, as they are often served apart.

Shared through one small file per host in ``folder`` (default: ``shardprep-politeness-<uid>`` under
the system temp dir), with POSIX record locks (``fcntl.lockf``) on its bytes, which every process
opening the file sees:

* connection slot ``i`` is byte ``SLOTS_AT + i``, held (exclusively) while a request is in flight;
  the kernel drops a dead process's locks, so a crashed worker never leaks a slot. Record locks belong
  to the process, so a thread lock per slot keeps the threads of one process apart;
* the token bucket is one float at offset 0 (GCRA's "theoretical arrival time", in ``time.monotonic``
  seconds, which all processes of a machine share), read and written under a lock on byte ``BUCKET_LOCK``.
  A request reserves its start time there, so a rate wait is known up front: one past the URL's deadline
  fails the row at once with ``rate limited (per-host limit)``; a wait for a connection slot is polled
  until the deadline.

Across machines (``per_host_limits_url``, ``RedisHostLimits``): the same limits kept in Redis (5 or
later; the Celery result backend already), for every process of every machine that uses it. Each is one Lua script
(atomic), timed by Redis's clock (``TIME``), so the machines' clocks need not agree:

* the rate: the same GCRA reservation over one key per host (``<prefix><host>:rate``, the theoretical
  arrival time; it expires once that has passed);
* the connections: a sorted set of slot holders per host (``<prefix><host>:slots``) scored by when the
  hold lapses: the URL's deadline plus ``LEASE_GRACE``, since its download is abandoned by then anyway.
  A holder that dies (a killed worker) cannot release its slot; its member lapses then and the next
  script that looks at the set drops it. No heartbeat thread: a hold is never longer than one download.
  A wait for a slot polls the script (every 50 ms at most, each a round trip to Redis).

Redis unreachable: the shard fails with ``PolitenessError`` rather than download unlimited.

Cost per request (measured on a 2-core VM, no contention): ~2.6 us with a connection limit (two
``lockf`` calls), ~4.8 us with a rate too; an image row costs ~5.5 ms. With Redis: a round trip per
limit, plus one to release the slot.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import socket
import struct
import tempfile
import threading
import time
import uuid
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from shardprep import robots
from shardprep.errors import ShardprepError
from shardprep.fetch import AbortablePool, Fetched, authority, pause, url_prefix

if TYPE_CHECKING:
    from shardprep.config import DatasetConfig

RATE_LIMITED = "rate limited (per-host limit)"
BUCKET_LOCK = 8  # byte locked while the bucket at bytes 0-7 is read and written
SLOTS_AT = 64  # connection slot i: byte SLOTS_AT + i
MAX_OPEN_HOSTS = 512  # host files kept open per process (a web crawl meets thousands of hosts)
STALE_SECONDS = 86_400.0  # a bucket this far ahead was written before a reboot (monotonic restarted)
_POLL_FIRST, _POLL_MAX = 0.001, 0.02  # seconds between looks for a free slot (they double up to the max)
_REDIS_POLL_MAX = 0.05  # a look is a round trip to Redis: many waiting threads of many machines ask it
# seconds a waiter for a Redis slot keeps its place without asking again (it asks every 50 ms at most):
# a waiter that died blocks the line ahead of it that long; a live one stalled longer only queues again
REDIS_WAIT_LAPSE = 2.0
_REDIS_HEAD = 8  # waiters this near the front of a host's line look every 1 ms (the rest back off to 50 ms)
KEY_PREFIX = "shardprep:politeness:"  # the Redis keys' (a test sets its own)
LEASE_GRACE = 10.0  # seconds a Redis slot is held past its URL's deadline: a download may end a little late
REDIS_TIMEOUT = 5.0  # seconds a Redis connect or answer may take (a hung Redis must not hang the threads)
_TAT = struct.Struct("d")
_SPREAD = itertools.count()  # where a thread's first look for a free slot starts: threads spread out


class PolitenessError(ShardprepError, OSError):
    """The folder that shares the limits between processes cannot be used."""


def default_folder() -> str:
    # per user: another user's folder (sticky /tmp) could not be written
    return os.path.join(tempfile.gettempdir(), f"shardprep-politeness-{os.getuid()}")


class _Host:
    """One host's file, open in this process, and the thread locks that keep this process's threads
    apart on it (record locks do not: they belong to the process)."""

    __slots__ = ("fd", "slots", "bucket", "users")

    def __init__(self, fd: int, connections: int) -> None:
        self.fd = fd
        self.slots = [threading.Lock() for _ in range(connections)]
        self.bucket = threading.Lock()
        self.users = 0  # threads between acquire and release: the file is not closed under them


class HostLimits:
    """The limits of one setting (folder, connections, rate) for this process; ``shared()`` gives it.
    ``connections`` 0 or ``rate`` 0: that limit is off."""

    def __init__(self, folder: str, connections: int, rate: float) -> None:
        self.folder, self.connections, self.rate = folder, connections, rate
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._tolerance = (max(1.0, rate) - 1.0) * self._interval  # a burst of one second's worth
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._local = threading.local()  # the slot this thread had last: free again, most likely
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:
            raise PolitenessError(f"per-host limits: cannot use folder {folder!r}: {e}") from None

    def acquire(self, host: str, deadline: float, pool: AbortablePool) -> int | None:
        """Wait for ``host``'s slot and start time; the slot's number (-1: no slot limit) to ``release``,
        or ``None`` when the wait would pass ``deadline`` (monotonic seconds). Raises ``DownloadsAborted``
        when ``pool`` is aborted meanwhile."""
        entry = self._enter(host)
        slot = -1
        try:
            if self.connections:
                slot = self._take_slot(entry, deadline, pool)
                if slot is None:
                    self._leave(entry)
                    return None
            # the slot first, then the start time: requests that waited for slots must not start together
            if self.rate > 0 and not self._wait_turn(entry, deadline, pool):
                self.release(host, slot)
                return None
        except BaseException:
            self.release(host, slot)
            raise
        return slot

    def release(self, host: str, slot: int | None) -> None:
        entry = self._hosts[host]
        if slot is not None and slot >= 0:
            fcntl.lockf(entry.fd, fcntl.LOCK_UN, 1, SLOTS_AT + slot)
            entry.slots[slot].release()
        self._leave(entry)

    def _enter(self, host: str) -> _Host:
        with self._lock:
            entry = self._hosts.get(host)
            if entry is None:
                entry = self._hosts[host] = self._open(host)
            entry.users += 1
            return entry

    def _leave(self, entry: _Host) -> None:
        with self._lock:
            entry.users -= 1

    def _open(self, host: str) -> _Host:
        if len(self._hosts) >= MAX_OPEN_HOSTS:
            # close idle hosts only: closing a file drops every record lock this process has on it
            for name in [name for name, e in self._hosts.items() if e.users == 0][: MAX_OPEN_HOSTS // 4]:
                os.close(self._hosts.pop(name).fd)
        # a file name from the host: letters, digits, dots and dashes kept (IPv6 colons are not)
        path = os.path.join(self.folder, re.sub(r"[^a-z0-9.-]", "_", host) or "_")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise PolitenessError(f"per-host limits: cannot open {path!r}: {e}") from None
        return _Host(fd, self.connections)

    def _take_slot(self, entry: _Host, deadline: float, pool: AbortablePool) -> int | None:
        n = len(entry.slots)
        first = getattr(self._local, "slot", None)
        first = first if first is not None and first < n else next(_SPREAD) % n
        interval = _POLL_FIRST
        while True:
            for k in range(n):
                i = (first + k) % n
                lock = entry.slots[i]
                if not lock.acquire(blocking=False):
                    continue  # another thread of this process has it
                try:
                    fcntl.lockf(entry.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, SLOTS_AT + i)
                except OSError:  # another process has it
                    lock.release()
                    continue
                self._local.slot = i
                return i
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            pause(pool, min(interval, remaining))
            interval = min(2 * interval, _POLL_MAX)

    def _wait_turn(self, entry: _Host, deadline: float, pool: AbortablePool) -> bool:
        """Reserve the next start time GCRA allows (``False``, nothing reserved: it is past ``deadline``)
        and sleep until it."""
        with entry.bucket:
            fcntl.lockf(entry.fd, fcntl.LOCK_EX, 1, BUCKET_LOCK)
            try:
                now = time.monotonic()
                raw = os.pread(entry.fd, _TAT.size, 0)
                tat = _TAT.unpack(raw)[0] if len(raw) == _TAT.size else 0.0
                if tat > now + STALE_SECONDS:
                    tat = 0.0
                start = max(now, tat - self._tolerance)
                if start > deadline:
                    return False
                os.pwrite(entry.fd, _TAT.pack(max(tat, start) + self._interval), 0)
            finally:
                fcntl.lockf(entry.fd, fcntl.LOCK_UN, 1, BUCKET_LOCK)
        if start > now:
            pause(pool, start - now)
        return True


# GCRA (as ``HostLimits._wait_turn``) by Redis's clock. KEYS[1]: the host's theoretical arrival time;
# ARGV: interval, tolerance, the longest wait allowed (seconds). Returns the wait before the start it
# reserved, or -1 (nothing reserved); as strings: a Lua number would come back truncated to an integer.
_RATE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local interval, tolerance, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local start = math.max(now, tat - tolerance)
if start - now > most then return '-1' end
local new = math.max(tat, start) + interval
redis.call('SET', KEYS[1], string.format('%.6f', new), 'PX', math.ceil((new - now) * 1000) + 1000)
return string.format('%.6f', start - now)
"""

# A host's slots, given in turn. KEYS[1]: a sorted set of holders scored by when their hold lapses (Redis's
# clock); KEYS[2]: the line of waiters scored by when they came; KEYS[3]: the same waiters scored by when
# they stop counting as waiting (a waiter asks again well before; a dead one leaves the line by then).
# ARGV: the limit, the asker, its hold, how long it stays in line without asking again (seconds).
# Lapsed holders and waiters are dropped first. A free slot goes to the first waiters in line: a thread
# that has just given a slot back and asks again queues behind the others, so one machine's threads
# cannot keep a host's slots from another's (they did: the other's polls only found them held).
# Returns 0 (taken) or the asker's place in line (1: first).
_SLOT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local stamp = string.format('%.6f', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', stamp)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', stamp)) do
  redis.call('ZREM', KEYS[2], gone)
  redis.call('ZREM', KEYS[3], gone)
end
local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local place = redis.call('ZRANK', KEYS[2], ARGV[2]) or redis.call('ZCARD', KEYS[2])
if place < free then
  local hold = tonumber(ARGV[3])
  redis.call('ZADD', KEYS[1], string.format('%.6f', now + hold), ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
  -- the set lapses with its longest hold: a host nobody asks any more leaves no key behind
  if redis.call('PTTL', KEYS[1]) < hold * 1000 then redis.call('PEXPIRE', KEYS[1], math.ceil(hold * 1000)) end
  return 0
end
local patience = tonumber(ARGV[4])
redis.call('ZADD', KEYS[2], 'NX', stamp, ARGV[2])
redis.call('ZADD', KEYS[3], string.format('%.6f', now + patience), ARGV[2])
local lapse = math.ceil(patience * 1000) + 1000
redis.call('PEXPIRE', KEYS[2], lapse)
redis.call('PEXPIRE', KEYS[3], lapse)
return place + 1
"""


class RedisHostLimits:
    """``HostLimits``' limits (same interface) kept in the Redis at ``url``, for every process of every
    machine using it; ``shared()`` gives it. A slot is a holder's name (``""``: no slot limit)."""

    def __init__(self, url: str, connections: int, rate: float, prefix: str | None = None,
                 grace: float = LEASE_GRACE) -> None:
        try:
            import redis  # Celery's result backend's client (the dagster extra): the core needs it only here
        except ImportError:
            raise PolitenessError("per-host limits: per_host_limits_url needs the redis package "
                                  "(pip install redis, or shardprep[dagster])") from None
        self.connections, self.rate = connections, rate
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._tolerance = (max(1.0, rate) - 1.0) * self._interval
        self._prefix = KEY_PREFIX if prefix is None else prefix
        self._grace = grace
        self._shown = re.sub(r"//[^@/]*@", "//", url)  # a password is not shown in messages
        self._errors = redis.RedisError
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT,
                                                socket_connect_timeout=REDIS_TIMEOUT)
        except ValueError as e:
            raise PolitenessError(f"per-host limits: bad Redis URL {self._shown!r}: {e}") from None
        self._take = self._client.register_script(_SLOT_LUA)
        self._turn = self._client.register_script(_RATE_LUA)
        self._ids = itertools.count()
        self._me = f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"

    def acquire(self, host: str, deadline: float, pool: AbortablePool) -> str | None:
        """As ``HostLimits.acquire``; raises ``PolitenessError`` when Redis cannot be asked."""
        slot = ""
        try:
            if self.connections:
                slot = self._take_slot(host, deadline, pool)
                if slot is None:
                    return None
            if self.rate > 0 and not self._wait_turn(host, deadline, pool):
                self.release(host, slot)
                return None
        except BaseException:
            self.release(host, slot)
            raise
        return slot

    def release(self, host: str, slot: str | None) -> None:
        if not slot:
            return
        try:
            self._client.zrem(self._prefix + host + ":slots", slot)
        except self._errors:
            pass  # not raised over the download's outcome: the hold lapses at its deadline anyway

    def _run(self, script: Any, keys: list[str], *args: Any) -> Any:
        try:
            return script(keys=keys, args=args)
        except self._errors as e:
            raise PolitenessError(f"per-host limits: Redis at {self._shown}: {e}") from None

    def _take_slot(self, host: str, deadline: float, pool: AbortablePool) -> str | None:
        # unique across machines, processes (a forked child included), instances and threads
        holder = f"{self._me}:{os.getpid()}:{next(self._ids)}"
        keys = [self._prefix + host + ":slots", self._prefix + host + ":line", self._prefix + host + ":waiting"]
        interval, taken = _POLL_FIRST, False
        try:
            while True:
                hold = deadline - time.monotonic() + self._grace
                place = self._run(self._take, keys, self.connections, holder, f"{hold:.6f}",
                                  f"{REDIS_WAIT_LAPSE:.6f}")
                if place == 0:
                    taken = True
                    return holder
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # a slot given back next is this waiter's: it looks often, or the slot would sit idle (with
                # 10 ms requests, slots were busy 29% of the time at the 50 ms poll, 88% before the line).
                # Only the first few: each look is a round trip, and a host's line can be long
                head = place <= min(self.connections, _REDIS_HEAD)
                interval = _POLL_FIRST if head else min(2 * interval, _REDIS_POLL_MAX)
                pause(pool, min(interval, remaining))
        finally:
            if not taken:  # gave up, aborted or failed: out of the line
                self._leave_line(keys, holder)

    def _leave_line(self, keys: list[str], holder: str) -> None:
        # a waiter that gives up leaves at once rather than hold up the line until its place lapses
        try:
            self._client.zrem(keys[1], holder)
            self._client.zrem(keys[2], holder)
        except self._errors:
            pass  # the place lapses by itself

    def _wait_turn(self, host: str, deadline: float, pool: AbortablePool) -> bool:
        most = deadline - time.monotonic()
        wait = float(self._run(self._turn, [self._prefix + host + ":rate"], f"{self._interval:.9f}",
                               f"{self._tolerance:.9f}", f"{most:.6f}"))
        if wait < 0:
            return False
        if wait > 0:
            pause(pool, wait)
        return True


Limits = HostLimits | RedisHostLimits  # what polite_download is given: one interface
_SHARED: dict[tuple, Limits] = {}
_SHARED_LOCK = threading.Lock()


def _forget_in_child() -> None:
    # a forked child (Celery's prefork pool) must not inherit thread locks that its parent's download
    # threads held at the fork (never released there) nor record locks it does not have: it starts anew
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()
    _SHARED.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def shared(folder: str | None, connections: int, rate: float, url: str | None = None) -> Limits:
    """The process's limits for this setting: every shard written by the process shares them. With a
    Redis ``url``, every process using it (``folder`` is not used); else this machine's, in ``folder``."""
    where = ("redis", url, KEY_PREFIX) if url else ("files", folder or default_folder())
    key = (*where, connections, float(rate))
    with _SHARED_LOCK:
        limits = _SHARED.get(key)
        if limits is None:
            limits = _SHARED[key] = (RedisHostLimits(url, connections, rate) if url
                                     else HostLimits(where[1], connections, rate))
        return limits


_HOST_CACHE: dict[str, str | None] = {}  # authority as spelled -> host key (None: no host)
_HOST_CACHE_MAX = 50_000


def host_of(url: Any) -> str | None:
    """``host:port`` of the server a URL's request goes to, lower-cased (``None``: not an http(s) URL,
    which ``fetch`` refuses without a request)."""
    prefix = url_prefix(url)
    if prefix is None:
        return None
    host = _HOST_CACHE.get(prefix, "")
    if host != "":
        return host
    site = authority(prefix)  # fetch's parser: the same host and port
    host = f"{site[1]}:{site[2]}" if site else None
    if len(_HOST_CACHE) >= _HOST_CACHE_MAX:
        _HOST_CACHE.clear()
    _HOST_CACHE[prefix] = host
    return host


def polite_download(url: Any, *, download: Callable[..., Fetched], limits: Limits, pool: AbortablePool,
                    deadline_seconds: float) -> Fetched:
    """``download(url, total_timeout=...)`` within ``limits`` for its host, all within the URL's
    ``deadline_seconds`` from now (the wait included); a wait past it: ``rate limited (per-host limit)``."""
    deadline = time.monotonic() + deadline_seconds
    host = host_of(url)
    if host is None:
        return download(url)  # fetch refuses it with its own reason, without a request
    slot = limits.acquire(host, deadline, pool)
    if slot is None:
        return Fetched(None, RATE_LIMITED)
    try:
        return download(url, total_timeout=max(0.0, deadline - time.monotonic()))
    finally:
        limits.release(host, slot)


def polite_downloader(download: Callable[..., Fetched], cfg: DatasetConfig, *, pool: AbortablePool,
                      deadline_seconds: float) -> Callable[[Any], Fetched]:
    """``download`` (``fetch`` with its settings bound) wrapped as ``cfg`` says, for image and video rows
    alike: robots.txt (``respect_robots_txt``), then the per-host limits (``per_host_*``), the URL's wait
    for them within its ``deadline_seconds``."""
    if cfg.per_host_connections or cfg.per_host_requests_per_second:
        # inside the robots.txt check: a disallowed URL takes no slot and no turn
        limits = shared(cfg.per_host_state_dir, cfg.per_host_connections, cfg.per_host_requests_per_second,
                        cfg.per_host_limits_url)
        download = partial(polite_download, download=download, pool=pool, limits=limits,
                           deadline_seconds=deadline_seconds)
    if cfg.respect_robots_txt:
        # robots.txt asked before the URL (once per site and process): a disallowed URL is never requested
        download = partial(robots.download_allowed, download=download, pool=pool,
                           policies=robots.shared(cfg.allow_private_addresses),
                           token=robots.product_token(cfg.user_agent), timeout=cfg.timeout, user_agent=cfg.user_agent)
    return download
