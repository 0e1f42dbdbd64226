"""Stopping a shard at once (SIGTERM/SIGINT, a Celery warm shutdown): the downloads in flight are
abandoned, queued ones never start, and the shard writes nothing, so the next run fetches it again.

Real parts only: a server on 127.0.0.1 that trickles a body (1 byte every 0.5 s) or never answers,
real sockets, a real subprocess interrupted by SIGINT, a real ``celery worker`` sent SIGTERM.
"""

import contextlib
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import uuid
from functools import partial

import pyarrow as pa
import pytest

from shardprep import fetch as fetch_module
from shardprep.config import config_from_dict
from shardprep.fetch import DownloadsAborted, abort_all, fetch, make_pool
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from shardprep.ordered import ordered_map
from shardprep.video.shards import write_video_shard
from tests.fixtures.configs import CHECKOUT
from tests.fixtures.services import rabbitmq_vhost  # noqa: F401 - fixture

TIMEOUT = 10  # per connect/read: a fetch of these URLs would take 3 x 10 s if nothing stopped it
PROMPT = 2.0  # seconds from the abort to the caller's exception (the bound; was 15-30 s)
DL_THREAD = "shardprep-dl"


class _SlowHandler(socketserver.BaseRequestHandler):
    """``/trickle/*``: headers, then the body 1 byte every 0.5 s; ``/stall/*``: never answers;
    ``/fast/*``: a 2-byte body at once."""

    def handle(self) -> None:
        server: _SlowServer = self.server  # type: ignore[assignment]
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = self.request.recv(4096)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ", 2)[1].decode()
            server.record(path)
            if path.startswith("/trickle/"):
                self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nContent-Length: 100000\r\n\r\n")
                while not server.stopping.wait(0.5):
                    self.request.sendall(b"\xff")
            elif path.startswith("/stall/"):
                server.stopping.wait()
            else:
                self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        except OSError:
            pass  # the client went away: what an abort does


class _SlowServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _SlowHandler)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.paths: list[str] = []

    def record(self, path: str) -> None:
        if path == "/robots.txt":  # the engine's, once per site and process (answered "ok": no rules)
            return
        with self._lock:
            self.paths.append(path)

    def hits(self) -> int:
        with self._lock:
            return len(self.paths)

    def wait_for_hits(self, n: int, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.hits() < n:
            assert time.monotonic() < end, f"only {self.hits()} of {n} requests reached the server"
            time.sleep(0.05)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


@pytest.fixture
def slow_server():
    server = _SlowServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _slow_urls(server: _SlowServer, n: int = 8) -> list[str]:
    return [server.url(f"/{'trickle' if i % 2 else 'stall'}/{i}") for i in range(n)]


def _download_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(DL_THREAD) and t.is_alive()]


def _files_under(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _dirs, files in os.walk(root) for f in files)


def _image_cfg(tmp_path):
    return config_from_dict(_fields(tmp_path))


def _image_rows(urls: list[str]) -> pa.Table:
    return pa.table({"url": urls, "caption": [f"caption {i}" for i in range(len(urls))]})


def _when_in_flight(server: _SlowServer, downloads: int, action) -> tuple[threading.Thread, list[float]]:
    """On another thread: once ``downloads`` requests reached ``server`` and have been blocked for
    ~1 s, run ``action``; the list gets the moment it ran."""
    fired: list[float] = []

    def run() -> None:
        server.wait_for_hits(downloads, 60)
        time.sleep(1.0)
        fired.append(time.monotonic())
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, fired


# ---------------------------------------------------------------- fetch and ordered_map


def test_a_fetch_on_an_aborted_pool_raises_without_touching_the_network(slow_server):
    pool = make_pool(2)
    pool.abort()
    start = time.monotonic()
    with pytest.raises(DownloadsAborted):
        fetch(slow_server.url("/fast/1"), pool=pool, timeout=TIMEOUT, allow_private=True)
    assert time.monotonic() - start < 0.5
    assert slow_server.hits() == 0


def _unanswered_connects():
    """A listening socket whose accept queue is full, so a new connect() hangs (SYNs are dropped);
    yields its port, or skips where this kernel does not make a connect hang that way."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(16):
            sock = socket.socket()
            fillers.append(sock)
            sock.settimeout(0.5)
            try:
                sock.connect(("127.0.0.1", port))
            except TimeoutError:
                return listener, fillers, port
        pytest.skip("could not fill the accept queue of a listening socket")
    except BaseException:
        for sock in [listener, *fillers]:
            sock.close()
        raise


def test_an_abort_also_stops_a_connect_in_progress():
    listener, fillers, port = _unanswered_connects()
    pool = make_pool(2)
    outcome: list = []

    def download() -> None:
        try:
            outcome.append(fetch(f"http://127.0.0.1:{port}/x", pool=pool, timeout=TIMEOUT, allow_private=True))
        except DownloadsAborted as e:
            outcome.append(e)

    try:
        thread = threading.Thread(target=download)
        thread.start()
        time.sleep(1.0)
        start = time.monotonic()
        pool.abort()
        thread.join(PROMPT)
        assert not thread.is_alive() and time.monotonic() - start < PROMPT
        assert isinstance(outcome[0], DownloadsAborted)
    finally:
        for sock in [listener, *fillers]:
            sock.close()


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: a library another test ran in this
    process (img2dataset) may have installed its own."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_while_waiting_in_ordered_map_abandons_the_downloads_at_once(slow_server, python_sigint):
    # SIGINT to the main thread while it waits for a result: what Dagster's run worker does on termination
    pool = make_pool(4)
    work = partial(fetch, pool=pool, timeout=TIMEOUT, allow_private=True)
    results = ordered_map(work, _slow_urls(slow_server), 4, 8, on_abort=pool.abort)
    main = threading.main_thread().ident
    thread, fired = _when_in_flight(slow_server, 4, lambda: signal.pthread_kill(main, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        next(results)
    stopped = time.monotonic()
    thread.join()
    assert stopped - fired[0] < PROMPT, f"ordered_map raised {stopped - fired[0]:.1f}s after the interrupt"
    assert pool.aborted
    assert _download_threads() == []
    time.sleep(0.3)  # a queued download that (wrongly) started would reach the server by now
    assert slow_server.hits() == 4, "the 4 queued downloads must never start"


def test_closing_ordered_map_early_abandons_the_downloads_at_once(slow_server):
    pool = make_pool(4)
    work = partial(fetch, pool=pool, timeout=TIMEOUT, allow_private=True)
    results = ordered_map(work, [slow_server.url("/fast/0"), *_slow_urls(slow_server)], 4, 8, on_abort=pool.abort)
    assert next(results) == (b"ok", None)
    slow_server.wait_for_hits(5, 60)  # the fast one, then 4 slow ones in flight (3 queued)
    time.sleep(1.0)
    start = time.monotonic()
    results.close()
    assert time.monotonic() - start < PROMPT
    assert pool.aborted and _download_threads() == []
    time.sleep(0.3)
    assert slow_server.hits() == 5


def test_ordered_map_without_an_abort_is_unchanged():
    assert list(ordered_map(lambda x: x * x, range(50), 4, 8)) == [x * x for x in range(50)]
    calls = []
    results = ordered_map(lambda x: x, range(10), 2, 4, on_abort=lambda: calls.append("abort"))
    assert list(results) == list(range(10))
    assert calls == []  # a consumer that reads to the end is no abort
    assert _download_threads() == []


# ---------------------------------------------------------------- shard writers


def test_abort_all_stops_an_image_shard_and_nothing_is_written(tmp_path, slow_server):
    cfg = _image_cfg(tmp_path)
    thread, fired = _when_in_flight(slow_server, 4, abort_all)
    with pytest.raises(DownloadsAborted, match="shard 00000: downloads abandoned .* left for the next run"):
        write_image_shard(_image_rows(_slow_urls(slow_server)), 0, cfg, Layout(cfg.output_root))
    stopped = time.monotonic()
    thread.join()
    assert stopped - fired[0] < PROMPT, f"the shard raised {stopped - fired[0]:.1f}s after abort_all()"
    assert _files_under(tmp_path / "out") == []  # no tar, parquet, stats or temp file
    assert _download_threads() == []
    assert slow_server.hits() == 4  # thread_count in flight; the queued rows never started


def test_a_video_shard_is_stopped_the_same_way(tmp_path, slow_server):
    cfg = config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"),
                            "video_url_col": "url", "video_caption_col": "caption", "timeout": TIMEOUT,
                            "retries": 0, "video_thread_count": 4, "allow_private_addresses": True})
    out = str(tmp_path / "out" / "videos")
    thread, fired = _when_in_flight(slow_server, 4, abort_all)
    with pytest.raises(DownloadsAborted, match="shard 00000: downloads abandoned"):
        write_video_shard(_image_rows(_slow_urls(slow_server)), 0, cfg, out)
    stopped = time.monotonic()
    thread.join()
    assert stopped - fired[0] < PROMPT
    assert _files_under(tmp_path / "out") == []
    assert _download_threads() == []
    assert slow_server.hits() == 4


def test_after_abort_all_refusing_new_pools_a_shard_fails_before_any_change(tmp_path, slow_server, monkeypatch):
    # the Celery hook's mode: a step that goes on to its next shard must not download again
    monkeypatch.setattr(fetch_module, "_REFUSE_NEW", threading.Event())  # this test's process state only
    cfg = _image_cfg(tmp_path)
    layout = Layout(cfg.output_root)
    os.makedirs(os.path.dirname(layout.shard_stats("00000")), exist_ok=True)
    with open(layout.shard_stats("00000"), "w") as f:
        f.write("{}")  # an older run's: left alone, the shard is not touched
    abort_all(refuse_new=True)
    assert make_pool(2).aborted
    start = time.monotonic()
    with pytest.raises(DownloadsAborted, match="shard 00000"):
        write_image_shard(_image_rows(_slow_urls(slow_server)), 0, cfg, layout)
    assert time.monotonic() - start < 0.5
    assert slow_server.hits() == 0
    assert _files_under(tmp_path / "out") == [layout.shard_stats("00000")]


# ---------------------------------------------------------------- real processes

_SHARD_SCRIPT = """
import faulthandler, json, signal, sys
faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if it does not stop in time
import pyarrow as pa
from shardprep.config import config_from_dict
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout

cfg = config_from_dict(json.loads(sys.argv[1]))
urls = json.loads(sys.argv[2])
write_image_shard(pa.table({"url": urls, "caption": ["c"] * len(urls)}), 0, cfg, Layout(cfg.output_root))
"""


def _env(*paths: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), *paths]), "PYTHONUNBUFFERED": "1"}


def _fields(tmp_path) -> dict:
    return {"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url",
            "caption_col": "caption", "samples_per_shard": 16, "timeout": TIMEOUT, "retries": 0,
            "thread_count": 4, "allow_private_addresses": True}


@contextlib.contextmanager
def _running(argv: list[str], cwd, env: dict[str, str]):
    """A process with its output in ``cwd/output.log``; killed on leaving if it still runs."""
    with open(os.path.join(cwd, "output.log"), "w") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _stop_within(proc: subprocess.Popen, sig: int, seconds: float) -> float:
    """Send ``sig``; seconds until ``proc`` exited (killed and failed if it takes longer than ``seconds``)."""
    start = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # where it is stuck, into its log (faulthandler)
        time.sleep(1)
        proc.kill()
        proc.wait()
        pytest.fail(f"the process was still running {seconds}s after {signal.Signals(sig).name}")
    return time.monotonic() - start


def test_sigint_stops_a_shard_process_at_once_and_nothing_is_written(tmp_path, slow_server):
    argv = [sys.executable, "-c", _SHARD_SCRIPT, json.dumps(_fields(tmp_path)), json.dumps(_slow_urls(slow_server))]
    try:
        with _running(argv, tmp_path, _env()) as proc:
            slow_server.wait_for_hits(4, 60)
            time.sleep(0.5)
            # the downloads stop within a second (the tests above); the rest is a Python process printing its
            # traceback and exiting, which a loaded 2-core machine may slow: the bound keeps well below the
            # 30 s (3 x timeout) the in-flight downloads took before
            seconds = _stop_within(proc, signal.SIGINT, 10)
    finally:
        output = (tmp_path / "output.log").read_text()
        print(output[-6000:])  # shown when the test fails: the stacks faulthandler wrote, if it hung
    assert proc.returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    assert seconds < 10
    assert _files_under(tmp_path / "out") == []
    assert slow_server.hits() == 4


_WORKER_MODULE = """
import os

import pyarrow as pa
from celery import Celery

import shardprep_dagster.orchestration.celery_app  # noqa: F401 - installs shardprep's worker_shutting_down hook
from shardprep_dagster.resources.executor import CELERY_SETTINGS
from shardprep.config import config_from_dict
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout

app = Celery("abort_test", broker=os.environ["ABORT_TEST_BROKER"])
app.conf.update(CELERY_SETTINGS)  # the shardprep workers' own


@app.task(name="abort_test.write_shard")
def write_shard(fields, urls):
    cfg = config_from_dict(fields)
    table = pa.table({"url": urls, "caption": ["c"] * len(urls)})
    return write_image_shard(table, 0, cfg, Layout(cfg.output_root)).successes
"""


def test_a_celery_warm_shutdown_abandons_the_downloads_and_the_worker_exits(tmp_path, slow_server,
                                                                           rabbitmq_vhost):  # noqa: F811
    # a minimal worker, not `shardprep worker` (that needs a Dagster instance and code location): the same
    # hook, installed by importing orchestration.celery_app, and the same pool (`--pool solo`, see
    # orchestration.distributed.worker_argv); the task is sent before the worker is up, so it runs
    # before the event loop's first turn (the slowest case for the loop to see the shutdown)
    from celery import Celery

    (tmp_path / "abort_worker.py").write_text(_WORKER_MODULE)
    queue = f"abort-test-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "celery", "-A", "abort_worker", "worker", "--pool", "solo", "-Q", queue,
            "-n", f"{queue}@{socket.gethostname()}", "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--loglevel", "INFO"]
    client = Celery("abort_test_client", broker=rabbitmq_vhost)
    try:
        with _running(argv, tmp_path, {**_env(str(tmp_path)), "ABORT_TEST_BROKER": rabbitmq_vhost}) as proc:
            client.send_task("abort_test.write_shard", args=[_fields(tmp_path), _slow_urls(slow_server)],
                             queue=queue)
            slow_server.wait_for_hits(4, 60)
            time.sleep(0.5)
            seconds = _stop_within(proc, signal.SIGTERM, 5)
    finally:
        client.close()
    output = (tmp_path / "output.log").read_text()
    assert "DownloadsAborted" in output and "shard 00000: downloads abandoned" in output, output[-3000:]
    assert proc.returncode == 0, output[-3000:]  # a warm shutdown's exit status
    assert seconds < 5
    assert _files_under(tmp_path / "out") == []
    assert slow_server.hits() == 4


_SIGNAL_ON_A_WORKER = """
import os, signal, sys, threading, time
from shardprep.ordered import ordered_map

stop, workers = threading.Event(), []

def slow(i):
    workers.append(threading.get_ident())
    stop.wait(30)
    return i

def deliver():  # the kernel may hand a process-directed SIGINT to any thread: here, a download thread
    while not workers:
        time.sleep(0.01)
    time.sleep(0.3)
    signal.pthread_kill(workers[0], signal.SIGINT)

threading.Thread(target=deliver, daemon=True).start()
start = time.monotonic()
try:
    for _ in ordered_map(slow, range(2), threads=2, max_in_flight=2, on_abort=stop.set):
        pass
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.2f} s", flush=True)
    sys.exit(0)
print("finished without an interrupt", flush=True)
sys.exit(1)
"""


def test_a_sigint_delivered_to_a_download_thread_still_stops_the_shard_at_once(tmp_path):
    # the main thread waits for results in short slices (shardprep.waiting): a signal that landed on a worker
    # is handled within a slice, not when the 30 s download ends
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_ON_A_WORKER], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seconds = float(proc.stdout.split("interrupted after ")[1].split()[0])
    assert seconds < 5, proc.stdout
