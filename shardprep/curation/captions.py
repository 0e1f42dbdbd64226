"""Synthetic captions of one image shard, from a vision-language model (``shardprep.models.captioner``);
a video shard's, a caption per clip from its frame strip, in ``curation.video_captions``.

``layout.tar(shard)`` -> ``layout.captions(shard)`` (``<root>/captions/{shard}.parquet``), one row per
sample of the tar, in tar order:

* ``key``: the sample's key;
* ``caption``: the model's caption (null when the sample was skipped);
* ``original_caption``: the sample's ``.txt`` (null when it has none);
* ``model``: the captioner as configured; ``prompt``: the prompt given (null: unconditional);
* ``skip_reason``: null, or why there is no caption (no image member, or it cannot be decoded): a bad
  image is a recorded skip, never an error, and every sample keeps its row.

Images are decoded in a thread pool (PIL releases the GIL), one batch ahead of the model. The file is
written atomically; a shard without a tar (no sample downloaded) gets no file, and a stale one is removed.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

from shardprep.clip_samples import IMAGE_EXTS, image_ext
from shardprep.curation.caption_batches import caption_in_batches, sample_text
from shardprep.layout import Layout
from shardprep.storage import exists, read_parquet, remove, write_parquet

COLUMNS = ("key", "caption", "original_caption", "model", "prompt", "skip_reason")


@dataclass
class CaptionsReport:
    shard: str
    samples: int = 0  # rows written (every sample of the tar)
    captioned: int = 0
    skipped: list[dict] = field(default_factory=list)  # {"key", "reason"}
    seconds: float = 0.0


def _decode(sample: dict):
    from PIL import Image

    ext = image_ext(sample)
    if ext is None:
        raise ValueError("no image member (" + "/".join(IMAGE_EXTS) + ")")
    with Image.open(io.BytesIO(sample[ext])) as im:
        return im.convert("RGB")  # loads the pixels: a truncated file fails here, in the pool


def caption_tar(tar_url: str, captioner, batch_size: int = 16, prompt: str | None = None,
                max_new_tokens: int = 30, threads: int = 0) -> list[dict]:
    """A row (``COLUMNS``) per sample of the webdataset tar at ``tar_url``, in tar order; ``captioner``:
    a ``models.captioner.Captioner`` (its ``prepare``, ``generate`` and ``name``); ``threads``: decode
    threads (0: one per core)."""
    from shardprep.tars import iter_samples

    def row_of(sample: dict) -> dict:
        return {"key": sample["__key__"], "caption": None, "original_caption": sample_text(sample),
                "model": captioner.name, "prompt": prompt, "skip_reason": None}

    # the processor's per-image work (resize, normalise) in the decode threads too, where it allows
    return caption_in_batches(iter_samples(tar_url), row_of, lambda s: captioner.prepare(_decode(s)),
                              lambda images: captioner.generate(images, prompt, max_new_tokens), batch_size, threads)


def captions_table(rows: list[dict]):
    import pyarrow as pa

    string = pa.string()
    return pa.table({c: pa.array([r[c] for r in rows], string) for c in COLUMNS})


def write_captions(shard: str, layout: Layout, captioner, batch_size: int = 16, prompt: str | None = None,
                   max_new_tokens: int = 30, threads: int = 0, media: str = "image",
                   video_frames: int = 4) -> CaptionsReport:
    """Caption every sample of ``shard``'s tar and write ``layout.captions(shard)`` (module docstring); a
    video shard (``media``): every clip of its video tar, from ``video_frames`` frames each
    (``curation.video_captions``)."""
    start = time.perf_counter()
    report = CaptionsReport(shard=shard)
    url = layout.captions(shard)
    tar = layout.video_tar(shard) if media == "video" else layout.tar(shard)
    if not exists(tar):
        remove(url)
        report.seconds = time.perf_counter() - start
        return report
    if media == "video":
        from shardprep.curation.video_captions import caption_video_tar  # PyAV only where videos are

        rows = caption_video_tar(tar, captioner, video_frames, batch_size, prompt, max_new_tokens, threads)
    else:
        rows = caption_tar(tar, captioner, batch_size, prompt, max_new_tokens, threads)
    write_parquet(url, captions_table(rows))  # atomic (shardprep.storage)
    report.samples = len(rows)
    report.captioned = sum(r["caption"] is not None for r in rows)
    report.skipped = [{"key": r["key"], "reason": r["skip_reason"]} for r in rows if r["skip_reason"] is not None]
    report.seconds = time.perf_counter() - start
    return report


def read_captions(layout: Layout, shard: str) -> dict[str, dict]:
    """``{key: row}`` of ``shard``'s captions (empty when it has none)."""
    url = layout.captions(shard)
    if not exists(url):
        return {}
    return {r["key"]: r for r in read_parquet(url).to_pylist()}
