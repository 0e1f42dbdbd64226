"""robots.txt (RFC 9309) for the download engine: a URL whose path its site's robots.txt disallows for
our product token is not downloaded (its row: ``robots.txt disallows``).

One policy per authority (scheme, host, port), fetched once per process and shared by every download
thread and shard of it: threads that ask while it is being fetched wait for that one fetch. It is
fetched through ``shardprep.fetch``'s transport, pool and address guard, and what the fetch got
decides, as RFC 9309 §2.3.1 says:

* 2xx: the rules (the first 500 KiB), read by protego: the group naming our product token, else ``*``;
  the longest matching path wins, ``allow`` on a tie; ``*`` and ``$`` wildcards;
* 4xx, 404 included ("unavailable"), more than 5 redirects, or a robots.txt that the address guard
  refuses (the image's own fetch is guarded the same way): everything allowed;
* 5xx, 429 (as Google reads it: the site is overloaded), a timeout or no connection ("unreachable"):
  everything disallowed. The row says why: ``robots.txt unreachable (HTTP Error 503: ...)``, or the
  connection's own failure (``timed out``, ``<urlopen error [Errno 111] Connection refused>``), which
  the image's fetch from the same authority would have met too. Both are transient failures
  (``shardprep.failures``), unlike a disallowed path.

A policy is kept 24 hours (the RFC's limit for a cached robots.txt); an unreachable one only a minute,
so a site that was down is asked again soon, yet a dead one costs one timeout a minute rather than one
per URL. After the first URL of an authority, a URL costs one dict lookup (and protego's path match
when the site has rules).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable

from protego import Protego

from shardprep.fetch import (
    ABANDONED,
    DEFAULT_USER_AGENT,
    AbortablePool,
    DownloadsAborted,
    Fetched,
    authority,
    fetch_document,
    url_prefix,
)

DISALLOWED = "robots.txt disallows"
UNREACHABLE = "robots.txt unreachable"
MAX_BYTES = 500 * 1024  # RFC 9309 §2.5: crawlers parse at least 500 KiB; the rest is cut off
KEEP_SECONDS = 24 * 3600.0  # RFC 9309 §2.4: a cached robots.txt SHOULD NOT be used longer
UNREACHABLE_KEEP_SECONDS = 60.0
MAX_AUTHORITIES = 50_000  # kept per process (a web crawl meets millions of hosts); the oldest go first

_TOKEN = re.compile(r"[A-Za-z_-]+")  # RFC 9309 §2.2.1: a product token


def product_token(user_agent: str) -> str:
    """The product token robots.txt groups are matched against: the User-Agent's first word
    (``shardprep`` for ``shardprep/0.1 (+https://...)``), else ours."""
    match = _TOKEN.match(user_agent.strip())
    return match.group(0) if match else _TOKEN.match(DEFAULT_USER_AGENT).group(0)


class _Policy:
    """One authority's robots.txt: its rules (protego), or one answer for every path (``None``: allowed,
    else the row's failure), until ``expires`` (monotonic seconds)."""

    __slots__ = ("rules", "answer", "expires")

    def __init__(self, rules: Protego | None, answer: str | None, expires: float) -> None:
        self.rules, self.answer, self.expires = rules, answer, expires

    def refusal(self, url: str, token: str) -> str | None:
        if self.rules is None:
            return self.answer
        try:
            return None if self.rules.can_fetch(url, token) else DISALLOWED
        except ValueError:  # a URL protego cannot split: fetch refuses it with its own reason
            return None


class RobotsPolicies:
    """robots.txt policies by authority, for one address-guard setting (what a robots.txt fetch may
    reach); ``shared()`` gives the process's."""

    def __init__(self, allow_private: bool = False, trusted_hosts: frozenset[str] | tuple[str, ...] = ()) -> None:
        self._allow_private, self._trusted = allow_private, frozenset(trusted_hosts)
        self._lock = threading.Lock()  # guards the dicts' updates; lookups need none (a dict get is atomic)
        self._fetching: dict[tuple[str, str, int], threading.Lock] = {}  # one fetch at a time per authority
        self._policies: dict[tuple[str, str, int], _Policy] = {}  # (scheme, host, port) -> policy
        self._by_prefix: dict[str, _Policy] = {}  # every spelling of an authority met -> its policy

    def refusal(self, url: Any, *, pool: AbortablePool, token: str, timeout: float,
                user_agent: str = DEFAULT_USER_AGENT) -> str | None:
        """Why robots.txt forbids downloading ``url`` (``None``: it does not). A URL that is no http(s)
        URL is not judged here: ``fetch`` refuses it with its own reason. Raises ``DownloadsAborted``
        when ``pool`` is aborted while its robots.txt is fetched or waited for."""
        prefix = url_prefix(url)
        if prefix is None:
            return None
        prefix = prefix.lower()
        policy = self._by_prefix.get(prefix)
        if policy is None or policy.expires <= time.monotonic():
            policy = self._policy(prefix, pool, user_agent, timeout)
            if policy is None:
                return None
        return policy.refusal(url.strip(), token)

    def forget(self) -> None:
        """Drop every policy (the next URL of each authority fetches its robots.txt again)."""
        with self._lock:
            self._policies.clear()
            self._by_prefix.clear()

    def _policy(self, prefix: str, pool: AbortablePool, user_agent: str, timeout: float) -> _Policy | None:
        site = authority(prefix)  # the host and port fetch will ask
        if site is None:
            return None
        with self._lock:
            fetching = self._fetching.setdefault(site, threading.Lock())
        # in steps: a thread waiting for another thread's fetch still stops at once when its pool is aborted
        while not fetching.acquire(timeout=0.1):
            if pool.aborted:
                raise DownloadsAborted(ABANDONED)
        try:
            policy = self._policies.get(site)
            if policy is None or policy.expires <= time.monotonic():
                policy = self._fetch(site, pool, user_agent, timeout)
            with self._lock:
                if len(self._policies) >= MAX_AUTHORITIES and site not in self._policies:
                    _drop_oldest(self._policies)
                if len(self._by_prefix) >= MAX_AUTHORITIES and prefix not in self._by_prefix:
                    _drop_oldest(self._by_prefix)
                self._policies[site] = policy
                self._by_prefix[prefix] = policy
                # no longer needed: whoever still waits on it finds the policy stored (the dict stays small)
                self._fetching.pop(site, None)
        finally:
            fetching.release()
        return policy

    def _fetch(self, site: tuple[str, str, int], pool: AbortablePool, user_agent: str,
               timeout: float) -> _Policy:
        scheme, host, port = site
        shown = f"[{host}]" if ":" in host else host
        got = fetch_document(f"{scheme}://{shown}:{port}/robots.txt", pool=pool, timeout=timeout,
                             max_bytes=MAX_BYTES, allow_private=self._allow_private, trusted_hosts=self._trusted,
                             user_agent=user_agent)
        now = time.monotonic()
        if got.data is not None:
            # RFC 9309 §2.3: UTF-8 (a BOM dropped); bytes cut mid-character by the size limit are replaced
            return _Policy(Protego.parse(got.data.decode("utf-8-sig", errors="replace")), None, now + KEEP_SECONDS)
        if got.refused or (got.status is not None and got.status < 500 and got.status != 429):
            return _Policy(None, None, now + KEEP_SECONDS)
        answer = f"{UNREACHABLE} ({got.error})" if got.status is not None else got.error
        return _Policy(None, answer, now + UNREACHABLE_KEEP_SECONDS)


def _drop_oldest(policies: dict) -> None:
    """Forget the oldest quarter (dicts keep insertion order): memory stays bounded, and the hosts of
    the shards in progress, met last, are kept."""
    for key in list(policies)[: max(1, len(policies) // 4)]:
        del policies[key]


_SHARED: dict[tuple[bool, frozenset[str]], RobotsPolicies] = {}
_SHARED_LOCK = threading.Lock()


def shared(allow_private: bool = False, trusted_hosts: frozenset[str] | tuple[str, ...] = ()) -> RobotsPolicies:
    """The process's policies for this guard setting: every shard written by the process shares them."""
    key = (allow_private, frozenset(trusted_hosts))
    with _SHARED_LOCK:
        policies = _SHARED.get(key)
        if policies is None:
            policies = _SHARED[key] = RobotsPolicies(*key)
        return policies


def forget_all() -> None:
    """Drop every policy of the process (a test whose server reuses a port another server had)."""
    with _SHARED_LOCK:
        every = list(_SHARED.values())
    for policies in every:
        policies.forget()


def download_allowed(url: Any, *, download: Callable[[Any], Fetched], policies: RobotsPolicies,
                     pool: AbortablePool, token: str, timeout: float, user_agent: str = DEFAULT_USER_AGENT) -> Fetched:
    """``download(url)`` when robots.txt allows it; else its failure, without a request for the URL."""
    why = policies.refusal(url, pool=pool, token=token, timeout=timeout, user_agent=user_agent)
    return download(url) if why is None else Fetched(None, why)
