"""Synthetic captions of one video shard: a caption per clip of ``layout.video_tar(shard)``, from its frame
strip (``shardprep.video.strips``: ``frames`` frames evenly spaced over the clip), written by
``curation.captions.write_captions`` with the image shards' columns, a row per clip in tar order.

A captioner that takes several images (a chat VLM: ``Captioner.multi_image``) gets the strip as the
images of one user turn, then the prompt (default "Describe this video."). One that takes one image per
caption (BLIP and the other non-chat models) writes no video caption: every clip keeps its row, with a
``skip_reason`` that says so (the model is still named: another captioner would fill them). A clip
without a video member, or one that cannot be decoded, is a recorded skip, never an error.

Strips are decoded in a thread pool (FFmpeg releases the GIL), one batch ahead of the model;
``batch_size`` counts images per model call, as for image shards: ``batch_size // frames`` clips (at
least one).
"""

from __future__ import annotations

from shardprep.curation.caption_batches import caption_in_batches, sample_text
from shardprep.tars import iter_samples
from shardprep.video.strips import VIDEO_EXTS, frame_strip


def unsupported_reason(captioner) -> str:
    return f"captioner {captioner.name} takes one image per caption: video clips are not captioned"


def _strip(sample: dict, frames: int) -> list:
    ext = next((e for e in VIDEO_EXTS if e in sample), None)
    if ext is None:
        raise ValueError("no video member (" + "/".join(VIDEO_EXTS) + ")")
    return frame_strip(sample[ext], frames)



def _row(sample: dict, captioner, prompt: str | None, skip_reason: str | None = None) -> dict:
    return {"key": sample["__key__"], "caption": None, "original_caption": sample_text(sample), "model": captioner.name,
            "prompt": prompt, "skip_reason": skip_reason}


def caption_video_tar(tar_url: str, captioner, frames: int = 4, batch_size: int = 16, prompt: str | None = None,
                      max_new_tokens: int = 30, threads: int = 0) -> list[dict]:
    """A row (``curation.captions.COLUMNS``) per clip of the video2dataset-layout tar at ``tar_url``, in
    tar order (module docstring); ``captioner``: a ``models.captioner.Captioner`` (its
    ``generate_strips``, ``multi_image`` and ``name``); ``threads``: decode threads (0: one per core)."""
    if not captioner.multi_image:
        reason = unsupported_reason(captioner)
        return [_row(s, captioner, prompt, reason) for s in iter_samples(tar_url)]
    return caption_in_batches(iter_samples(tar_url), lambda s: _row(s, captioner, prompt), lambda s: _strip(s, frames),
                              lambda strips: captioner.generate_strips(strips, prompt, max_new_tokens),
                              max(1, batch_size // frames), threads, what="video")
