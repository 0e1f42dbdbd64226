"""Every byte shardprep reads or writes under an output root goes through here, on fsspec: local disk,
``memory://`` and ``s3://`` behave the same.

Writes are atomic: readers see the old file or the complete new one, never a part. Locally a hidden
temp file beside the target is fsynced and renamed over it; on object stores a local temp file is
uploaded in one put (objects appear atomically; a killed multipart upload never completes, so no
object appears). A temp file's name carries its writer (``.{name}.tmp-{random}-{pid}@{host}``), so a
later writer removes only the temps of writers that are gone, never those of a live one working on the
same target.

Object stores are reached with their driver's own configuration: for ``s3://`` (s3fs, botocore) the
standard AWS variables (``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles), or the dataset config's
``storage_options`` (``configure``), which win over them.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import inspect
import io
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import IO, Iterator

import fsspec
import numpy as np

TEMP_MARK = ".tmp-"
# a temp file of a writer on another machine is removed once it is this old (its writer cannot be asked)
FOREIGN_TEMP_SECONDS = 6 * 3600
_HOST = socket.gethostname()


def url_to_fs(url: str):
    """``(filesystem, path)`` of a URL. Listings are never cached: other processes (Dagster runs, a
    sensor's next tick, workers on other machines) write under the same root, and a cached listing hides
    their files (s3fs answers "no such file" for a new file in a folder it listed before) and sizes."""
    return fsspec.core.url_to_fs(url, use_listings_cache=False)


# ---------------------------------------------------------------- filesystem options


def configure(options: dict[str, dict]) -> None:
    """Make ``options`` the defaults of every filesystem of their protocol in this process, e.g.
    ``{"s3": {"endpoint_url": ..., "key": ..., "secret": ...}}`` (fsspec's own config: every later
    ``url_to_fs``, and any fsspec user in the process, gets them; explicit arguments still win)."""
    for protocol, opts in options.items():
        fsspec.config.conf[protocol] = dict(opts)


def option_problem(protocol: str, options: object) -> str | None:
    """What is wrong with ``options`` for filesystems of ``protocol`` (None: nothing). Unknown names are
    refused: fsspec drivers swallow any keyword, so a typo (``endpoint`` for ``endpoint_url``) would
    silently send requests to the default endpoint (AWS)."""
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        return f"{protocol!r}: its fsspec driver is not installed ({e})"
    except ValueError:
        return f"unknown protocol {protocol!r}"
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        return f"{protocol}: options must be a mapping of option names to values"
    known = _option_names(cls)
    for name, value in options.items():
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{protocol}: unknown option {name!r}{hint}"
        if name == "endpoint_url" and not (isinstance(value, str) and value.startswith(("http://", "https://"))):
            return f"{protocol}: endpoint_url must be an http:// or https:// URL, got {value!r}"
    return None


def _option_names(cls) -> set[str]:
    # the named parameters of the driver's constructors, and fsspec's own (listing cache, instance cache)
    names = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass is not object:
            params = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names - {"self"}


def is_local(url: str) -> bool:
    fs, _ = url_to_fs(url)
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def remove(url: str) -> bool:
    """Delete the file at ``url`` if there is one; True if something was deleted."""
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return False
    fs.rm(path)
    return True


def remove_tree(url: str) -> bool:
    """Delete a folder and everything under it, if it exists; True if something was deleted."""
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return False
    fs.rm(path, recursive=True)
    return True


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def stat(url: str) -> tuple[int, str]:
    """(size, stamp) of a file; the stamp changes whenever the file's content does (locally: whenever
    the file is rewritten)."""
    fs, path = url_to_fs(url)
    if is_local(url):
        st = os.stat(path)  # nanoseconds: fsspec's local mtime is a float of seconds
        return st.st_size, str(st.st_mtime_ns)
    info = fs.info(path)
    # an object's ETag is a digest of its content: it changes even within LastModified's one second
    keys = ("ETag", "etag", "mtime", "LastModified", "last_modified", "created")
    stamp = next((info[k] for k in keys if info.get(k)), "")
    return int(info["size"]), str(stamp)


def modified(url: str) -> float | None:
    """When the file was last written, in seconds since the epoch (None where the filesystem keeps no
    such time). Object stores keep whole seconds."""
    fs, path = url_to_fs(url)
    if is_local(url):
        return os.stat(path).st_mtime
    return _mtime(fs.info(path))


# ---------------------------------------------------------------- temp files and their writers


def _temp_name(path: str) -> str:
    head, base = os.path.split(path)
    return os.path.join(head, f".{base}{TEMP_MARK}{uuid.uuid4().hex[:12]}-{os.getpid()}@{_HOST}")


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with this pid exists and has not ended: a zombie (ended, not yet
    reaped by its parent) has."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # the state, after the name in brackets
    except (OSError, IndexError):  # no /proc (not Linux)
        return True


def writer_gone(temp_name: str, mtime: float | None = None, now: float | None = None) -> bool:
    """Whether the writer that named this temp file is gone: a dead process on this host, or (on
    another host, which cannot be asked) a file untouched for ``FOREIGN_TEMP_SECONDS``."""
    tail = temp_name.rsplit(TEMP_MARK, 1)[-1]
    _, _, owner = tail.partition("-")
    pid, _, host = owner.partition("@")
    if not pid.isdigit() or not host:
        return True  # not a name of ours: an older release's temp, whose writer is long gone
    if host == _HOST:
        return not pid_alive(int(pid))
    return mtime is not None and (now or time.time()) - mtime > FOREIGN_TEMP_SECONDS


def _mtime(info: dict) -> float | None:
    value = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return float(value) if isinstance(value, (int, float)) else None


def remove_temps(url: str) -> int:
    """Delete the temp files that gone writers of ``url`` left behind; returns how many."""
    fs, path = url_to_fs(url)
    head, base = os.path.split(path)
    if is_local(url):
        return _remove_local_temps(head, f".{base}{TEMP_MARK}")
    if not fs.exists(head):
        return 0
    removed = 0
    for p, info in fs.glob(f"{head}/.{base}{TEMP_MARK}*", detail=True).items():
        if writer_gone(os.path.basename(p), _mtime(info)):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(p)
                removed += 1
    return removed


def _remove_local_temps(folder: str, prefix: str = ".") -> int:
    removed = 0
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix) and TEMP_MARK in n]
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for name in names:
        path = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):
            if writer_gone(name, os.stat(path).st_mtime):
                os.remove(path)
                removed += 1
    return removed


_swept: set[str] = set()  # local folders this process has rid of gone writers' temps


def _sweep_once(folder: str) -> None:
    """Remove the temps of gone writers from ``folder`` the first time this process writes there.

    Not on every write: a listing per write made writing n files into one folder O(n^2) (1,000
    ``.tar.idx`` files: 22 s through fsspec's glob, which stats every entry), and an image folder holds
    a file per shard. A temp left by a writer killed later goes with the next process writing there."""
    if folder not in _swept:
        _remove_local_temps(folder)
        _swept.add(folder)


def remove_temps_under(root_url: str) -> int:
    """``remove_temps`` for every target under ``root_url`` (a folder), all depths."""
    fs, root = url_to_fs(root_url)
    if not fs.exists(root):
        return 0
    removed = 0
    for p, info in fs.find(root, detail=True, withdirs=False).items():
        name = os.path.basename(p)
        if name.startswith(".") and TEMP_MARK in name and writer_gone(name, _mtime(info)):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(p)
                removed += 1
    return removed


# ---------------------------------------------------------------- writing


@contextlib.contextmanager
def atomic_write(url: str, mode: str = "wb", buffering: int = -1) -> Iterator[IO]:
    """Write ``url`` so readers see either the old file or the complete new one, never a part.
    ``buffering``: ``open``'s, for the local file written.

    An exception inside the block (or a kill) publishes nothing; the temp file goes with it (a kill's
    temp is removed by the next process that writes into its folder). Elsewhere than on local disk the
    temp is a local file uploaded whole (``put_file``), so the target's folder never holds one.
    """
    fs, path = url_to_fs(url)
    if is_local(url):
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        _sweep_once(os.path.dirname(path))
        tmp = _temp_name(path)
        try:
            with open(tmp, mode, buffering) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        folder = _upload_dir()
        tmp = _temp_name(os.path.join(folder, "upload"))
        try:
            with open(tmp, mode, buffering) as f:
                yield f
            fs.put_file(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _upload_dir() -> str:
    """The local folder of object-store uploads in progress, rid of the temp files of writers that
    died (a killed writer cannot remove its own, and an image tar is large)."""
    folder = os.path.join(tempfile.gettempdir(), "shardprep-uploads")
    os.makedirs(folder, exist_ok=True)
    for entry in os.scandir(folder):
        with contextlib.suppress(FileNotFoundError):
            if TEMP_MARK in entry.name and writer_gone(entry.name, entry.stat().st_mtime):
                os.remove(entry.path)
    return folder


def publish_file(local_path: str, url: str) -> None:
    """Copy a finished local file to ``url`` atomically (e.g. a sqlite database built in a temp dir)."""
    with atomic_write(url) as out, open(local_path, "rb") as src:
        shutil.copyfileobj(src, out, 1 << 20)


def fetch_file(url: str, local_path: str) -> None:
    """Copy the file at ``url`` to a local path (e.g. a sqlite database to update in a temp dir)."""
    fs, path = url_to_fs(url)
    fs.get_file(path, local_path)


def write_bytes(url: str, data: bytes) -> None:
    with atomic_write(url) as f:
        f.write(data)


# ---------------------------------------------------------------- reading


def read_bytes(url: str) -> bytes:
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        return f.read()


def read_text(url: str) -> str | None:
    """The UTF-8 text of ``url``, or None when there is no such file."""
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except FileNotFoundError:
        return None


def open_read(url: str, buffer_size: int | None = None) -> IO[bytes]:
    """A binary stream of ``url`` (close it, or use it in a ``with``). ``buffer_size``: a local file is
    opened directly with that buffer, without fsspec's wrapper (for readers that make a call per few
    hundred bytes, e.g. a tar's header walk: a read and a seek per member)."""
    fs, path = url_to_fs(url)
    if buffer_size is not None and is_local(url):
        return open(path, "rb", buffering=buffer_size)
    return fs.open(path, "rb")


def read_npy(url: str, mmap: bool = False) -> np.ndarray:
    """An ``.npy`` array; ``mmap=True`` maps a local file instead of reading it (only the rows used are
    read from disk); other filesystems read the whole file either way."""
    if mmap and is_local(url):
        _, path = url_to_fs(url)
        return np.load(path, mmap_mode="r", allow_pickle=False)
    return np.load(io.BytesIO(read_bytes(url)), allow_pickle=False)


def read_parquet(url: str, columns: list[str] | None = None):
    """A parquet file as a pyarrow Table (only ``columns`` when given). ``ParquetFile``, not
    ``read_table``: the same table, without importing pyarrow.dataset and pandas on the way (~0.4
    CPU-seconds in each process that reads one: a run worker, a download process, the CLI). One thread:
    pyarrow 15's threaded read from a Python file object aborts the interpreter at its exit now and then
    ("terminate called without an active exception": exit status 134 in 4-7 of 10 fresh processes that
    read one small file and exit), and 20,000 URL rows read in 2.1 ms on one thread, 2.8 ms threaded."""
    import pyarrow.parquet as pq

    with open_read(url) as f:
        return pq.ParquetFile(f).read(columns=columns, use_threads=False)


def parquet_rows(url: str) -> int:
    """Row count from the parquet footer (reading the footer proves the file ends where it should)."""
    import pyarrow.parquet as pq

    with open_read(url) as f:
        return pq.ParquetFile(f).metadata.num_rows


def read_keyed(url: str, column: str, key: str = "key") -> dict | None:
    """``{key: value of column}`` of a parquet file's rows, or None when there is no file."""
    if not exists(url):
        return None
    t = read_parquet(url, [key, column])
    return dict(zip(t.column(key).to_pylist(), t.column(column).to_pylist()))


def write_parquet(url: str, table) -> None:
    import pyarrow.parquet as pq

    with atomic_write(url) as f:
        pq.write_table(table, f)


def write_npy(url: str, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    with atomic_write(url) as f:
        f.write(buf.getbuffer())


# ---------------------------------------------------------------- locks


@contextlib.contextmanager
def lock(root_url: str, name: str) -> Iterator[None]:
    """Serialise a read-modify-write of a file under ``root_url`` between processes of one machine
    (``flock`` on ``{root}/.shardprep/locks/{name}.lock``). An object store has no lock of its own: for
    one, the lock file is local (one folder per root URL in the temp folder), so the processes of one
    machine are serialised all the same; across machines, one process at a time must update a given file
    (the Dagster run that owns it)."""
    fs, root = url_to_fs(root_url)
    if is_local(root_url):
        folder = os.path.join(root, ".shardprep", "locks")
    else:
        digest = hashlib.sha256(fs.unstrip_protocol(root.rstrip("/")).encode("utf-8")).hexdigest()[:16]
        folder = os.path.join(tempfile.gettempdir(), "shardprep-locks", digest)
    os.makedirs(folder, exist_ok=True)
    with file_lock(os.path.join(folder, f"{name}.lock")):
        yield


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on the local file ``path`` for the block; the kernel releases it when the
    holder dies, however it dies, so a crash never leaves a stale lock."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
