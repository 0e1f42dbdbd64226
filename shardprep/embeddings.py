"""CLIP embeddings of one image shard, written in clip-retrieval's inference layout.

One shard tar -> ``img_emb/img_emb_<shard>.npy``, ``text_emb/text_emb_<shard>.npy`` (float16 [N, D],
L2-normalised) and ``metadata/metadata_<shard>.parquet`` (``image_path`` = sample key, ``caption``,
the sample json flattened), rows in tar order and aligned 1:1 — what clip-retrieval writes with
``input_format="webdataset"``, ``enable_metadata=True`` and ``output_partition_count == #tars``.

Throughput (issue 5, bench/RESULTS.md): tars are read by ``shardprep.tars``' direct 512-byte-header
parser (``tarfile`` for compressed ones), samples are decoded, preprocessed and tokenised in a thread
pool while the model encodes the previous step (``shardprep.encode.prepared_ahead``; ``encoders`` module
doc for the fast preprocess), and on CPU the cores are split between decoding and torch. With a GPU they
are prepared in worker processes instead (``shardprep.prepare_pool``): threads share one GIL with the
pure-Python tokenizer and cannot keep up with the model.
"""

from __future__ import annotations

import io
import os
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np

from shardprep.clip_samples import ShardReadError, prepare_sample
from shardprep.encode import batched, finish, input_missing, positive_int, prepared_ahead
from shardprep.layout import Layout
from shardprep.prepare_pool import pool_for
from shardprep.storage import atomic_write, remove, write_npy
from shardprep.tars import iter_samples

if TYPE_CHECKING:
    from shardprep.models.clip import ClipEncoder
    from shardprep.pixels import PixelPass

_CHUNK = 16  # samples per pool task: amortises the future overhead, still spreads over threads


@dataclass
class EmbeddingReport:
    shard: str
    samples: int
    dim: int
    seconds: float
    norm_min: float | None = None
    norm_max: float | None = None
    nan_count: int = 0
    # samples left out, as clip-retrieval leaves them out: no image, no caption, undecodable image
    skipped: list[dict] = field(default_factory=list)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


GPU_DECODE_THREADS = 8


def thread_split(device: str) -> tuple[int, int]:
    """(decode threads, torch threads): a decode thread per core (they idle while a batch is being
    encoded), and with the model on the CPU torch gets half the cores: its pool on every core,
    next to busy decode threads, spends more time spinning than computing (measured on 2 cores:
    2 torch threads were slower than 1). With a GPU torch's CPU threads are left alone."""
    cores = _cores()
    if device == "cpu":
        return max(2, cores), max(1, cores // 2)
    # With a GPU at most GPU_DECODE_THREADS: past that the threads fight over the GIL (the caption BPE is
    # pure Python) and more of them prepare fewer images (bench/GPU.md: 16 vCPUs of an H200 host, 8
    # threads 1,287 images/s, 16 threads 1,013; ViT-B/32 end to end 1,135 vs 928)
    return max(2, min(cores, GPU_DECODE_THREADS)), 0


# On the CPU the model runs on steps of at most this many samples, so decoding the next step
# overlaps the model from the first step of a shard on (a step of a whole small shard would leave
# no overlap at all); rows are independent, so the step size does not change the embeddings.
CPU_STEP = 64


def metadata_frame(keys: list[str], captions: list[str] | None, metas: list[dict]):
    """clip-retrieval's writer.py with enable_metadata: image_path, caption, json_normalize(json) minus dups."""
    import pandas as pd

    data = {"image_path": keys}
    if captions is not None:
        data["caption"] = captions
    df = pd.DataFrame(data)
    parsed = pd.json_normalize(metas)
    parsed = parsed.drop(columns=list({"caption", "metadata", "image_path"} & set(parsed.columns)))
    return df.join(parsed)


def _outputs(layout: Layout, shard: str) -> tuple[str, str, str]:
    return layout.img_emb(shard), layout.text_emb(shard), layout.emb_metadata(shard)


@contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block (0: unchanged); process-wide, like torch."""
    if n <= 0:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_clip_embeddings(shard: str, layout: Layout, encoder: "ClipEncoder", batch_size: int = 256,
                          enable_text: bool = True, prepare_processes: int | None = None,
                          pixels: "PixelPass | None" = None) -> EmbeddingReport:
    """Embed every sample of ``layout.tar(shard)`` with ``encoder`` and write the
    clip-retrieval files for that shard. A missing or sample-less tar writes nothing (and removes
    stale outputs), like clip-retrieval, whose writer skips empty partitions.

    ``prepare_processes``: worker processes that prepare the samples (0: threads); by default
    ``SHARDPREP_PREPARE_PROCESSES`` or the cores minus 2 with a GPU, threads on CPU
    (``prepare_pool.processes_for``). The embeddings are the same either way.

    ``pixels``: the run's other pixel models, fed from the same decode of each image (``shardprep.pixels``);
    then the samples are prepared in threads (the decoded images stay in this process for those models)."""
    positive_int("batch_size", batch_size)
    start = time.perf_counter()
    tar_url = layout.tar(shard)
    report = EmbeddingReport(shard=shard, samples=0, dim=encoder.dim, seconds=0.0)
    if input_missing(tar_url, *_outputs(layout, shard)):
        return finish(report, start)

    import torch

    keys: list[str] = []
    captions: list[str] = []
    metas: list[dict] = []
    img_chunks: list = []  # float16 tensors, on the GPU until the shard is done
    txt_chunks: list = []
    seen_captions = False

    step = batch_size if encoder.device != "cpu" else min(batch_size, CPU_STEP)

    def steps() -> Iterator[list[dict]]:
        nonlocal seen_captions
        for raw in batched(iter_samples(tar_url), step):
            seen_captions = seen_captions or any("txt" in s for s in raw)
            yield raw

    # Fast preprocessing writes into two reused batch buffers (fresh ones per step cost page faults):
    # step n is prepared into buffer n % 2 while the model encodes step n - 1 from the other one.
    buffers = [encoder.new_image_buffer(step) for _ in range(2)] if encoder.fast_preprocess else [None, None]

    def prepare(sample: dict, n: int, slot: int) -> dict:
        buffer = buffers[n % 2]
        row = None if buffer is None else buffer[slot]
        if pixels is not None:
            item = pixels.prepare(sample, n, slot, encoder, enable_text, tar_url, row)
        else:
            item = prepare_sample(sample, encoder, enable_text, tar_url, row)
        item["slot"] = slot
        return item

    def encode(ready: list[dict], buffer) -> None:
        if buffer is None:
            images = [it["image"] for it in ready]
        else:
            slots = [it["slot"] for it in ready]
            # the buffer's first rows when nothing was skipped, else a copy of the rows that decoded
            images = buffer[: len(slots)] if slots[-1] == len(slots) - 1 else buffer[slots]
        tokens = torch.cat([it["tokens"] for it in ready]) if enable_text else None
        # queued on a GPU, not waited for: the next step is prepared while the GPU computes this one
        img, txt = encoder.encode_step(images, tokens)
        img_chunks.append(img)
        if enable_text:
            txt_chunks.append(txt)
            captions.extend(it["caption"] for it in ready)
        keys.extend(it["key"] for it in ready)
        metas.extend(it["meta"] for it in ready)

    # decode+preprocess of the next step runs in worker processes or threads while the model encodes the
    # current one (PIL, OpenCV and torch release the GIL for the heavy parts, the tokenizer does not)
    decode_threads, torch_threads = thread_split(encoder.device)
    with pool_for(encoder, 0 if pixels is not None else prepare_processes, enable_text, step) as processes:
        if processes is not None:
            prepared = processes.prepared(steps(), buffers, url=tar_url, shard=shard, failures=report.skipped)
        else:
            prepared = prepared_ahead(steps(), prepare, part=_CHUNK, threads=decode_threads,
                                      failures=report.skipped)
        with _torch_threads(torch_threads), closing(prepared):
            for n, ready in enumerate(prepared):  # a list per step, in order
                if ready:
                    encode(ready, buffers[n % 2])
                if pixels is not None:  # its models on the step, while the threads decode the next one
                    pixels.run(n)
            if pixels is not None:
                pixels.flush()

    if enable_text and report.skipped and not seen_captions:
        raise ShardReadError(
            f"shard {shard}: {tar_url} has no .txt captions, so every sample was skipped; "
            "set enable_text to false for datasets without captions"
        )
    if not keys:  # a shard that now has no samples must not keep embeddings from an earlier run
        for url in _outputs(layout, shard):
            remove(url)
        return finish(report, start)

    img = torch.cat(img_chunks).cpu().numpy()  # the one wait for the GPU
    arrays = [img] + ([torch.cat(txt_chunks).cpu().numpy()] if enable_text else [])
    norms = np.concatenate([np.linalg.norm(a.astype(np.float32), axis=1) for a in arrays])
    report.samples = len(keys)
    report.dim = int(img.shape[1])
    report.nan_count = int(sum(np.isnan(a).sum() for a in arrays))
    report.norm_min = float(np.nanmin(norms)) if np.isfinite(norms).any() else None
    report.norm_max = float(np.nanmax(norms)) if np.isfinite(norms).any() else None

    df = metadata_frame(keys, captions if enable_text else None, metas)
    write_npy(layout.img_emb(shard), img)
    if enable_text:
        write_npy(layout.text_emb(shard), arrays[1])
    else:
        remove(layout.text_emb(shard))  # a text file from an earlier run would no longer align with the metadata
    buf = io.BytesIO()
    df.to_parquet(buf)
    with atomic_write(layout.emb_metadata(shard)) as f:
        f.write(buf.getbuffer())
    return finish(report, start)
