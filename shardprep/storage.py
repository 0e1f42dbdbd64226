"""fsspec storage helpers: atomic writes (temp + rename) that work on local disk and object stores."""

import contextlib
import os
import tempfile
import uuid
from typing import IO, Iterator

import fsspec

TEMP_MARK = ".tmp-"


def url_to_fs(url: str):
    return fsspec.core.url_to_fs(url)


def is_local(url: str) -> bool:
    fs, _ = url_to_fs(url)
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def _temp_name(path: str) -> str:
    head, base = os.path.split(path)
    return os.path.join(head, f".{base}{TEMP_MARK}{uuid.uuid4().hex[:12]}")


def remove_temps(url: str) -> int:
    """Delete temp files a crashed writer of ``url`` left behind; returns how many."""
    fs, path = url_to_fs(url)
    head, base = os.path.split(path)
    if not fs.exists(head):
        return 0
    stale = fs.glob(f"{head}/.{base}{TEMP_MARK}*")
    for p in stale:
        fs.rm(p)
    return len(stale)


@contextlib.contextmanager
def atomic_write(url: str, mode: str = "wb") -> Iterator[IO]:
    """Write ``url`` so readers see either the old file or the complete new one, never a part.

    Local files: a hidden temp file beside the target, fsynced, then ``os.replace``.
    Object stores: a local temp file uploaded in one put (objects appear atomically).
    """
    fs, path = url_to_fs(url)
    remove_temps(url)
    if is_local(url):
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = _temp_name(path)
        try:
            with open(tmp, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        with tempfile.NamedTemporaryFile(mode, delete=False, suffix=TEMP_MARK) as f:
            tmp = f.name
            try:
                yield f
            except BaseException:
                f.close()
                os.remove(tmp)
                raise
        try:
            fs.put_file(tmp, path)
        finally:
            os.remove(tmp)


def write_bytes(url: str, data: bytes) -> None:
    with atomic_write(url) as f:
        f.write(data)


def read_bytes(url: str) -> bytes:
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        return f.read()
