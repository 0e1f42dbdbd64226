"""``shardprep.tars`` against its oracles: ``tarfile`` for members and offsets, webdataset's
``tar_file_expander`` + ``group_by_keys`` for grouping, webdataset's ``TarWriter`` for the bytes written."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import time
from pathlib import Path

import pytest
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from shardprep.errors import ShardprepError
from shardprep.tars import (
    INCOMPLETE_SUFFIX,
    MemberHeader,
    TarReadError,
    TarWriter,
    group_samples,
    iter_headers,
    iter_members,
    iter_samples,
    list_tars,
    read_headers,
    read_samples_by_key,
)

NAMES = [
    "a.jpg", "a.TXT", "d/b.json", "ü/ñame.txt",  # non-ASCII: a pax path record in PAX format
    "x" * 120 + "/long.jpg",  # a USTAR prefix (name > 100 bytes, directory <= 155)
    "__meta__.json", "noext", "k.seg.png",
]
LONG = "y" * 200 + ".txt"  # fits no USTAR header: GNU long name, or pax path


def _make_tar(path: Path, fmt: int, names=NAMES, gz: bool = False) -> Path:
    names = list(names) + ([LONG] if fmt != tarfile.USTAR_FORMAT else [])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for i, n in enumerate(names):
            data = bytes((i * 7 + j) % 256 for j in range(i * 300 % 1700))
            info = tarfile.TarInfo(n)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("somedir")
        info.type = tarfile.DIRTYPE
        t.addfile(info)
        info = tarfile.TarInfo("alink")  # a non-regular member after the last regular one
        info.type = tarfile.SYMTYPE
        info.linkname = "a.jpg"
        t.addfile(info)
    path.write_bytes(gzip.compress(buf.getvalue()) if gz else buf.getvalue())
    return path


def _members(path: Path) -> list[tuple[str, bytes]]:
    with open(path, "rb") as f:
        return list(iter_members(f, str(path)))


def _tarfile_members(path: Path) -> tuple[list[tuple[str, bytes]], list[MemberHeader], int]:
    with tarfile.open(path) as t:
        members = [m for m in t.getmembers() if m.isreg()]
        data = [(m.name, t.extractfile(m).read()) for m in members]
        return data, [MemberHeader(m.name, m.offset, m.offset_data, m.size) for m in members], t.offset


class _Unseekable(io.RawIOBase):
    def __init__(self, data: bytes):
        self._f = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, n=-1) -> bytes:
        return self._f.read(n)


FORMATS = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]


# ---------------------------------------------------------------- members and headers


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gz", [False, True])
def test_members_and_headers_match_tarfile(tmp_path, fmt, gz):
    path = _make_tar(tmp_path / "t.tar", fmt, gz=gz)
    data, headers, end = _tarfile_members(path)
    assert _members(path) == data
    if fmt == tarfile.PAX_FORMAT:
        assert "ü/ñame.txt" in dict(data) and LONG in dict(data)
    assert read_headers(str(path)) == (headers, end)  # offsets of the first header block (pax/GNU incl.)
    if not gz:
        assert any(h.offset != h.data_offset - 512 for h in headers) == (fmt != tarfile.USTAR_FORMAT)
    # a stream that cannot seek gives the same offsets (payloads read and dropped)
    stream = _Unseekable(path.read_bytes())
    got = iter_headers(stream, "u.tar")
    assert [next(got) for _ in headers] == headers
    with pytest.raises(StopIteration) as done:
        next(got)
    assert done.value.value == end


def test_base256_size_and_a_tar_without_end_blocks(tmp_path):
    path = _write_names(tmp_path / "t.tar", ["a.txt", "b.txt"])
    raw = bytearray(path.read_bytes())
    _, headers, end = _tarfile_members(path)
    first = headers[0].offset
    assert headers[0].data_offset == first + 512  # a plain USTAR header (PAX writes none for ASCII)
    raw[first + 124:first + 136] = b"\x80" + headers[0].size.to_bytes(11, "big")  # GNU base-256 size
    raw[first + 148:first + 156] = b" " * 8
    raw[first + 148:first + 156] = b"%06o\0 " % sum(raw[first:first + 512])
    (tmp_path / "b256.tar").write_bytes(bytes(raw))
    assert _members(tmp_path / "b256.tar") == _tarfile_members(tmp_path / "b256.tar")[0] == _members(path)
    (tmp_path / "noend.tar").write_bytes(bytes(raw[:end]))  # tarfile accepts a missing end, so do we
    assert _members(tmp_path / "noend.tar") == _members(path)
    assert read_headers(str(tmp_path / "noend.tar")) == (headers, end)


@pytest.mark.parametrize("mode", ["members", "headers"])
def test_truncated_tar_is_an_error_naming_the_file(tmp_path, mode):
    path = _make_tar(tmp_path / "t.tar", tarfile.PAX_FORMAT)
    data = path.read_bytes()
    _, headers, _ = _tarfile_members(path)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:headers[3].data_offset + 10])  # inside a member's payload
    with pytest.raises(TarReadError, match=r"cut\.tar.*truncated") as err:
        _members(cut) if mode == "members" else read_headers(str(cut))
    assert isinstance(err.value, ShardprepError) and isinstance(err.value, ValueError)
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(TarReadError, match=r"empty\.tar.*empty file"):
        _members(tmp_path / "empty.tar") if mode == "members" else read_headers(str(tmp_path / "empty.tar"))
    (tmp_path / "junk.tar").write_bytes(b"\x00" * 10 + b"not a tar at all" * 50)
    with pytest.raises(TarReadError, match=r"junk\.tar"):
        _members(tmp_path / "junk.tar") if mode == "members" else read_headers(str(tmp_path / "junk.tar"))
    bad = bytearray(data)
    bad[headers[1].offset + 10] ^= 0xFF  # the checksum of a later header no longer matches
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    with pytest.raises(TarReadError, match=r"bad\.tar.*checksum"):
        _members(tmp_path / "bad.tar") if mode == "members" else read_headers(str(tmp_path / "bad.tar"))


# ---------------------------------------------------------------- grouping


def _write_names(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for i, name in enumerate(names):
            data = f"{i}:{name}".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


GROUPING_CASES = {
    "plain": ["k1.jpg", "k1.TXT", "__meta__", "k2.jpg", "dir/k3.seg.png", "dir/k3.json", "noext", "k4.a.b",
              "__x__/k5.jpg", "k6..pth", "k6..json"],
    "key_again": ["a.jpg", "b.jpg", "a.txt", "c.jpg"],
    "dup_part": ["k.jpg", "k.JPG", "m.jpg"],
}


def _webdataset_samples(path: Path, handler) -> list[dict]:
    with open(path, "rb") as f:
        return list(group_by_keys(tar_file_expander([{"url": str(path), "stream": f}], handler=handler),
                                  handler=handler))


def _our_samples(path: Path, handler) -> list[dict]:
    with open(path, "rb") as f:
        return list(group_samples(iter_members(f, str(path)), str(path), handler=handler))


@pytest.mark.parametrize("case", sorted(GROUPING_CASES))
def test_handler_grouping_matches_webdataset(tmp_path, case):
    path = _write_names(tmp_path / f"{case}.tar", GROUPING_CASES[case])
    skip = wds.handlers.ignore_and_continue
    assert _our_samples(path, skip) == _webdataset_samples(path, skip)
    if case == "dup_part":
        for read in (_our_samples, _webdataset_samples):
            with pytest.raises(ValueError, match="duplicate file name"):
                read(path, wds.handlers.reraise_exception)
    else:
        assert _our_samples(path, wds.handlers.reraise_exception) == _webdataset_samples(path, skip)


def test_strict_grouping(tmp_path):
    path = _write_names(tmp_path / "plain.tar", GROUPING_CASES["plain"])
    assert list(iter_samples(str(path))) == _webdataset_samples(path, wds.handlers.reraise_exception)
    again = _write_names(tmp_path / "again.tar", GROUPING_CASES["key_again"])
    with pytest.raises(TarReadError, match=r"again\.tar: duplicate sample key 'a'"):
        list(iter_samples(str(again)))
    dup = _write_names(tmp_path / "dup.tar", GROUPING_CASES["dup_part"])
    with pytest.raises(TarReadError, match=r"dup\.tar: sample 'k' has two 'jpg' members"):
        list(iter_samples(str(dup)))
    # headers group the same way (what energon's scan and the checks use)
    headers, _ = read_headers(str(path))
    by_header = list(group_samples(((h.name, h) for h in headers), str(path)))
    assert [sorted(s) for s in by_header] == [sorted(s) for s in iter_samples(str(path))]


def test_unreadable_tar_goes_through_the_handler_after_its_last_sample(tmp_path):
    path = _write_names(tmp_path / "t.tar", ["a.jpg", "a.txt", "b.jpg", "b.txt"])
    _, headers, _ = _tarfile_members(path)
    (tmp_path / "cut.tar").write_bytes(path.read_bytes()[:headers[3].data_offset + 1])
    seen = []

    def handler(exn):
        seen.append(exn)
        return True

    with open(tmp_path / "cut.tar", "rb") as f:
        gen = group_samples(iter_members(f, "cut.tar"), "cut.tar", handler=handler)
        got = []
        with pytest.raises(StopIteration) as done:
            while True:
                got.append(next(gen))
    assert [s["__key__"] for s in got] == ["a", "b"] and set(got[1]) == {"__key__", "__url__", "jpg"}
    assert len(seen) == 1 and isinstance(seen[0], TarReadError) and done.value.value is True


# ---------------------------------------------------------------- writing


SAMPLES = [("000000001", {"txt": "caption", "jpg": b"\xff\xd8jpeg", "json": '{"a": 1}'}),
           ("000000002", {"txt": "two", "jpg": b"\xff\xd8" * 400, "json": "{}"}),
           ("000000003", {".pth": b"latent", ".json": "{}", ".pickle": b"p"})]


def _webdataset_tar(mtime=None) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf, encoder=False, mtime=mtime) as sink:
        for key, members in SAMPLES:
            sink.write({"__key__": key, **{k: v.encode() if isinstance(v, str) else v for k, v in members.items()}})
    return buf.getvalue()


def _write(url: str, **kw) -> TarWriter:
    with TarWriter(url, **kw) as out:
        for key, members in SAMPLES:
            out.add(key, members)
    return out


def test_writer_bytes_equal_webdatasets_tarwriter(tmp_path, monkeypatch):
    out = _write(str(tmp_path / "det.tar"), deterministic=True)
    data = (tmp_path / "det.tar").read_bytes()
    assert data == _webdataset_tar(mtime=0)
    assert out.count == 3 and out.keys == [k for k, _ in SAMPLES] and out.bytes_written == len(data)
    _write(str(tmp_path / "det2.tar"), deterministic=True)
    assert (tmp_path / "det2.tar").read_bytes() == data  # re-runs give identical bytes
    # webdataset 0.2.111's TarWriter drops its format argument: tarfile's default PAX adds an mtime
    # record for a float time, so the clock is frozen on a whole second (then PAX bytes are USTAR's)
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000)
    _write(str(tmp_path / "now.tar"))
    assert (tmp_path / "now.tar").read_bytes() == _webdataset_tar()
    names = [n for n, _ in _members(tmp_path / "now.tar")]
    assert names[:3] == ["000000001.jpg", "000000001.json", "000000001.txt"]  # sorted by extension
    assert names[6:] == ["000000003..json", "000000003..pickle", "000000003..pth"]
    with tarfile.open(tmp_path / "now.tar") as t:
        m = t.getmembers()[0]
        assert (m.mode, m.uname, m.gname, m.mtime) == (0o444, "bigdata", "bigdata", 1_700_000_000)
    loaded = list(wds.WebDataset(str(tmp_path / "now.tar"), shardshuffle=False))
    assert [s["__key__"] for s in loaded] == [k for k, _ in SAMPLES]
    assert loaded[0]["txt"] == b"caption" and loaded[2][".pth"] == b"latent"


def test_writer_without_samples_writes_no_tar(tmp_path):
    target = tmp_path / "out" / "00000.tar"
    with TarWriter(str(target)) as out:
        pass
    assert not target.parent.exists() or not target.exists()
    assert out.count == 0 and out.bytes_written == 0
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(b"stale")
    with TarWriter(str(target)):
        pass
    assert target.read_bytes() == b"stale"  # left alone unless asked
    with TarWriter(str(target), remove_stale=True):
        pass
    assert not target.exists()


def test_writer_publishes_nothing_on_error(tmp_path):
    target = tmp_path / "00000.tar"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="boom"):
        with TarWriter(str(target), remove_stale=True) as out:
            out.add(*SAMPLES[0])
            raise RuntimeError("boom")
    assert target.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["00000.tar"]  # no temp file left
    out = TarWriter(str(target))
    out.add(*SAMPLES[0])
    out.abort()
    assert target.read_bytes() == b"previous" and sorted(os.listdir(tmp_path)) == ["00000.tar"]


# ---------------------------------------------------------------- folders


def test_list_tars(tmp_path):
    for rel in ["00001.tar", "00000.tar", "sub/00002.tar", "part.tar", ".hidden.tar", ".nv-meta/x.tar",
                "sub/.tmp/00003.tar", "notes.txt", "00000.tar.idx"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / ("part.tar" + INCOMPLETE_SUFFIX)).write_bytes(b"")
    (tmp_path / "empty.tar").write_bytes(b"")
    assert list_tars(str(tmp_path)) == ["00000.tar", "00001.tar", "empty.tar", "sub/00002.tar"]
    assert list_tars(str(tmp_path), skip_incomplete=False) == [
        "00000.tar", "00001.tar", "empty.tar", "part.tar", "sub/00002.tar"]
    assert list_tars(str(tmp_path), skip_empty=True) == ["00000.tar", "00001.tar", "sub/00002.tar"]
    assert list_tars(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_samples_read_by_key_are_the_streamed_ones(tmp_path, fmt):
    """Headers first, then only the wanted samples' payloads, by offset: the same bytes as a full read."""
    import io as _io

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        for i in range(6):
            long = 120 if fmt != tarfile.USTAR_FORMAT else 90  # GNU/PAX: a long-name header before it
            key = f"{'k' * (long if i == 3 else 1)}{i:03d}"
            for ext, data in (("jpg", bytes([i]) * (700 + i)), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, _io.BytesIO(data))
    streamed = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in iter_samples(str(path))}
    wanted = {list(streamed)[1], list(streamed)[3], "missing"}
    assert read_samples_by_key(str(path), wanted) == {k: streamed[k] for k in wanted if k in streamed}
    assert read_samples_by_key(str(path), {"missing"}) == {}


@pytest.mark.parametrize("name", ["000000001.jpg", "a" * 96 + ".jpg", "a" * 97 + ".jpg", "dir/" * 30 + "x.json",
                                  "键/ключ.txt", "000000003..pth"])
@pytest.mark.parametrize("size,mtime", [(0, 0), (511, 1), (512, 1_700_000_000), (8 ** 11 - 1, 8 ** 11 - 1),
                                        (8 ** 11, 0), (10 ** 12, 1_700_000_000)])
def test_headers_are_tarfiles(name, size, mtime):
    """The writer's own USTAR headers equal tarfile's, byte for byte, long names (prefix split)
    included; what USTAR cannot hold (a name with no split, a size past the octal field) is the same
    ValueError."""
    from shardprep.tars import TAR_MODE, ustar_header

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, mtime, TAR_MODE, 0, 0
    info.uname = info.gname = "bigdata"
    try:
        expected = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e)):
            ustar_header(name, size, mtime)
    else:
        assert ustar_header(name, size, mtime) == expected


def test_header_checksum_agrees_with_tarfile():
    """``_checksum_ok`` (Adler-32's exact sum for ASCII blocks, the byte sum otherwise, the signed sum of
    old tars) accepts and refuses the same 512-byte blocks as tarfile, corrupted ones included."""
    import random

    from shardprep.tars import _checksum_ok

    rng = random.Random(7)

    def tarfile_accepts(block: bytes) -> bool:
        try:
            tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return False
        return True

    blocks = []
    for i in range(3000):
        name = "".join(rng.choice("ab/.x09é键\x7f") for _ in range(rng.randint(1, 90)))
        info = tarfile.TarInfo(name)
        info.size, info.mtime = rng.randint(0, 10 ** 9), rng.randint(0, 2 ** 33)
        block = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")[-512:]
        blocks.append(block)
        corrupt = bytearray(block)
        corrupt[rng.randrange(512)] = rng.randrange(256)  # often changes the sum, sometimes a > 127 byte
        blocks.append(bytes(corrupt))
    signed = bytearray(tarfile.TarInfo("old.txt").tobuf(tarfile.USTAR_FORMAT))  # an old tar summing signed chars
    signed[5] = 200
    rest = signed[:148] + signed[156:]
    signed[148:156] = b"%06o\0 " % (sum(rest) + 8 * 32 - 256 * sum(b > 127 for b in rest))
    blocks.append(bytes(signed))
    verdicts = [(_checksum_ok(b), tarfile_accepts(b)) for b in blocks]
    assert all(ours == theirs for ours, theirs in verdicts)
    assert 2000 < sum(ours for ours, _ in verdicts) < len(blocks)  # both kinds were seen
    assert _checksum_ok(bytes(signed)) and not bytes(signed).isascii()
