"""Webdataset tars, read and written: the one place shardprep handles tar bytes.

Reading is a chain of small stages, as in webdataset's ``tariterators.py``:

* ``iter_members(f, url)``: ``(name, bytes)`` of each regular member of a tar stream. Plain tars are
  parsed from their 512-byte headers (tarfile's per-member objects cost more than the rest of a
  sample's bookkeeping): USTAR prefixes, pax ``path``/``size`` records, GNU long names, base-256
  sizes. Compressed or unusual tars, detected on the first header, go through ``tarfile``.
* ``iter_headers(f, url)``: the same members without their payloads (``MemberHeader``: offset of the
  first header block, data offset, size; payloads are seeked over), then the end offset as the
  generator's return value: what energon's ``.tar.idx`` and sqlite record.
* ``group_samples(members, url, handler)``: consecutive members with one key form a sample
  (``shardprep.keys``: webdataset's and energon's rule; extensions lower-cased). Strict without a
  handler; with one, webdataset's ``tar_file_expander`` + ``group_by_keys`` semantics.

``list_tars`` lists a folder's complete tars; ``TarWriter`` writes one atomically through
``shardprep.storage``, with webdataset 0.2 ``TarWriter``'s headers or deterministic ones.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
import zlib
from typing import IO, Callable, Generator, Iterable, Iterator, NamedTuple

from shardprep import storage
from shardprep.errors import ShardprepError
from shardprep.keys import is_meta_member, split_member_name

INCOMPLETE_SUFFIX = ".INCOMPLETE"  # NeMo's sidecar of a tar still being filled
TAR_USER = TAR_GROUP = "bigdata"  # webdataset TarWriter's defaults
TAR_MODE = 0o444

_BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")  # tarfile's REGULAR_TYPES, less GNU sparse (refused below)
_EXTENDED = (b"x", b"g", b"L", b"K")  # pax and GNU headers that describe the next member
_SKIP_CHUNK = 1 << 20
_ZERO_BLOCK = bytes(_BLOCK)
_RECORD = 20 * _BLOCK  # tarfile.RECORDSIZE: a written tar's length is a multiple of it
# a tar is written through a buffer this large: one system call (and one hand-off of the GIL, which
# the writing thread then waits to get back from the download threads) every ~40 image samples, not
# one a sample
WRITE_BUFFER = 1 << 20
# the USTAR header fields around name, size and mtime that never change here (TarWriter's owner and mode)
_MODE_IDS = b"%07o\0%07o\0%07o\0" % (TAR_MODE, 0, 0)
_TAIL = (b"0" + bytes(100) + b"ustar\x0000" + TAR_USER.encode().ljust(32, b"\0")
         + TAR_GROUP.encode().ljust(32, b"\0") + bytes(16 + 155 + 12))
_TAIL_SUM = sum(_TAIL)


class TarReadError(ShardprepError, ValueError):
    """A tar cannot be read as a webdataset (unreadable, truncated, or samples not grouped)."""


class MemberHeader(NamedTuple):
    name: str
    offset: int  # first header block, incl. the pax/GNU headers before it (tarfile's ``offset``)
    data_offset: int
    size: int


# ---------------------------------------------------------------- members


class _NotPlainTar(Exception):
    """The stream does not start with a plain tar header (compressed?): read it with tarfile."""


def _number(field: bytes, url: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 (sizes over 8 GiB), as tarfile's nti
        n = int.from_bytes(field[1:], "big")
        return n - (256 ** (len(field) - 1)) if field[0] == 0xFF else n
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise TarReadError(f"{url}: not a readable tar (bad number field {field!r})") from None


def _checksum_ok(header: bytes) -> bool:
    stored = header[148:156].split(b"\0", 1)[0].strip()
    try:
        want = int(stored or b"-1", 8)
    except ValueError:
        return False
    if header.isascii():
        # every byte < 128, so the block's sum is < 65,521 and Adler-32's low half (1 + sum mod 65,521)
        # is 1 + the sum exactly, in C: sum() over 512 bytes was 40% of a header walk
        unsigned = (zlib.adler32(header) & 0xFFFF) - 1 - sum(header[148:156]) + 8 * 32
        return want == unsigned  # no byte > 127: the signed sum is the same
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32
    if want == unsigned:
        return True
    signed = unsigned - 256 * sum(1 for b in header[:148] + header[156:] if b > 127)  # some old tars
    return want == signed


def _read_exact(f, n: int, url: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TarReadError(f"{url}: not a readable tar (truncated {what}: {len(data)} of {n} bytes)")
    return data


def _skip(f, n: int, url: str, what: str) -> None:
    while n > 0:
        n -= len(_read_exact(f, min(n, _SKIP_CHUNK), url, what))


def _pax_records(payload: bytes, url: str) -> Iterator[tuple[str, str]]:
    pos = 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        try:
            length = int(payload[pos:space])
        except ValueError:
            raise TarReadError(f"{url}: not a readable tar (bad pax header)") from None
        record = payload[space + 1:pos + length - 1]  # drops the trailing newline
        key, _, value = record.partition(b"=")
        yield key.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
        pos += length


def _stream_size(f) -> int | None:
    """The length of a seekable stream (its position kept), or None: then payloads are read to skip them."""
    try:
        if not f.seekable():
            return None
        here = f.tell()
        size = f.seek(0, io.SEEK_END)
        f.seek(here)
        return size
    except (AttributeError, OSError, ValueError):
        return None


def _plain_tar(f, url: str, header: bytes, payloads: bool) -> Generator:
    """Regular members of an uncompressed tar whose first block is ``header``: ``(name, data)`` with
    ``payloads``, else ``MemberHeader`` (payloads seeked over); returns the end offset."""
    total = None if payloads else _stream_size(f)
    next_name: str | None = None
    next_size: int | None = None
    start: int | None = None  # first pax/GNU header of the member being read (tarfile's offset)
    pos = 0
    first = True
    while True:
        if not first:
            header = f.read(_BLOCK)
        elif not header:
            raise TarReadError(f"{url}: not a readable tar (empty file)")
        if not header or header == _ZERO_BLOCK:
            return pos  # end-of-archive (or a tar with no end blocks, which tarfile also accepts)
        if len(header) < _BLOCK:
            if first:
                raise _NotPlainTar
            raise TarReadError(f"{url}: not a readable tar (truncated header)")
        if not _checksum_ok(header):
            if first:
                raise _NotPlainTar
            raise TarReadError(f"{url}: not a readable tar (bad header checksum)")
        first = False
        here, pos = pos, pos + _BLOCK
        kind = header[156:157]
        size = _number(header[124:136], url)
        if kind not in _EXTENDED and next_size is not None:
            size = next_size
        padded = -(-size // _BLOCK) * _BLOCK
        if kind in _EXTENDED:
            payload = _read_exact(f, padded, url, "extended header")[:size]
            pos += padded
            if kind != b"g" and start is None:
                start = here  # a global header belongs to no member (tarfile keeps the next one's offset)
            if kind == b"L":
                next_name = payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == b"x":
                for key, value in _pax_records(payload, url):
                    if key == "path":
                        next_name = value
                    elif key == "size":
                        next_size = int(value)
            continue  # "g" (global) and "K" (link names) do not name regular members
        if kind == b"S":  # GNU sparse: never written by webdataset/img2dataset writers
            raise TarReadError(f"{url}: not a readable tar (GNU sparse member {header[:100]!r} unsupported)")
        if next_name is not None:
            name = next_name
        else:
            name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = header[345:500].split(b"\0", 1)[0]
            if prefix:  # tarfile applies it whatever the magic
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        offset = here if start is None else start
        next_name = next_size = start = None
        regular = kind in _REGULAR and not (kind == b"\0" and name.endswith("/"))
        if payloads and regular:
            data = _read_exact(f, size, url, f"member {name!r}")
            if padded > size:
                _read_exact(f, padded - size, url, f"member {name!r}")
            pos += padded
            yield name, data
            continue
        if regular:
            yield MemberHeader(name, offset, pos, size)
        if padded and total is not None:
            if pos + size > total:
                raise TarReadError(f"{url}: not a readable tar (truncated member {name!r}: "
                                   f"{max(0, total - pos)} of {size} bytes)")
            f.seek(pos + padded)
        elif padded:
            _skip(f, padded, url, f"member {name!r}")
        pos += padded


def _tarfile_members(f, url: str, payloads: bool) -> Generator:
    try:
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                if member.isreg():
                    if payloads:
                        yield member.name, tar.extractfile(member).read()
                    else:
                        yield MemberHeader(member.name, member.offset, member.offset_data, member.size)
            return tar.offset
    except tarfile.TarError as e:
        raise TarReadError(f"{url}: not a readable tar ({e})") from e


class _Prefixed:
    """A read-only stream: ``prefix`` bytes, then the rest of ``f`` (tarfile's stream mode only reads)."""

    def __init__(self, prefix: bytes, f):
        self.prefix, self.f = prefix, f

    def read(self, n: int = -1) -> bytes:
        if not self.prefix:
            return self.f.read(n)
        if n is None or n < 0:
            out, self.prefix = self.prefix + self.f.read(), b""
            return out
        out, self.prefix = self.prefix[:n], self.prefix[n:]
        return out + (self.f.read(n - len(out)) if len(out) < n else b"")


def _members(f, url: str, payloads: bool) -> Generator:
    first = f.read(_BLOCK)
    try:
        return (yield from _plain_tar(f, url, first, payloads))
    except _NotPlainTar:  # raised on the first header, before anything was yielded
        pass
    return (yield from _tarfile_members(_Prefixed(first, f), url, payloads))


def iter_members(f: IO[bytes], url: str) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of each regular member of the tar read from stream ``f``, in archive order
    (``url`` names the tar in errors)."""
    return _members(f, url, payloads=True)


def iter_headers(f: IO[bytes], url: str) -> Generator[MemberHeader, None, int]:
    """``MemberHeader`` of each regular member of the tar stream ``f``, payloads skipped (seeked
    over when ``f`` can seek); returns the end offset (where the end-of-archive blocks start)."""
    return _members(f, url, payloads=False)


def read_headers(url: str) -> tuple[list[MemberHeader], int]:
    """The member headers and end offset of the tar at ``url`` (``iter_headers``)."""
    # a 64 KiB buffer holds several small members, so a seek within it costs no read (8 KiB and fsspec's
    # file wrapper: ~20% of a header walk)
    with storage.open_read(url, buffer_size=1 << 16) as f:
        headers = iter_headers(f, url)
        members: list[MemberHeader] = []
        while True:
            try:
                members.append(next(headers))
            except StopIteration as done:
                return members, done.value


# ---------------------------------------------------------------- samples


def group_samples(members: Iterable[tuple[str, object]], url: str,
                  handler: Callable[[Exception], bool] | None = None) -> Generator[dict, None, bool]:
    """Samples ``{"__key__", "__url__", ext: value}`` of one tar's ``(name, value)`` members (value:
    the bytes, or a ``MemberHeader``), in tar order. Meta members (``__*__``) and names without an
    extension are skipped.

    Without ``handler`` (strict): a key appearing again later, or an extension twice in a sample,
    raises ``TarReadError`` naming the tar and key. With one: webdataset's ``tar_file_expander`` +
    ``group_by_keys``: a key may come back as a new sample, a duplicate extension and an unreadable
    tar go to ``handler`` (the unreadable tar after its last sample is yielded); returns False when
    the handler asked to stop, so the caller reads no further tar.
    """
    strict = handler is None
    seen: set[str] = set()
    current: dict | None = None
    try:
        for name, value in members:
            if is_meta_member(name):
                continue
            try:
                split = split_member_name(name)
                if split is None:
                    continue
                key, ext = split[0], split[1].lower()
                if current is None or key != current["__key__"]:
                    if current is not None:
                        yield current
                    if strict:
                        if key in seen:
                            raise TarReadError(f"{url}: duplicate sample key {key!r} (its members are not contiguous)")
                        seen.add(key)
                    current = {"__key__": key, "__url__": url}
                if ext in current:
                    if strict:
                        raise TarReadError(f"{url}: sample {key!r} has two '{ext}' members")
                    raise ValueError(f"{name}: duplicate file name in tar file {ext} {current.keys()}")
                current[ext] = value
            except Exception as exn:
                if strict:
                    raise
                if handler(exn):
                    continue
                return False
    except Exception as exn:  # the tar itself is unreadable: like webdataset, on to the next one
        if strict:
            raise
        exn.args = exn.args + (url,)
        if current is not None:
            yield current
        return bool(handler(exn))
    if current is not None:
        yield current
    return True


def iter_samples(url: str) -> Iterator[dict]:
    """Samples of the webdataset tar at ``url``, strictly grouped (``group_samples``): ``{"__key__":
    k, "__url__": url, ext: bytes, ...}``."""
    with storage.open_read(url) as f:
        yield from group_samples(iter_members(f, url), url)


def header_samples(url: str, handler: Callable[[Exception], bool] | None = None) -> tuple[list[dict], int]:
    """The samples of the tar at ``url`` from its headers only (``{ext: MemberHeader}``, payloads never
    read), grouped by ``group_samples`` (strict without ``handler``), and the archive's end offset."""
    headers, end = read_headers(url)
    return list(group_samples(((h.name, h) for h in headers), url, handler)), end


def read_samples_by_key(url: str, keys: set[str]) -> dict[str, dict[str, bytes]]:
    """``{key: {ext: bytes}}`` of the samples named in ``keys``: the headers are read, then only those
    samples' payloads (a few thumbnails out of a large tar cost a few reads, not the whole tar)."""
    samples, _ = header_samples(url, handler=lambda exn: True)
    return read_payloads(url, [s for s in samples if s["__key__"] in keys])


def read_payloads(url: str, samples: list[dict]) -> dict[str, dict[str, bytes]]:
    """``{key: {ext: bytes}}`` of ``samples`` (``header_samples``' dicts of the tar at ``url``), their
    payloads read in tar order, one open of the file."""
    out: dict[str, dict[str, bytes]] = {}
    if not samples:
        return out
    first = {id(s): min(h.data_offset for h in s.values() if isinstance(h, MemberHeader)) for s in samples}
    with storage.open_read(url) as f:
        for sample in sorted(samples, key=lambda s: first[id(s)]):
            members = {}
            for ext, header in sample.items():
                if isinstance(header, MemberHeader):
                    f.seek(header.data_offset)
                    members[ext] = f.read(header.size)
            out[sample["__key__"]] = members
    return out


def sample_keys(url: str) -> list[str]:
    """Sample keys of a tar in order, from its headers read to the end of the archive; a key whose
    members are not contiguous is listed each time it comes back (so checks can report duplicates)."""
    return [s["__key__"] for s in header_samples(url, handler=lambda exn: True)[0]]


# ---------------------------------------------------------------- folders


def list_tars(folder: str, *, skip_incomplete: bool = True, skip_empty: bool = False) -> list[str]:
    """``**/*.tar`` under ``folder``, relative and sorted (``energon prepare``'s glob).

    Hidden files and folders (``.nv-meta``, temps of atomic writes) are skipped, and so are tars
    with an ``.INCOMPLETE`` sidecar unless ``skip_incomplete=False``, and 0-byte ones with
    ``skip_empty`` (NeMo's wdinfo rule).
    """
    fs, root = storage.url_to_fs(folder)
    root = root.rstrip("/")
    found = {posixpath.relpath(p, root): info for p, info in fs.find(root, detail=True).items()}
    return sorted(
        rel for rel, info in found.items()
        if rel.endswith(".tar") and not any(part.startswith(".") for part in rel.split("/"))
        and not (skip_incomplete and rel + INCOMPLETE_SUFFIX in found)
        and not (skip_empty and not info.get("size"))
    )


def numbered_tars(folder: str) -> set[int]:
    """The ``n`` of every ``{n}.tar`` directly in ``folder`` (NeMo's balanced and precached tars)."""
    fs, root = storage.url_to_fs(folder)
    if not fs.isdir(root):
        return set()
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    return {int(n[:-4]) for n in names if n.endswith(".tar") and n[:-4].isdigit()}


# ---------------------------------------------------------------- writing


class TarWriter:
    """A webdataset tar at ``url``, written through ``storage.atomic_write`` and opened at the first
    sample: without a sample no tar is written (a stale one is removed with ``remove_stale``).

    Headers are USTAR, as webdataset 0.2's ``TarWriter`` writes them (mode 0o444, uname/gname
    ``bigdata``, mtime now), or with ``deterministic`` mtime 0 so re-runs give identical bytes.
    ``commit`` publishes the tar (end-of-archive blocks included); ``abort``, or an exception in a
    ``with`` block, publishes nothing and leaves no temp file.
    """

    def __init__(self, url: str, *, deterministic: bool = False, remove_stale: bool = False):
        self.url = url
        self.deterministic = deterministic
        self.remove_stale = remove_stale
        self.count = 0
        self.keys: list[str] = []
        self.bytes_written = 0  # the tar's size once committed
        self._cm = self._file = None
        self._offset = 0

    def __enter__(self) -> "TarWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.commit()
        else:
            self.abort(exc)

    def add(self, key: str, members: dict[str, bytes | str]) -> None:
        """Write one sample: members ``{key}.{ext}``, sorted by extension (str values as UTF-8)."""
        if self._file is None:
            self._cm = storage.atomic_write(self.url, buffering=WRITE_BUFFER)
            self._file = self._cm.__enter__()
        mtime = 0 if self.deterministic else int(time.time())
        parts = []
        for ext in sorted(members):
            value = members[ext]
            payload = value.encode("utf-8") if isinstance(value, str) else value
            parts.append(ustar_header(f"{key}.{ext}", len(payload), mtime))
            parts.append(payload)
            pad = -len(payload) % _BLOCK
            if pad:
                parts.append(_ZERO_BLOCK[:pad])
        sample = b"".join(parts)  # one write per sample: the file object's per-call cost, once
        self._file.write(sample)
        self._offset += len(sample)
        self.count += 1
        self.keys.append(key)

    def commit(self) -> bool:
        """Publish the tar; True if one was written."""
        if self._file is None:
            if self.remove_stale and self.count == 0:
                storage.remove(self.url)
            return False
        f, self._file = self._file, None
        # end-of-archive (two zero blocks), then zeros up to a whole record: what tarfile writes
        end = self._offset + 2 * _BLOCK
        f.write(bytes(2 * _BLOCK + (-end % _RECORD)))
        self.bytes_written = end + (-end % _RECORD)
        self._cm.__exit__(None, None, None)
        return True

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the tar being written (nothing is published, the temp file goes)."""
        if self._file is None:
            return
        self._file = None
        exc = exc if exc is not None else RuntimeError(f"{self.url}: tar write aborted")
        self._cm.__exit__(type(exc), exc, exc.__traceback__)


def ustar_header(name: str, size: int, mtime: int) -> bytes:
    """The 512-byte USTAR header ``tarfile.TarInfo.tobuf(USTAR_FORMAT)`` gives a regular file with
    webdataset TarWriter's owner and mode, built directly: tarfile's per-member objects (a copy per
    ``addfile``, its buffered stream re-slicing every payload) cost more than a 10,000-row shard's
    JSON. Names too long for the 100-byte field (a USTAR prefix split) go through tarfile."""
    raw = name.encode("utf-8")
    if len(raw) > 100 or size >= 8 ** 11 or not 0 <= mtime < 8 ** 11:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid = size, mtime, TAR_MODE, 0, 0
        info.uname, info.gname = TAR_USER, TAR_GROUP
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    head = raw.ljust(100, b"\0") + _MODE_IDS + b"%011o\0%011o\0" % (size, mtime)
    checksum = sum(head) + _TAIL_SUM + 8 * 32  # the checksum field counts as eight spaces
    return head + b"%06o\0 " % checksum + _TAIL




def rewrite_members(url: str, new_payload: Callable[[str, bytes], bytes | None],
                    wanted: Callable[[str], bool]) -> int:
    """Rewrite the plain tar at ``url`` with some members' payloads replaced: for each member whose name
    ``wanted`` accepts, ``new_payload(name, payload)`` gives its new bytes (None: kept as it is); every
    other member is copied byte for byte, headers included, and member order is kept. Returns the members
    replaced; none replaced: nothing written. Published atomically (``storage.atomic_write``)."""
    headers, _ = read_headers(url)
    replaced: dict[int, bytes] = {}
    with storage.open_read(url) as src:
        for i, h in enumerate(headers):
            if wanted(h.name):
                src.seek(h.data_offset)
                new = new_payload(h.name, src.read(h.size))
                if new is not None:
                    replaced[i] = new
    if not replaced:
        return 0
    written, mtime = 0, int(time.time())
    with storage.open_read(url) as src, storage.atomic_write(url) as out:
        for i, h in enumerate(headers):
            if i in replaced:
                payload = replaced[i]
                block = ustar_header(h.name, len(payload), mtime) + payload + bytes(-len(payload) % _BLOCK)
            else:
                src.seek(h.offset)
                block = src.read(h.data_offset - h.offset + h.size + (-h.size % _BLOCK))
            out.write(block)
            written += len(block)
        end = written + 2 * _BLOCK
        out.write(bytes(2 * _BLOCK + (-end % _RECORD)))
    return len(replaced)
