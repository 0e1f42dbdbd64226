"""What each artifact's content depends on, as a version string, and the stamps that say which version a
finished output was made with.

An artifact's version is a hash of the config fields that change what it holds, a revision number of
the code that writes it, and the versions of the artifacts it is made from. Changing
``image_size`` thus makes ``image_shards`` and everything made from the images stale, while a
changed ``thread_count`` or ``batch_size`` (how fast, not what) makes nothing stale. The Dagster side
records the version as each asset's code version; a stamp file written after a shard's outputs
(``<root>/.shardprep/stamps/{artifact}/{shard}.json``) lets a run skip outputs that are complete and
current, even when the Dagster instance that recorded them is gone.
"""

from __future__ import annotations

import hashlib
import json
import time

from shardprep.config import DatasetConfig
from shardprep.layout import Layout
from shardprep.storage import read_text, remove, write_bytes

# artifact -> (config fields that change its content, artifacts it is made from). Networking and speed
# settings (timeout, retries, thread_count, decode_threads, user_agent, device, batch sizes) are left out
# on purpose: they change how fast or how many downloads succeed, not what a finished output means.
ARTIFACTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "source_parquet": ((), ()),
    "image_shards": (("url_col", "caption_col", "save_additional_columns", "image_size", "resize_mode",
                      "resize_only_if_bigger", "encode_format", "encode_quality", "extract_exif", "fast_decode",
                      "max_image_bytes", "max_image_pixels"), ("source_parquet",)),
    "video_shards": (("video_url_col", "video_caption_col", "save_additional_columns", "video_size",
                      "video_resize_mode", "video_frame_rate", "video_max_duration", "video_clip_length",
                      "video_min_clip_length", "video_clip_strategy", "video_clip_col", "video_encode_format",
                      "video_crf", "video_preset", "max_video_bytes", "max_video_pixels"), ("source_parquet",)),
    "clip_embeddings": (("clip_model", "enable_text"), ("image_shards",)),
    "reordered_embeddings": ((), ("clip_embeddings",)),
    "image_scores": (("aesthetic_model", "nsfw_model"), ("clip_embeddings",)),
    "duplicates": (("dedup", "dedup_threshold"), ("image_shards", "clip_embeddings")),
    "sample_selection": (("dedup", "dedup_threshold", "aesthetic_min", "nsfw_max", "min_original_size",
                          "caption_min_length", "caption_max_length"), ("image_shards", "image_scores", "duplicates")),
    # the json's aesthetic_score comes from image_scores when an aesthetic head is configured (then the
    # embeddings it is computed from count too: WHEN_SET)
    "diffusion_samples": (("diffusion_t5_model", "diffusion_autoencoder", "diffusion_resolution", "aesthetic_model"),
                          ("image_shards", "clip_embeddings")),
    "video_diffusion_samples": (("diffusion_t5_model", "video_autoencoder", "video_diffusion_frames",
                                 "video_diffusion_resolution"), ("video_shards",)),
    "balanced_shards": (("tar_chunk_size",), ("image_shards", "sample_selection")),
    "wdinfo": ((), ("balanced_shards",)),
    "precached_encodings": (("precache_resolution", "precache_keep_original", "sd_autoencoder",
                             "sd_clip_text_model"), ("balanced_shards",)),
    "image_energon_index": (("energon_split_ratio",), ("image_shards", "sample_selection")),
    "diffusion_energon_index": (("energon_split_ratio",), ("diffusion_samples", "video_diffusion_samples",
                                                           "sample_selection")),
    "dataset_report": ((), ("image_shards", "video_shards", "clip_embeddings", "image_scores", "sample_selection")),
}
# (artifact, parent) -> the config fields without one of which the artifact does not read that parent
WHEN_SET = {("diffusion_samples", "clip_embeddings"): ("aesthetic_model",),
            ("sample_selection", "image_scores"): ("aesthetic_min", "nsfw_max"),
            ("sample_selection", "duplicates"): ("dedup",)}
# Bump an artifact's number when its code starts writing something different for the same config.
CODE_REVISIONS: dict[str, int] = {name: 1 for name in ARTIFACTS}
ALL_SHARDS = "_all"  # the stamp "shard" of an unpartitioned artifact


def artifact_versions(cfg: DatasetConfig) -> dict[str, str]:
    """``{artifact: version}``: 16 hex digits each, stable across processes and releases."""
    values = cfg.to_dict()
    versions: dict[str, str] = {}

    def version(name: str) -> str:
        if name not in versions:
            fields, parents = ARTIFACTS[name]
            parents = tuple(p for p in parents if (name, p) not in WHEN_SET
                            or any(values[f] not in (None, False) for f in WHEN_SET[(name, p)]))
            doc = {"code": CODE_REVISIONS[name], "fields": {f: values[f] for f in fields},
                   "from": {p: version(p) for p in parents}}
            digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode("utf-8")).hexdigest()
            versions[name] = digest[:16]
        return versions[name]

    for name in ARTIFACTS:
        version(name)
    return versions


def write_stamp(layout: Layout, artifact: str, version: str, shard: str = ALL_SHARDS,
                outputs: dict[str, int] | None = None) -> None:
    """Record that ``artifact``'s outputs of ``shard`` are complete at ``version`` (write it last);
    ``outputs``: ``{url: size}`` of the files written, for ``verify``."""
    doc = {"artifact": artifact, "shard": shard, "version": version, "written_at": time.time(),
           "outputs": outputs or {}}
    write_bytes(layout.stamp(artifact, shard), json.dumps(doc).encode("utf-8"))


def read_stamp(layout: Layout, artifact: str, shard: str = ALL_SHARDS) -> dict | None:
    """The stamp of ``shard``'s outputs of ``artifact`` (``version``, ``outputs``), or None (none, or
    unreadable: then the outputs are not trusted)."""
    text = read_text(layout.stamp(artifact, shard))
    try:
        doc = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("version"), str) else None


def stamped_version(layout: Layout, artifact: str, shard: str = ALL_SHARDS) -> str | None:
    """The version ``shard``'s outputs of ``artifact`` were completed at, or None."""
    doc = read_stamp(layout, artifact, shard)
    return doc["version"] if doc else None


def restamp_sizes(layout: Layout, artifact: str, shard: str, sizes: dict[str, int]) -> None:
    """Record new sizes of files of ``artifact`` that another artifact rewrote in place (image_scores
    joins its columns into clip_embeddings' metadata parquet), so ``verify`` does not take them for
    damaged; the version and completeness stay as they were. No stamp: nothing to update."""
    doc = read_stamp(layout, artifact, shard)
    if doc is None:
        return
    doc["outputs"] = {**doc.get("outputs", {}), **{u: s for u, s in sizes.items() if u in doc.get("outputs", {})}}
    write_bytes(layout.stamp(artifact, shard), json.dumps(doc).encode("utf-8"))


def remove_stamp(layout: Layout, artifact: str, shard: str = ALL_SHARDS) -> bool:
    """Forget that the outputs are complete (they will be made again); True if there was a stamp."""
    return remove(layout.stamp(artifact, shard))
