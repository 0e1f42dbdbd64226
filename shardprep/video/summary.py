"""What a video shard holds, read back from its tar: clip counts and durations (for the asset's
metadata and the dataset report), without reading a single video payload."""

from __future__ import annotations

import json

from shardprep.storage import open_read
from shardprep.tars import header_samples


def clip_jsons(tar_url: str) -> list[dict]:
    """Each sample's ``.json`` (video2dataset's fields plus ours: width, height, framerate, num_frames,
    duration, ...), in tar order. Only the json members are read: a seek past each video."""
    samples, _ = header_samples(tar_url)
    out = []
    with open_read(tar_url) as f:
        for sample in samples:
            header = sample.get("json")
            if header is None:
                continue
            f.seek(header.data_offset)
            out.append(json.loads(f.read(header.size)))
    return out


def clip_summary(tar_url: str) -> dict:
    """``clips``, total ``seconds``, shortest and longest clip (``min``, ``max``) and ``frames``."""
    jsons = clip_jsons(tar_url)
    durations = [float(m.get("duration") or 0.0) for m in jsons]
    return {"clips": len(jsons), "seconds": round(sum(durations), 3),
            "min": round(min(durations), 3) if durations else 0.0,
            "max": round(max(durations), 3) if durations else 0.0,
            "frames": sum(int(m.get("num_frames") or 0) for m in jsons)}
