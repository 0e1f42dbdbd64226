"""CLIP samples prepared in worker processes: the GPU path of ``shardprep.embeddings``.

Why: with a GPU the model outruns threads that prepare its input. JPEG decoding and OpenCV release the GIL,
but the caption's BPE (openai's pure-Python tokenizer) and PIL's Python parts do not, so past ~8 threads
more threads prepare fewer images (bench/GPU.md: 16 vCPUs, 1,287 images/s at best against ViT-L/14's
2,023). Worker processes each have their own GIL, as clip-retrieval's DataLoader workers do.

How: one pool per process, started on first use and kept for every shard (a worker's start, importing
torch and the tokenizer, takes seconds). The parent reads the tar and sends chunks of raw samples (~20 KB
each); a worker decodes, resizes and crops each image into its row of a uint8 shared-memory batch buffer
(``models.clip.crop_into``), tokenises the caption and sends back ``clip_samples.prepare_sample``'s small records
with the row's ``slot`` instead of the image (and the token ids as numpy). The parent copies the rows into
the encoder's own batch buffer (page-locked with a GPU; normalised float32 on CPU, where only tests ask
for processes) and encodes as the thread path does: same pixels, same ids, the same embeddings.

Two shared buffers rotate as the two page-locked ones do: step n is prepared into buffer n % 2 while the
model encodes step n - 1, and step n + 2 is sent only once step n has been copied out.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from shardprep import waiting
from shardprep.errors import ShardprepError

if TYPE_CHECKING:
    from shardprep.models.clip import ClipEncoder, ImageSpec

log = logging.getLogger(__name__)

PROCESSES_ENV = "SHARDPREP_PREPARE_PROCESSES"  # worker processes with a GPU; 0: threads
CHUNK = 8  # samples per task: 32 tasks for a step of 256 spread over ~14 workers, ~160 KB of bytes each
# A step whose preparing is not done this long after the parent asks for it has a hung worker (a dead
# one is reported at once): preparing a step of 256 images takes a second on one core.
READY_TIMEOUT_SECONDS = 300.0


class PrepareWorkerError(ShardprepError, RuntimeError):
    """A worker process that prepares CLIP samples died or hung; the pool is started afresh next time."""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_processes() -> int:
    """``SHARDPREP_PREPARE_PROCESSES`` if set, else the cores this process may use minus 2 (the parent
    reads the tar, copies rows and drives the GPU; the executor's threads pickle), at least 1."""
    raw = os.environ.get(PROCESSES_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{PROCESSES_ENV} must be an integer >= 0, got {raw!r}")
        return n
    return max(1, _cores() - 2)


def processes_for(encoder: "ClipEncoder", requested: int | None) -> int:
    """How many worker processes prepare for ``encoder`` (0: threads). ``requested`` (an argument of
    ``write_clip_embeddings``) wins, on CPU too (the tests use that); by default only with a GPU, where
    the model waits for the CPU: on CPU the model needs the cores. Needs the fast preprocess (a
    uint8 row per image); ``encoder.exact()`` keeps the per-image preprocess, in threads."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 0):
        raise ValueError(f"prepare_processes must be an integer >= 0, got {requested!r}")
    if not encoder.fast_preprocess:
        return 0
    if requested is not None:
        return requested
    return default_processes() if encoder.device != "cpu" else 0


# --- the tokenizer, sent to the workers once -------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _clip_tokenize():
    import clip

    return functools.partial(clip.tokenize, truncate=True)


def portable_tokenizer(tokenizer):
    """``tokenizer`` in a form that pickles. all_clip's openai and hf_clip loaders return a local closure
    ``tokenizer(t) = clip.tokenize(t, truncate=True)``, which pickle cannot send: it is replaced by that
    very call as a ``functools.partial`` (the worker's ``clip`` module builds the same BPE). open_clip's
    tokenizers (``SimpleTokenizer``, ``HFTokenizer``) are objects that pickle as they are."""
    qualname = getattr(tokenizer, "__qualname__", "")
    if getattr(tokenizer, "__module__", "").startswith("all_clip.") and qualname in (
            "load_hf_clip.<locals>.tokenizer", "load_openai_clip.<locals>.tokenizer"):
        return _clip_tokenize()
    return tokenizer


_TOKENIZERS: dict[int, tuple[object, str | None]] = {}  # id -> (tokenizer, its pickle file or None)
_TOKENIZER_DIR: list[tuple[int, str]] = []  # (pid that made it, folder)


def _tokenizer_file(tokenizer) -> str | None:
    """A file holding ``tokenizer`` pickled, written once per tokenizer (open_clip's is 2 MB: sent with
    every task it would cost more than the images) and read once by each worker; None when it does not
    pickle: then that encoder is prepared in threads."""
    tokenizer = portable_tokenizer(tokenizer)
    got = _TOKENIZERS.get(id(tokenizer))
    if got is None:
        try:
            blob = pickle.dumps(tokenizer)
        except Exception:  # noqa: BLE001 - any tokenizer that does not pickle: threads prepare for it
            path = None
        else:
            if not _TOKENIZER_DIR:
                _TOKENIZER_DIR.append((os.getpid(), tempfile.mkdtemp(prefix="shardprep-tokenizers-")))
            path = os.path.join(_TOKENIZER_DIR[0][1], f"tokenizer-{len(_TOKENIZERS)}.pkl")
            with open(path, "wb") as f:
                f.write(blob)
        got = _TOKENIZERS[id(tokenizer)] = (tokenizer, path)  # the object is kept: its id stays its own
    return got[1]


# --- the worker side -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """What a task needs besides its samples (small: pickled with each task)."""

    url: str
    enable_text: bool
    spec: "ImageSpec"
    tokenizer: str | None  # the pickle file of the tokenizer (None: no text)
    buffers: tuple[str, ...]  # shared memory names, step n in buffers[n % len]
    shape: tuple[int, int, int, int]  # [step, 3, H, W]


_W_TOKENIZERS: dict[str, object] = {}
_W_BUFFERS: "OrderedDict[str, tuple[SharedMemory, np.ndarray]]" = OrderedDict()


def _init_worker() -> None:
    # Ctrl-C reaches the whole process group: the parent handles it (and shuts the pool down), a worker
    # that died of it would only turn the interrupt into a BrokenProcessPool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import cv2

    cv2.setNumThreads(1)  # a process per core already; OpenCV's own threads would oversubscribe them


def _worker_rows(name: str, shape: tuple) -> np.ndarray:
    """The shared buffer ``name`` as an array, attached once per worker; the least recently used of more
    than 4 is detached (a buffer replaced by the parent for another step size stays mapped until then)."""
    if name not in _W_BUFFERS:
        shm = SharedMemory(name=name)
        _W_BUFFERS[name] = (shm, np.ndarray(shape, np.uint8, shm.buf))
        while len(_W_BUFFERS) > 4:
            old, _ = _W_BUFFERS.popitem(last=False)[1]
            try:
                old.close()
            except BufferError:  # a view still alive: the mapping goes with the worker
                pass
    _W_BUFFERS.move_to_end(name)
    return _W_BUFFERS[name][1]


class _RowWriter:
    """What ``clip_samples.prepare_sample`` uses of an encoder, without the model."""

    def __init__(self, spec: "ImageSpec", tokenizer):
        self.image_spec = spec
        self.tokenizer = tokenizer

    def prepare_image(self, data: bytes, out: np.ndarray) -> np.ndarray:
        from shardprep.models.clip import crop_into

        return crop_into(data, self.image_spec, out)


def _prepare_chunk(job: _Job, n: int, start: int, samples: list[dict]) -> list[dict]:
    """Samples ``start``... of step ``n`` prepared into their rows of the step's shared buffer; the records
    of ``clip_samples.prepare_sample`` (skips as they are; a bad .json raises its ShardReadError, re-raised in
    the parent), the image replaced by its row's ``slot``."""
    from shardprep.clip_samples import prepare_sample

    tokenizer = None
    if job.tokenizer is not None:
        tokenizer = _W_TOKENIZERS.get(job.tokenizer)
        if tokenizer is None:
            with open(job.tokenizer, "rb") as f:
                tokenizer = _W_TOKENIZERS[job.tokenizer] = pickle.load(f)
    writer = _RowWriter(job.spec, tokenizer)
    rows = _worker_rows(job.buffers[n % len(job.buffers)], job.shape)
    out = []
    for slot, sample in enumerate(samples, start):
        item = prepare_sample(sample, writer, job.enable_text, job.url, rows[slot])
        if "reason" not in item:
            del item["image"]  # a view of the shared row: the parent reads the row itself
            item["slot"] = slot
            if item["tokens"] is not None:
                item["tokens"] = item["tokens"].numpy()  # a tensor would pickle its storage machinery
        out.append(item)
    return out


# --- the parent side -------------------------------------------------------------------------------------------


class _Pool:
    def __init__(self, processes: int):
        self.processes = processes
        self.pid = os.getpid()
        self.busy = threading.Lock()  # one shard at a time: the shared buffers are the pool's
        self.shape: tuple | None = None
        self.shms: list[SharedMemory] = []
        self.closed = False
        # spawn, never fork: the parent has CUDA initialised and torch's threads running, which a forked
        # child inherits broken
        self.executor = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker)
        # every worker started now (the executor starts them one per submit with no idle worker), so a
        # shard never waits for a start, and a worker that cannot start fails here
        try:
            for fut in [self.executor.submit(os.getpid) for _ in range(processes)]:
                _result(fut, time.monotonic() + READY_TIMEOUT_SECONDS, "starting the preparing workers")
        except BaseException:
            self.close()
            raise

    def healthy(self) -> bool:
        """No worker died: the executor notices a death only once no result is pending, so each is asked."""
        procs = list((self.executor._processes or {}).values())
        return not self.executor._broken and len(procs) == self.processes and all(p.is_alive() for p in procs)

    def pids(self) -> list[int]:
        # the executor's own table of its workers (private, but the only one: a task's os.getpid() need
        # not reach every worker)
        return sorted(self.executor._processes or {})

    def buffers(self, shape: tuple) -> list[SharedMemory]:
        """Two shared buffers of ``shape``, kept for the next shard of the same step size (no fresh pages
        to fault in, for the parent or the workers). OSError when /dev/shm has no room for them."""
        if shape != self.shape:
            self._free_buffers()
            size = int(np.prod(shape))
            try:
                for _ in range(2):
                    self.shms.append(SharedMemory(create=True, size=size))
                    # the pages reserved now: a full /dev/shm (Docker gives 64 MB) raises ENOSPC here,
                    # where touching an unreserved page later would kill the process with SIGBUS
                    os.posix_fallocate(self.shms[-1]._fd, 0, size)
            except OSError:
                self._free_buffers()
                raise
            self.shape = shape
        return self.shms

    def _free_buffers(self) -> None:
        for shm in self.shms:
            try:
                shm.close()
            except BufferError:  # a view still alive (an interrupted shard): the mapping goes at exit
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self.shms, self.shape = [], None

    def close(self, kill: bool = False) -> None:
        self.closed = True
        if kill:  # a hung worker would keep shutdown() waiting
            for proc in list((self.executor._processes or {}).values()):
                proc.kill()
        self.executor.shutdown(wait=not kill, cancel_futures=True)
        self._free_buffers()


_POOL: list[_Pool] = []  # the process's pool, at most one
_POOL_LOCK = threading.Lock()


def _discard(pool: _Pool, kill: bool = False) -> None:
    with _POOL_LOCK:
        if _POOL and _POOL[0] is pool:
            _POOL.clear()
    pool.close(kill=kill)


def shutdown() -> None:
    """Stop the process's pool (a later shard starts a new one); run at interpreter exit."""
    with _POOL_LOCK:
        pools = list(_POOL)
        _POOL.clear()
    for pool in pools:
        if pool.pid == os.getpid():  # one inherited through a fork is the parent's to stop
            pool.close()


def _at_exit() -> None:
    shutdown()
    for pid, folder in _TOKENIZER_DIR:
        if pid == os.getpid():
            shutil.rmtree(folder, ignore_errors=True)


atexit.register(_at_exit)


def _acquire(processes: int) -> _Pool | None:
    """The process's pool of ``processes`` workers, held (``busy``) for one shard; None when another
    thread of this process holds it (that shard's caller then prepares in threads)."""
    with _POOL_LOCK:
        pool = _POOL[0] if _POOL else None
        if pool is not None and pool.pid != os.getpid():
            # inherited through a fork: its threads and pipes belong to the parent, never touch them
            _POOL.clear()
            pool = None
        if pool is not None and (pool.processes != processes or not pool.healthy()):
            if not pool.busy.acquire(blocking=False):
                return None
            _POOL.clear()
            pool.busy.release()
            pool.close(kill=True)
            pool = None
        if pool is None:
            pool = _Pool(processes)
            _POOL.append(pool)
        return pool if pool.busy.acquire(blocking=False) else None


def worker_pids() -> list[int]:
    """The pids of the pool's workers (empty when none is running): for tests and benchmarks."""
    with _POOL_LOCK:
        return _POOL[0].pids() if _POOL else []


def _result(fut: Future, deadline: float, what: str):
    """``fut.result()``, waking in slices (a pending signal's handler runs, ``shardprep.waiting``); a
    worker that died raises BrokenProcessPool at once, one that hangs past ``deadline`` a
    PrepareWorkerError."""
    while True:
        try:
            return fut.result(timeout=waiting.SLICE_SECONDS)
        except TimeoutError:
            if fut.done():
                return fut.result()
            if time.monotonic() > deadline:
                raise PrepareWorkerError(
                    f"{what}: a worker process did not answer in {READY_TIMEOUT_SECONDS:.0f} s") from None


@contextmanager
def pool_for(encoder: "ClipEncoder", requested: int | None, enable_text: bool,
             step: int) -> Iterator["Preparer | None"]:
    """A ``Preparer`` on the process's worker pool for one shard of ``encoder`` in steps of ``step``
    samples, or None where threads prepare: ``processes_for`` says 0, the tokenizer does not pickle,
    another thread has the pool, or /dev/shm has no room for the step's buffers (logged)."""
    processes = processes_for(encoder, requested)
    tokenizer = _tokenizer_file(encoder.tokenizer) if processes and enable_text else None
    if not processes or (enable_text and tokenizer is None):
        yield None
        return
    pool = _acquire(processes)
    if pool is None:
        yield None
        return
    try:
        try:
            shms = pool.buffers((step, 3, *encoder.image_spec.crop))
        except OSError as e:
            log.warning("preparing in threads: no room for two shared buffers of %d images in /dev/shm (%s)",
                        step, e)
            yield None
        else:
            yield Preparer(pool, encoder, tokenizer, enable_text, shms)
    finally:
        pool.busy.release()


class Preparer:
    def __init__(self, pool: _Pool, encoder: "ClipEncoder", tokenizer: str | None, enable_text: bool,
                 shms: list[SharedMemory]):
        self.pool, self.encoder, self.tokenizer, self.enable_text = pool, encoder, tokenizer, enable_text
        self.shms = shms

    def prepared(self, batches: Iterable[list[dict]], buffers: list[np.ndarray], *, url: str, shard: str,
                 failures: list[dict]) -> Iterator[list[dict]]:
        """``encode.prepared_ahead``'s contract, in processes: the prepared items of each step of samples
        (a list per step, in tar order, skips left out to ``failures``), step n's image rows in
        ``buffers[n % 2]`` at their items' ``slot``, token ids as tensors."""
        import torch

        shms = self.shms
        shape = (len(buffers[0]), 3, *self.encoder.image_spec.crop)
        job = _Job(url, self.enable_text, self.encoder.image_spec, self.tokenizer, tuple(s.name for s in shms),
                   shape)
        views = [np.ndarray(shape, np.uint8, s.buf) for s in shms]
        what = f"shard {shard} ({url})"
        pending: list[tuple[int, int, list[Future]]] = []  # (step, samples, futures)

        def died(e: BaseException) -> PrepareWorkerError:
            _discard(self.pool, kill=True)  # its buffers are freed: nothing waits for its tasks
            return PrepareWorkerError(f"{what}: a worker process preparing its samples died ({e}); "
                                      "the pool is started afresh for the next shard")

        def ready(n: int, count: int, futures: list[Future]) -> list[dict]:
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            items = []
            for fut in futures:
                try:
                    chunk = _result(fut, deadline, what)
                except BrokenProcessPool as e:
                    raise died(e) from None
                except PrepareWorkerError:
                    _discard(self.pool, kill=True)
                    raise
                for item in chunk:
                    if "reason" in item:
                        failures.append({"key": item["key"], "reason": item["reason"]})
                        continue
                    if item["tokens"] is not None:
                        item["tokens"] = torch.from_numpy(item["tokens"])
                    items.append(item)
            # out of shared memory now: the workers may fill buffer n % 2 with step n + 2 next
            self.encoder.fill_image_rows(buffers[n % 2][:count], views[n % 2][:count])
            return items

        try:
            for n, batch in enumerate(batches):
                try:
                    futures = [self.pool.executor.submit(_prepare_chunk, job, n, i, batch[i:i + CHUNK])
                               for i in range(0, len(batch), CHUNK)]
                except BrokenProcessPool as e:  # a worker died while the parent read the tar
                    raise died(e) from None
                pending.append((n, len(batch), futures))
                if len(pending) > 1:
                    yield ready(*pending.pop(0))
            while pending:
                yield ready(*pending.pop(0))
        finally:
            # an error or an interrupt: queued tasks never start; the running ones are waited for, since
            # they write into the buffers that the next shard uses
            running = [f for _, _, futures in pending for f in futures if not f.cancel()]
            if running and not self.pool.closed and not _finished(running):
                _discard(self.pool, kill=True)


def _finished(futures: list[Future]) -> bool:
    """Whether ``futures`` all finish (any outcome) within READY_TIMEOUT_SECONDS; waits in slices."""
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if not wait(futures, timeout=waiting.SLICE_SECONDS).not_done:
            return True
    return False
