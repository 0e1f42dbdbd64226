"""The captioning loop shared by image and video shards: inputs decoded in a thread pool one batch ahead
of the model (PIL and FFmpeg release the GIL), a row per sample in tar order, a bad input a recorded skip."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import Any


def sample_text(sample: dict) -> str | None:
    """The sample's ``.txt`` (its original caption), or None."""
    data = sample.get("txt")
    return None if data is None else data.decode("utf-8", errors="replace")


def decode_failure(e: BaseException, what: str = "image") -> str:
    """The skip reason of an input that cannot be decoded (the captions' and the watermark scores' wording)."""
    return f"{what} decode failed: {type(e).__name__}: {e}"


def caption_in_batches(samples: Iterator[dict], row_of: Callable[[dict], dict], decode: Callable[[dict], Any],
                       generate: Callable[[list], list[str]], batch_size: int, threads: int = 0,
                       what: str = "image") -> list[dict]:
    """``row_of(sample)`` for each of ``samples``, in order, with its ``caption`` from ``generate`` (one call
    per batch of ``batch_size`` decoded inputs; ``decode(sample)`` runs in ``threads`` threads, 0: one per
    core). A sample whose decode raises keeps its row, ``skip_reason`` "{what} decode failed: ..."."""
    rows: list[dict] = []

    def run(batch: list[tuple[dict, Future]]) -> None:
        inputs, at = [], []
        for row, decoded in batch:
            try:
                inputs.append(decoded.result())
                at.append(len(rows))
            except Exception as e:  # noqa: BLE001 - a bad input is a recorded skip
                row["skip_reason"] = decode_failure(e, what)
            rows.append(row)
        if inputs:
            for i, text in zip(at, generate(inputs), strict=True):
                rows[i]["caption"] = text

    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(threads) as pool:
        ahead: list[tuple[dict, Future]] = []  # decoded while the model captions the batch before
        while True:
            started = [(row_of(s), pool.submit(decode, s)) for s in islice(samples, batch_size)]
            if ahead:
                run(ahead)
            if not started:
                break
            ahead = started
    return rows
