"""The shared skeleton of the encoders that turn a shard tar into model encodings.

CLIP embeddings (``shardprep.embeddings``), NeMo diffusion samples of images and of videos and NeMo's
precached encodings (``shardprep.nemo``) all do the same things around their models: check their
arguments, time themselves, remove their outputs when the input tar is gone, read the tar's samples,
prepare (decode) them in threads while the model encodes the previous ones, record the samples that
failed, encode in batches and write the results. That lives here, once; each encoder keeps only its
own preparation, encoding and output format.

Two ways to feed a model, because two kinds of batch exist:

* ``encode_tar`` (the three tar writers): a batch is ``batch_size`` *prepared* samples, failures left
  out, so a failure never changes which samples are encoded together (nor the bytes written);
* ``prepared_ahead`` (CLIP): a batch is a step of ``batch_size`` *read* samples, each with its fixed
  row in a reused image buffer, the next step prepared while the model encodes this one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Callable, Iterable, Iterator, NamedTuple, TypeVar

from shardprep import waiting
from shardprep.ordered import ordered_map
from shardprep.storage import exists, remove
from shardprep.tars import TarWriter, iter_samples

T = TypeVar("T")
R = TypeVar("R")

# A prepared item is a dict; one with a "reason" is a failure record {"key", "reason"}: the sample is
# reported as not encoded, never a crash.


def positive_int(name: str, value, *, multiple: int = 1) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) > 0 and a multiple of ``multiple``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % multiple:
        kind = "a positive integer" + (f" multiple of {multiple}" if multiple > 1 else "")
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def finish(report: R, start: float) -> R:
    """``report`` with its ``seconds`` set to the time since ``start`` (a ``time.perf_counter()``)."""
    report.seconds = time.perf_counter() - start
    return report


def input_missing(in_url: str, *outputs: str) -> bool:
    """True when ``in_url`` does not exist, after removing ``outputs``: what an earlier run wrote from
    that input must not outlive it."""
    if exists(in_url):
        return False
    for url in outputs:
        remove(url)
    return True


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of ``size``, the last one shorter; pulled lazily, one batch at a time."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _record(failure: dict, failures: list[dict]) -> None:
    failures.append({"key": failure["key"], "reason": failure["reason"]})


class Encoded(NamedTuple):
    read: int  # samples read from the input tar
    written: int  # samples in the output tar; 0: no tar was written (a stale one was removed)
    tar_bytes: int


def encode_tar(in_url: str, out_url: str, prepare: Callable[[dict], dict],
               encode_batch: Callable[[list[dict], TarWriter], None], *, batch_size: int, threads: int = 0,
               in_flight: int = 0, failures: list[dict] | None = None,
               encode_each: Callable[[dict], dict] | None = None) -> Encoded:
    """Encode the samples of the tar ``in_url`` into the tar ``out_url``.

    ``prepare(sample)`` runs on ``threads`` threads (0: in this thread, as the samples are read), at
    most ``in_flight`` samples ahead of the encoding, results in tar order; it returns an item or a
    failure record, which goes to ``failures`` (needed only where ``prepare`` or ``encode_each`` can
    return one). ``encode_each(item)``, if given, runs here on each item as it arrives and returns
    it (or a failure record). ``encode_batch(items, writer)`` gets them ``batch_size`` at a time and
    adds its samples to the writer.

    The tar is opened at the first sample added: no sample, no tar (a stale one is removed); it is
    published only when every batch is written. On an error or an interrupt, samples not yet being
    prepared are cancelled (``ordered_map``) and nothing is published.
    """
    read = 0

    def kept(items: Iterable[dict]) -> Iterator[dict]:
        nonlocal read
        for item in items:
            read += 1
            if encode_each is not None and "reason" not in item:
                item = encode_each(item)
            if "reason" in item:
                _record(item, failures)
                continue
            yield item

    def prepared() -> Iterator[dict]:
        if threads:
            yield from ordered_map(prepare, iter_samples(in_url), threads, in_flight)
        else:
            yield from map(prepare, iter_samples(in_url))

    # closed on leaving, error or not: ordered_map's threads are done with before the tar is dropped
    with TarWriter(out_url, remove_stale=True) as out, closing(prepared()) as items:
        for batch in batched(kept(items), batch_size):
            encode_batch(batch, out)
    return Encoded(read, out.count, out.bytes_written)


def prepared_ahead(batches: Iterable[list[dict]], prepare: Callable[[dict, int, int], dict], *, part: int,
                   threads: int, failures: list[dict]) -> Iterator[list[dict]]:
    """The prepared items of each batch of samples, in order, failures left out (to ``failures``); a
    list per batch, empty when all of it failed.

    ``prepare(sample, n, row)``: sample ``row`` of batch ``n``, on ``threads`` threads, ``part``
    samples per task (a future per sample costs more than preparing a small image). Batch ``n + 1`` is
    submitted before batch ``n`` is handed out, and batch ``n + 2`` only once the caller asks for
    the next one: the threads prepare the next batch while the caller encodes this one, never more,
    so a caller may have batch ``n`` prepared into buffer ``n % 2`` of two reused buffers.
    """
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardprep-prep")
    pending: list[list] = []

    def task(samples: list[dict], n: int, start: int) -> list[dict]:
        return [prepare(sample, n, row) for row, sample in enumerate(samples, start)]

    def ready(futures: list) -> list[dict]:
        items = []
        for fut in futures:
            for item in waiting.result(fut):
                if "reason" in item:
                    _record(item, failures)
                else:
                    items.append(item)
        return items

    try:
        for n, batch in enumerate(batches):
            pending.append([pool.submit(task, batch[i:i + part], n, i) for i in range(0, len(batch), part)])
            if len(pending) > 1:
                yield ready(pending.pop(0))
        while pending:
            yield ready(pending.pop(0))
    finally:
        # an error or an interrupt: the queued tasks never start, the running ones are waited for
        pool.shutdown(wait=True, cancel_futures=True)
