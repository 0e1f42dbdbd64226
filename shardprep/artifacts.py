"""What every artifact is, one record each: the single place that says it.

``versions`` (what an artifact's content depends on), ``layout`` (its files per shard, which shards it
applies to), ``verify`` (how it is read back), ``report`` (whether the report lists its broken files),
the Dagster asset definitions (dependencies, pool, group, partitions, which config flag turns it on) and
the CLI read these records; a test holds the Dagster asset graph equal to them. Adding an artifact is one
record here plus its writer (and its asset).

Plain data, importing nothing of shardprep: every other module may read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHARD, GLOBAL = "shard", "global"  # one output per shard partition; one output for the dataset


@dataclass(frozen=True)
class Artifact:
    name: str
    kind: str  # SHARD or GLOBAL
    group: str  # where the UI shows it
    parents: tuple[str, ...] = ()  # the artifacts it is made from (the asset graph's dependencies)
    fields: tuple[str, ...] = ()  # config fields that change what it holds (not how fast it is made)
    # the parents its version follows, when not ``parents``: a parent read for ordering only, or read
    # through another artifact's files, is named here by what its content really depends on
    version_from: tuple[str, ...] | None = None
    # parent -> config fields without one of which the artifact does not read that parent
    reads_only_when: dict[str, tuple[str, ...]] = field(default_factory=dict)
    media: str | None = None  # per-shard artifacts made from shards of one media only ("image", "video")
    outputs: tuple[str, ...] = ()  # per shard: the ``Layout`` methods naming its files
    pool: str | None = None  # the Dagster pool (and Celery queue) of its step: "download", "gpu"
    batch: str | None = None  # per shard: whose shards-per-run a backfill run takes ("download", "gpu")
    enabled_by: str | None = None  # the config flag that turns it on (off: not in the graph at all)
    verify: str = ""  # the function of ``shardprep.verify`` that reads its outputs back (a ``Target`` each)
    reported: bool = False  # the dataset report lists the broken files of its finished shards
    revision: int = 1  # bump when its code starts writing something different for the same config

    @property
    def partitioned(self) -> bool:
        return self.kind == SHARD

    @property
    def version_parents(self) -> tuple[str, ...]:
        return self.parents if self.version_from is None else self.version_from

    def applies(self, media: str) -> bool:
        """Whether it makes outputs for a shard of ``media`` ("image" or "video")."""
        return self.media is None or self.media == media


_IMAGE_SHARD_FIELDS = ("url_col", "caption_col", "save_additional_columns", "image_size", "resize_mode",
                       "resize_only_if_bigger", "encode_format", "encode_quality", "extract_exif", "fast_decode",
                       "max_image_bytes", "max_image_pixels")
_VIDEO_SHARD_FIELDS = ("video_url_col", "video_caption_col", "save_additional_columns", "video_size",
                       "video_resize_mode", "video_frame_rate", "video_max_duration", "video_clip_length",
                       "video_min_clip_length", "video_clip_strategy", "video_clip_col", "video_encode_format",
                       "video_crf", "video_preset", "max_video_bytes", "max_video_pixels")
_SELECTION_RULES = ("dedup", "dedup_threshold", "aesthetic_min", "nsfw_max", "watermark_max", "min_original_size",
                    "caption_min_length", "caption_max_length")

# Networking and speed settings (timeout, retries, thread_count, decode_threads, user_agent, device, batch
# sizes) are in no record's fields on purpose: they change how fast or how many downloads succeed, not
# what a finished output means. In dependency order.
_RECORDS = (
    Artifact("source_parquet", SHARD, "images", outputs=("source_parquet",), batch="download",
             verify="check_source_parquet"),
    Artifact("image_shards", SHARD, "images", parents=("source_parquet",), fields=_IMAGE_SHARD_FIELDS,
             media="image", outputs=("tar", "shard_parquet", "shard_stats"), pool="download", batch="download",
             verify="check_image_shards", reported=True),
    Artifact("video_shards", SHARD, "videos", parents=("source_parquet",), fields=_VIDEO_SHARD_FIELDS,
             media="video", outputs=("video_tar", "video_parquet", "video_stats"), pool="download",
             batch="download", verify="check_video_shards", reported=True),
    Artifact("clip_embeddings", SHARD, "embeddings", parents=("image_shards",), fields=("clip_model", "enable_text"),
             media="image", outputs=("img_emb", "text_emb", "emb_metadata"), pool="gpu", batch="gpu",
             verify="check_clip_embeddings", reported=True),
    Artifact("reordered_embeddings", SHARD, "embeddings", parents=("clip_embeddings",), media="image",
             outputs=("reordered_img", "reordered_text"), batch="gpu", verify="check_reordered_embeddings",
             reported=True),
    # the watermark detector reads the shard's tar, which the embeddings were made from (their metadata
    # gives the scores' rows): clip_embeddings stays its one parent
    Artifact("image_scores", SHARD, "curation", parents=("clip_embeddings",),
             fields=("aesthetic_model", "nsfw_model", "watermark_model"),
             media="image", outputs=("scores",), pool="gpu", batch="gpu", verify="check_image_scores"),
    # a VLM's caption of every image of the shard's tar (every clip of a video shard's, from a frame strip),
    # beside its original caption. One version for both media: in a dataset of both, a video setting makes
    # the image shards' captions stale too; a dataset of one media does not follow the other's settings
    Artifact("captions", SHARD, "curation", parents=("image_shards", "video_shards"),
             fields=("captioner", "caption_prompt", "caption_max_new_tokens", "caption_video_frames"),
             reads_only_when={"image_shards": ("source",), "video_shards": ("video_source",)},
             outputs=("captions",), pool="gpu", batch="gpu", enabled_by="captioner", verify="check_captions"),
    # the caption each sample trains with (train_caption: synthetic or both), written into the image tar's
    # json (train_caption, synthetic_caption) where every training output reads it; off with train_caption:
    # original, and then no artifact reads it (a parent the config turns off is in no graph nor version)
    # The DALLE2 prior's text (clip-retrieval metadata and CLIP text embeddings of the training caption, row
    # for row with the image embeddings) is made here too: a new choice redoes the text, never the images
    Artifact("training_text", SHARD, "curation", parents=("image_shards", "clip_embeddings", "captions"),
             fields=("train_caption",), media="image",
             outputs=("training_text", "train_text_metadata", "train_text_emb"), pool="gpu", batch="gpu",
             enabled_by="synthetic_text", verify="check_training_text"),
    # the json's aesthetic_score is read from image_scores' files when an aesthetic head is configured;
    # what it depends on is the embeddings and that head (a new NSFW head changes no diffusion sample)
    Artifact("diffusion_samples", SHARD, "nemo_diffusion", parents=("image_shards", "image_scores", "training_text"),
             fields=("diffusion_t5_model", "diffusion_autoencoder", "diffusion_resolution", "aesthetic_model"),
             version_from=("image_shards", "clip_embeddings", "training_text"),
             reads_only_when={"clip_embeddings": ("aesthetic_model",)}, media="image",
             outputs=("diffusion_tar",), pool="gpu", batch="gpu", enabled_by="enable_nemo_diffusion",
             verify="check_diffusion_samples"),
    Artifact("video_diffusion_samples", SHARD, "nemo_diffusion", parents=("video_shards",),
             fields=("diffusion_t5_model", "video_autoencoder", "video_diffusion_frames", "video_diffusion_resolution"),
             media="video", outputs=("diffusion_tar",), pool="gpu", batch="gpu", enabled_by="enable_nemo_diffusion",
             verify="check_diffusion_samples"),
    # takedown lists applied to every finished shard (shardprep.takedown): after the per-shard artifacts,
    # whose files it rewrites, before every global one that holds samples; those read it for ordering
    # only (their versions do not follow it: a takedown changes shards, which they take like any change)
    Artifact("takedowns", GLOBAL, "governance",
             parents=("image_shards", "video_shards", "clip_embeddings", "reordered_embeddings", "image_scores",
                      "captions", "training_text"),
             fields=("takedown_lists",), version_from=(), verify="check_takedowns"),
    Artifact("duplicates", GLOBAL, "curation", parents=("image_shards", "clip_embeddings", "takedowns"),
             fields=("dedup", "dedup_threshold"), version_from=("image_shards", "clip_embeddings"),
             verify="check_duplicates"),
    Artifact("sample_selection", GLOBAL, "curation",
             parents=("image_shards", "image_scores", "duplicates", "takedowns"), fields=_SELECTION_RULES,
             version_from=("image_shards", "image_scores", "duplicates"), reads_only_when={"image_scores": ("aesthetic_min", "nsfw_max", "watermark_max"),
                                                       "duplicates": ("dedup",)}, verify="check_sample_selection"),
    Artifact("balanced_shards", GLOBAL, "nemo_text2img", parents=("image_shards", "sample_selection", "training_text"),
             fields=("tar_chunk_size",), enabled_by="enable_nemo_text2img", verify="check_balanced_shards"),
    Artifact("wdinfo", GLOBAL, "nemo_text2img", parents=("balanced_shards",), enabled_by="enable_nemo_text2img",
             verify="check_wdinfo"),
    Artifact("precached_encodings", GLOBAL, "nemo_text2img", parents=("balanced_shards",),
             fields=("precache_resolution", "precache_keep_original", "sd_autoencoder", "sd_clip_text_model"),
             pool="gpu", enabled_by="enable_nemo_text2img", verify="check_precached_encodings"),
    Artifact("image_energon_index", GLOBAL, "energon",
             parents=("image_shards", "sample_selection", "training_text", "takedowns"),
             fields=("energon_split_ratio",), version_from=("image_shards", "sample_selection", "training_text"), verify="check_image_energon_index"),
    Artifact("diffusion_energon_index", GLOBAL, "energon",
             parents=("diffusion_samples", "video_diffusion_samples", "sample_selection", "takedowns"),
             fields=("energon_split_ratio",), enabled_by="enable_nemo_diffusion",
             version_from=("diffusion_samples", "video_diffusion_samples", "sample_selection"),
             verify="check_diffusion_energon_index"),
    Artifact("dataset_report", GLOBAL, "reports",
             parents=("image_shards", "video_shards", "clip_embeddings", "image_scores", "captions", "duplicates",
                      "sample_selection", "takedowns"),
             # the report is written anew each time: duplicates add nothing its version must follow
             version_from=("image_shards", "video_shards", "clip_embeddings", "image_scores", "sample_selection"),
             verify="check_dataset_report"),
)

ARTIFACTS: dict[str, Artifact] = {a.name: a for a in _RECORDS}
PER_SHARD: tuple[str, ...] = tuple(a.name for a in _RECORDS if a.partitioned)
GLOBALS: tuple[str, ...] = tuple(a.name for a in _RECORDS if not a.partitioned)


def artifact(name: str) -> Artifact:
    return ARTIFACTS[name]


def applies(name: str, media: str) -> bool:
    """Whether artifact ``name`` makes outputs for a shard of ``media`` ("image" or "video")."""
    return ARTIFACTS[name].applies(media)


def enabled(name: str, cfg) -> bool:
    """Whether the config turns artifact ``name`` on."""
    flag = ARTIFACTS[name].enabled_by
    return flag is None or bool(getattr(cfg, flag))


def enabled_parents(name: str, cfg) -> tuple[str, ...]:
    """``name``'s parents that the config turns on: a parent turned off is not read, so it is neither a
    dependency in the asset graph nor part of the version."""
    return tuple(p for p in ARTIFACTS[name].parents if enabled(p, cfg))
