"""One webdataset sample made ready for CLIP: its image decoded and preprocessed, its caption tokenised, its
json parsed; or a skip record saying why not (clip-retrieval leaves such samples out). Used by the decode
threads of ``shardprep.embeddings`` and by the worker processes of ``shardprep.prepare_pool``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from shardprep.errors import ShardprepError

if TYPE_CHECKING:
    from shardprep.models.clip import ClipEncoder

IMAGE_EXTS = ("jpg", "png", "webp")  # img2dataset's encode formats, in the order we look for them


class ShardReadError(ShardprepError, ValueError):
    """A shard's samples are not what an img2dataset webdataset holds (bad ``.json``, no captions);
    a tar that cannot be read at all raises ``shardprep.tars.TarReadError``."""


def image_ext(sample: dict) -> str | None:
    return next((e for e in IMAGE_EXTS if e in sample), None)


def prepare_sample(sample: dict, encoder: "ClipEncoder", enable_text: bool, url: str, out=None,
                   image_of: Callable[[bytes, Any], Any] | None = None) -> dict:
    """Decode + preprocess + tokenise one sample (runs in a worker thread); errors become a skip record
    ``{"key", "reason"}``.

    ``out``: the sample's row of the batch's image buffer (fast preprocessing writes there).
    ``image_of(data, out)``: what ``encoder.prepare_image`` returns, made otherwise (``shardprep.pixels``:
    from the one decode every pixel model of the run shares); its errors are skips all the same."""
    key = sample["__key__"]
    ext = image_ext(sample)
    if ext is None:
        return {"key": key, "reason": "no image member (" + "/".join(IMAGE_EXTS) + ")"}
    if enable_text and "txt" not in sample:
        return {"key": key, "reason": "no .txt caption"}
    try:
        caption = sample["txt"].decode("utf-8") if "txt" in sample else None
    except UnicodeDecodeError as e:
        return {"key": key, "reason": f"caption is not UTF-8: {e}"}
    try:
        image = (image_of or encoder.prepare_image)(sample[ext], out)
    except Exception as e:  # a bad image is a recorded skip, never a crash (clip-retrieval skips too)
        return {"key": key, "reason": f"image decode/preprocess failed: {type(e).__name__}: {e}"}
    raw_meta = sample.get("json", b"{}").decode("utf-8")
    try:
        meta = json.loads(raw_meta)
    except ValueError as e:
        raise ShardReadError(f"{url}: sample {key!r}: .json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ShardReadError(f"{url}: sample {key!r}: .json must hold an object, got {type(meta).__name__}")
    # tokenised here, in the pool, so the (pure Python) BPE overlaps the model's forward pass;
    # rows are independent, so one row at a time gives the batch's ids
    tokens = encoder.tokenizer([caption]) if enable_text else None
    return {"key": key, "image": image, "caption": caption, "meta": meta, "tokens": tokens}
