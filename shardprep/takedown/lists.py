"""Takedown lists: read, checked, registered under the output root, and matched against samples.

A list names samples four ways, as takedown and opt-out requests come in practice
(``../shared/reference/governance.md``):

* ``url``: the sample's source URL, exactly;
* ``domain``: every URL whose host is the domain or one of its subdomains (``example.com`` takes
  ``cdn.example.com``; the host is the URL's, not its registrable domain);
* ``key``: a sample key (``000120034``); for videos it takes every clip cut from that row
  (``000120034_00000``, ...) too;
* ``sha256``: the SHA-256 of the downloaded bytes (img2dataset's ``sha256`` column; LAION's ``hash``
  column is a URL/text hash and is not one).

Files (any fsspec URL): parquet or CSV with a column per kind (``url``, ``domain``, ``key``, ``sha256``;
any non-empty cell is an entry) or ``kind`` + ``value`` columns, and an optional ``reason``; or text,
one entry per line (``#`` comments), written ``kind:value`` or bare (a URL has a scheme, 64 hex digits
are a sha256, digits are a key, anything else a domain).

A registered list is stored once under ``.shardprep/takedowns/lists/{version}.parquet`` (version: a
digest of its entries), so removed samples stay removed for every later run whatever happens to the
file the list came from.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from shardprep import storage
from shardprep.errors import ShardprepError
from shardprep.layout import Layout

KINDS = ("url", "domain", "key", "sha256")
REMOVED = "removed: takedown"  # the error_message of a row removed (or never fetched) for a takedown
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_KEY = re.compile(r"^[0-9]+(_[0-9]+)?$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_DOMAIN = re.compile(r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
SCHEMA = pa.schema([("kind", pa.string()), ("value", pa.string()), ("reason", pa.string())])


class TakedownListError(ShardprepError, ValueError):
    """A takedown list cannot be read, or an entry is not a URL, domain, key or sha256 (the message
    names the file and the line or row)."""


@dataclass(frozen=True)
class Entry:
    kind: str
    value: str
    reason: str | None = None


def normalise(kind: str, value: str, where: str) -> str:
    """``value`` as it is matched; TakedownListError naming ``where`` when it is not a ``kind``."""
    value = value.strip()
    if kind not in KINDS:
        raise TakedownListError(f"{where}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    if not value:
        raise TakedownListError(f"{where}: empty {kind}")
    if kind == "sha256":
        if not _SHA256.match(value):
            raise TakedownListError(f"{where}: sha256 {value!r} is not 64 hex digits")
        return value.lower()
    if kind == "key":
        if not _KEY.match(value):
            raise TakedownListError(f"{where}: key {value!r} is not a sample key (digits, e.g. 000120034)")
        return value
    if kind == "domain":
        host = value.lower().rstrip(".")
        host = host[2:] if host.startswith("*.") else host.lstrip(".")
        if not _DOMAIN.match(host):
            raise TakedownListError(f"{where}: {value!r} is not a domain name")
        return host
    if not _SCHEME.match(value):
        raise TakedownListError(f"{where}: URL {value!r} has no scheme (write https://...)")
    return value


def _guess(value: str) -> str:
    if _SCHEME.match(value):
        return "url"
    if _SHA256.match(value):
        return "sha256"
    if _KEY.match(value):
        return "key"
    return "domain"


def _text_entries(text: str, url: str) -> list[Entry]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip() if not _SCHEME.match(line.strip()) else line.strip()
        if not line:
            continue
        kind, sep, rest = line.partition(":")
        if sep and kind.strip().lower() in KINDS and not rest.startswith("//"):
            kind, value = kind.strip().lower(), rest
        else:
            kind, value = _guess(line), line
        out.append(Entry(kind, normalise(kind, value, f"{url}, line {n}")))
    return out


def _table_entries(table: pa.Table, url: str) -> list[Entry]:
    cols = {name.lower(): name for name in table.column_names}
    reasons = table.column(cols["reason"]).to_pylist() if "reason" in cols else [None] * table.num_rows
    out = []
    if "kind" in cols and "value" in cols:
        kinds, values = table.column(cols["kind"]).to_pylist(), table.column(cols["value"]).to_pylist()
        for i, (kind, value) in enumerate(zip(kinds, values)):
            where = f"{url}, row {i}"
            if kind is None or value is None:
                raise TakedownListError(f"{where}: kind and value must both be set")
            kind = str(kind).strip().lower()
            out.append(Entry(kind, normalise(kind, str(value), where), _reason(reasons[i])))
        return out
    present = [k for k in KINDS if k in cols]
    if not present:
        raise TakedownListError(f"{url}: no takedown column: it needs one of {', '.join(KINDS)} "
                                f"(or kind + value); it has {table.column_names}")
    for kind in present:
        for i, value in enumerate(table.column(cols[kind]).to_pylist()):
            if value is not None and str(value).strip():
                out.append(Entry(kind, normalise(kind, str(value), f"{url}, row {i}, column {cols[kind]!r}"),
                                 _reason(reasons[i])))
    return out


def _reason(value) -> str | None:
    return str(value).strip() or None if value is not None else None


def read_list(url: str) -> list[Entry]:
    """The entries of the takedown list at ``url`` (module doc), duplicates dropped, in file order."""
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        raise TakedownListError(f"{url}: no such takedown list") from None
    except OSError as e:
        raise TakedownListError(f"{url}: cannot read the takedown list: {e}") from None
    name = url.rsplit("/", 1)[-1].lower()
    try:
        if name.endswith(".parquet"):
            entries = _table_entries(pq.ParquetFile(io.BytesIO(data)).read(use_threads=False), url)
        elif name.endswith(".csv"):
            rows = list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
            names = list(rows[0]) if rows else []
            entries = _table_entries(pa.table({n: [r[n] for r in rows] for n in names}), url)
        else:
            entries = _text_entries(data.decode("utf-8"), url)
    except TakedownListError:
        raise
    except (ValueError, pa.ArrowException) as e:  # not UTF-8, not parquet
        raise TakedownListError(f"{url}: not a readable takedown list ({type(e).__name__}: {e})") from None
    first: dict[tuple[str, str], Entry] = {}
    for e in entries:
        first.setdefault((e.kind, e.value), e)
    return list(first.values())


def list_version(entries: list[Entry]) -> str:
    """16 hex digits naming a list by its entries (the same entries in any order: the same version)."""
    doc = sorted((e.kind, e.value, e.reason or "") for e in entries)
    return hashlib.sha256(json.dumps(doc).encode("utf-8")).hexdigest()[:16]


def register(layout: Layout, entries: list[Entry], source: str) -> str:
    """Store ``entries`` under the output root (once per version); returns the version."""
    version = list_version(entries)
    url = layout.takedown_list(version)
    if not storage.exists(url):
        table = pa.table({"kind": [e.kind for e in entries], "value": [e.value for e in entries],
                          "reason": [e.reason for e in entries]}, schema=SCHEMA)
        table = table.replace_schema_metadata({"source": source, "registered_at": str(time.time())})
        storage.write_parquet(url, table)
    return version


@dataclass
class RegisteredList:
    version: str
    source: str
    registered_at: float
    entries: list[Entry]


def registered(layout: Layout) -> list[RegisteredList]:
    """Every list registered under ``layout``, oldest first."""
    fs, folder = storage.url_to_fs(layout.takedown_lists_dir)
    if not fs.isdir(folder):
        return []
    out = []
    for path in sorted(fs.ls(folder, detail=False)):
        name = path.rsplit("/", 1)[-1]
        if not name.endswith(".parquet") or storage.TEMP_MARK in name:
            continue
        out.append(_read_registered(layout.takedown_list(name[: -len(".parquet")])))
    return sorted(out, key=lambda r: (r.registered_at, r.version))


# A registered list's file is named by its content and never rewritten, so a process reads it once: every
# download step asks for the lists, and an opt-out list may hold millions of entries
_READ: dict[str, "RegisteredList"] = {}


def _read_registered(url: str) -> "RegisteredList":
    if url not in _READ:
        table = storage.read_parquet(url)
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        entries = [Entry(k, v, r) for k, v, r in zip(*(table.column(c).to_pylist() for c in SCHEMA.names))]
        _READ[url] = RegisteredList(url.rsplit("/", 1)[-1][: -len(".parquet")], meta.get("source", "?"),
                                    float(meta.get("registered_at", 0)), entries)
    return _READ[url]


@dataclass
class TakedownSet:
    """Every entry of some lists, for matching samples (``match``)."""

    entries: dict[str, dict[str, tuple[str, str | None]]] = field(default_factory=lambda: {k: {} for k in KINDS})

    @classmethod
    def of(cls, lists: list[RegisteredList]) -> "TakedownSet":
        out = cls()
        for lst in lists:
            for e in lst.entries:
                out.entries[e.kind].setdefault(e.value, (lst.version, e.reason))
        return out

    def __bool__(self) -> bool:
        return any(self.entries.values())

    @property
    def hashes(self) -> bool:
        return bool(self.entries["sha256"])

    def match(self, key: str | None, url: str | None, sha256: str | None = None) -> tuple[str, str, str, str | None] | None:
        """``(kind, value, list version, reason)`` of the first entry naming this sample, or None."""
        e = self.entries
        if key is not None:
            base = key.split("_", 1)[0]
            for k in (key, base):
                if k in e["key"]:
                    return ("key", k, *e["key"][k])
        if url is not None:
            if url in e["url"]:
                return ("url", url, *e["url"][url])
            if e["domain"]:
                host = _host(url)
                while host:
                    if host in e["domain"]:
                        return ("domain", host, *e["domain"][host])
                    host = host.partition(".")[2]
        if sha256 is not None and sha256.lower() in e["sha256"]:
            return ("sha256", sha256.lower(), *e["sha256"][sha256.lower()])
        return None


def _host(url: str) -> str:
    try:
        return (urlsplit(url.strip()).hostname or "").rstrip(".")
    except ValueError:
        return ""


_SETS: dict[tuple[str, ...], TakedownSet] = {}  # by the versions of the lists (built once per process)


def current_set(layout: Layout) -> TakedownSet:
    """The entries of every list registered under ``layout`` (empty when none is)."""
    lists = registered(layout)
    versions = tuple(lst.version for lst in lists)
    if versions not in _SETS:
        _SETS[versions] = TakedownSet.of(lists)
    return _SETS[versions]


_CONFIGURED: dict[tuple, str] = {}  # (list URL, size, change stamp) -> version registered from it


def takedown_set(layout: Layout, config_lists: tuple[str, ...] = ()) -> TakedownSet:
    """What a download must leave out: the config's lists (registered here if new, so a first run that
    names one never fetches its samples) and every list registered before."""
    for url in config_lists:
        seen = (layout.root, url, *storage.stat(url)) if storage.exists(url) else None
        # a list file not changed since it was registered here is not read again
        if seen is None or not storage.exists(layout.takedown_list(_CONFIGURED.get(seen, ""))):
            version = register(layout, read_list(url), url)
            if seen is not None:
                _CONFIGURED[seen] = version
    return current_set(layout)


def audit_records(layout: Layout) -> list[dict]:
    """Every audit record under ``layout``, oldest first (each with its ``url``)."""
    fs, folder = storage.url_to_fs(layout.takedown_audit_dir)
    if not fs.isdir(folder):
        return []
    out = []
    for path in sorted(fs.ls(folder, detail=False)):
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".json") and storage.TEMP_MARK not in name:
            url = storage.join(layout.takedown_audit_dir, name)
            out.append({"url": url, **json.loads(storage.read_bytes(url))})
    return out
