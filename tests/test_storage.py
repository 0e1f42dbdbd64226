"""storage: atomic writes on local disk and memory://, temp files removed only when their writer is gone."""

import os
import subprocess
import sys
import threading
import time

import fsspec
import numpy as np
import pytest

from shardprep import storage


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    url = f"memory://storage-test-{os.getpid()}-{tmp_path.name}"
    yield url
    fsspec.filesystem("memory").rm(url, recursive=True)


def test_atomic_write_publishes_all_or_nothing(root):
    url = f"{root}/a/b.bin"
    storage.write_bytes(url, b"old")
    with pytest.raises(RuntimeError):
        with storage.atomic_write(url) as f:
            f.write(b"half of the new")
            raise RuntimeError("writer failed")
    assert storage.read_bytes(url) == b"old"
    fs, path = storage.url_to_fs(f"{root}/a")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)] == ["b.bin"]  # no temp file left
    storage.write_npy(f"{root}/x.npy", np.arange(6, dtype=np.float16).reshape(2, 3))
    assert storage.read_npy(f"{root}/x.npy").tolist() == [[0, 1, 2], [3, 4, 5]]
    assert storage.read_npy(f"{root}/x.npy", mmap=True).shape == (2, 3)
    assert storage.read_text(f"{root}/missing.txt") is None
    assert storage.remove(url) and not storage.remove(url) and not storage.exists(url)


def test_a_live_writers_temp_file_is_never_removed(tmp_path):
    """Two writers of one target: the second must not delete the first one's temp file mid-write."""
    url = str(tmp_path / "out.tar")
    started, release = threading.Event(), threading.Event()
    errors = []

    def slow_writer():
        try:
            with storage.atomic_write(url) as f:
                f.write(b"first")
                started.set()
                release.wait(10)
                f.write(b" writer")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=slow_writer)
    t.start()
    started.wait(10)
    storage.write_bytes(url, b"second writer")  # same process: its writer is alive, its temp stays
    release.set()
    t.join(10)
    assert errors == [] and storage.read_bytes(url) == b"first writer"

    # another live process's temp stays too; a dead process's temp goes
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".out.tar{storage.TEMP_MARK}aaaaaaaaaaaa-{child.pid}@{storage._HOST}"
        live.write_bytes(b"x")
        dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout.strip()
        dead = tmp_path / f".out.tar{storage.TEMP_MARK}bbbbbbbbbbbb-{dead_pid}@{storage._HOST}"
        dead.write_bytes(b"x")
        legacy = tmp_path / f".out.tar{storage.TEMP_MARK}0123456789ab"  # an older release's name
        legacy.write_bytes(b"x")
        assert storage.remove_temps(url) == 2
        assert live.exists() and not dead.exists() and not legacy.exists()
    finally:
        child.kill()
        child.wait()
    assert storage.remove_temps(url) == 1 and not live.exists()


def test_foreign_temps_go_only_when_old():
    name = f".t.tar{storage.TEMP_MARK}cccccccccccc-123@another-host"
    now = time.time()
    assert not storage.writer_gone(name, mtime=now - 60, now=now)
    assert storage.writer_gone(name, mtime=now - storage.FOREIGN_TEMP_SECONDS - 1, now=now)
    assert not storage.writer_gone(name, mtime=None, now=now)


def test_publish_file_failure_leaves_the_old_file(tmp_path, monkeypatch):
    import errno
    import shutil

    target = str(tmp_path / "meta" / "index.sqlite")
    storage.write_bytes(target, b"old index")
    src = tmp_path / "new.sqlite"
    src.write_bytes(b"n" * 4096)

    def disk_full(fsrc, fdst, length=0):
        fdst.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", disk_full)
    with pytest.raises(OSError):
        storage.publish_file(str(src), target)
    assert storage.read_bytes(target) == b"old index"
    assert [p.name for p in (tmp_path / "meta").iterdir()] == ["index.sqlite"]


def test_lock_serialises_processes(tmp_path):
    code = ("import sys, time\nfrom shardprep import storage\n"
            "with storage.lock(sys.argv[1], 'x'):\n"
            "    open(sys.argv[2], 'a').write('in ')\n    time.sleep(0.3)\n    open(sys.argv[2], 'a').write('out ')\n")
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(log)]) for _ in range(3)]
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    assert log.read_text().split() == ["in", "out"] * 3


def test_a_folder_is_swept_for_gone_writers_once_per_process(tmp_path, monkeypatch):
    """n atomic writes into one folder list it once, not once each (fsspec's glob per write stat-ed every
    entry: writing 1,000 ``.tar.idx`` files took 22 s); a gone writer's temp still goes, with the first
    write of each process into the folder."""
    folder = tmp_path / "many"
    folder.mkdir()
    dead = folder / f".0.bin{storage.TEMP_MARK}0123456789ab"  # an older release's name: its writer is gone
    dead.write_bytes(b"x")
    listed = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: listed.append(str(p)) or real_listdir(p))
    for i in range(50):
        storage.write_bytes(str(folder / f"{i}.bin"), b"%d" % i)
    assert listed == [str(folder)] and not dead.exists()
    assert sorted(real_listdir(folder)) == sorted(f"{i}.bin" for i in range(50))

    dead.write_bytes(b"x")  # left after this process swept the folder: the next process removes it
    storage.write_bytes(str(folder / "50.bin"), b"50")
    assert dead.exists()
    code = "import sys; from shardprep import storage; storage.write_bytes(sys.argv[1], b'51')"
    subprocess.run([sys.executable, "-c", code, str(folder / "51.bin")], check=True)
    assert not dead.exists() and (folder / "51.bin").read_bytes() == b"51"
