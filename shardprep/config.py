"""The dataset config: one YAML file names the source, the output root and every processing choice.

Every field is typed and bounded (a pydantic model, strict: no "no" for false, no "8" for 8); a
wrong, missing or unknown field fails at load with one line per field naming the field, the value
given and what is allowed (and the file).
"""

from __future__ import annotations

import difflib
import os
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from shardprep import storage
from shardprep.errors import ShardprepError

ResizeMode = Literal["no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"]
EncodeFormat = Literal["jpg", "png", "webp"]
RESIZE_MODES: tuple[str, ...] = get_args(ResizeMode)
ENCODE_FORMATS: tuple[str, ...] = get_args(EncodeFormat)
# columns shardprep writes itself: an additional source column may not shadow them
_RESERVED_COLUMNS = frozenset({"url", "caption", "key", "status", "error_message", "width", "height",
                               "original_width", "original_height", "exif", "sha256"})

# The value types; each description is the "allowed: ..." of an error message.
Text = Annotated[str, Field(pattern=r"\S", description="a non-empty string")]  # not blank either
PositiveInt = Annotated[int, Field(gt=0, description="a positive integer")]
NonNegativeInt = Annotated[int, Field(ge=0, description="an integer >= 0")]
Flag = Annotated[bool, Field(description="true or false")]
Share = Annotated[float, Field(ge=0, allow_inf_nan=False)]
# the start of a storage_options error, whose message names the wrong option (its value is shown with
# credentials masked)
STORAGE_OPTIONS_PROBLEM = "storage_options: "


class ConfigError(ShardprepError, ValueError):
    """A config field is missing, unknown or has a bad value."""


class DatasetConfig(BaseModel):
    # strict: YAML gives real bools and numbers, so a string or a bool where a number belongs is a
    # mistake; validate_default: encode_quality's default (95) is wrong for png
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, validate_default=True)

    # where the data comes from and goes to (any fsspec URL; a glob for the source)
    source: Text | None = Field(..., description="a parquet file, folder or glob of image rows, or null "
                                                  "(a video-only dataset: set video_source)")
    output_root: Text
    # how to reach them, by fsspec protocol (e.g. s3: endpoint_url, key, secret): applied to the whole
    # process when the config loads (shardprep.storage.configure); not shown, it may hold a secret
    storage_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, repr=False,
        description="a mapping of fsspec protocol to that filesystem's options, e.g. "
                    "{s3: {endpoint_url: 'http://127.0.0.1:8333', key: ..., secret: ...}}")
    url_col: Text = "url"
    caption_col: Text | None = Field("caption", description="a column name or null (no captions)")
    save_additional_columns: tuple[Text, ...] = Field(
        (), description="a list of distinct non-empty column names, none of them reserved "
                        f"({', '.join(sorted(_RESERVED_COLUMNS))})")
    # sharding (img2dataset semantics)
    samples_per_shard: PositiveInt = 10_000
    oom_shard_count: PositiveInt = 5
    # Dagster partitions are blocks of this many consecutive shards (1: one partition per shard); fixed
    # by the ledger like samples_per_shard. Our state index keeps per-shard truth either way
    shards_per_partition: PositiveInt = 1
    # images
    image_size: PositiveInt = 256
    resize_mode: ResizeMode = Field("border", description=f"one of {', '.join(RESIZE_MODES)}")
    resize_only_if_bigger: Flag = False
    encode_format: EncodeFormat = Field("jpg", description=f"one of {', '.join(ENCODE_FORMATS)}")
    encode_quality: int = Field(95, description="an integer in [0, 9] for png (compression), [0, 100] otherwise")
    extract_exif: Flag = True
    # fast_decode: JPEGs that are downscaled are decoded at 1/2-1/8 scale (libjpeg DCT scaling)
    # before the same area resize; same sizes and statuses as img2dataset, pixels within a few
    # grey levels (false: byte-identical to img2dataset's resizer). decode_threads: images
    # decoded/resized at once per shard (0: one per CPU core); downloads keep thread_count.
    fast_decode: Flag = True
    decode_threads: NonNegativeInt = Field(0, description="an integer >= 0 (0: one per CPU core)")
    # takedowns (shardprep/takedown): lists of URLs, domains, sample keys or image sha256 whose samples are
    # removed from every artifact and never downloaded again (also given to `shardprep takedown --list`)
    takedown_lists: tuple[Text, ...] = Field((), description="a list of takedown list files (any fsspec URL)")
    # downloads
    timeout: float = Field(10.0, gt=0, allow_inf_nan=False, description="a positive number of seconds")
    retries: NonNegativeInt = 0
    thread_count: PositiveInt = 64
    max_image_bytes: PositiveInt = 50_000_000
    max_image_pixels: PositiveInt = 89_478_485  # PIL's decompression-bomb threshold
    allow_private_addresses: Flag = False
    user_agent: Text = "shardprep/0.1 (+https://github.com/shardprep)"
    # image and video URLs whose path the site's robots.txt disallows for user_agent's product token are
    # not fetched (shardprep/robots.py: RFC 9309, fetched once per site and process)
    respect_robots_txt: Flag = True
    # X-Robots-Tag directives that refuse an image or video (img2dataset's name and default), for every user
    # agent or for user_agent's product token ("shardprep: noai"); an empty list checks no header
    disallowed_header_directives: tuple[Text, ...] = Field(
        ("noai", "noimageai", "noindex", "noimageindex"), description="a list of X-Robots-Tag directives")
    # per-host politeness (shardprep/politeness.py), for all image- and video-download processes of the
    # machine together: requests in flight to one host, and requests started per second per host (0: no limit)
    per_host_connections: NonNegativeInt = Field(64, description="an integer >= 0 (0: no limit)")
    per_host_requests_per_second: float = Field(0.0, ge=0, allow_inf_nan=False,
                                                description="a number >= 0 (0: no limit)")
    # the folder whose files share those limits between processes (null: under the system temp dir)
    per_host_state_dir: Text | None = Field(None, description="a local folder path, or null (the system temp dir)")
    # a Redis that shares those limits between machines instead (every worker naming it, the Celery result
    # backend's for one); null: each machine its own, through per_host_state_dir. Not shown: it may hold a
    # password
    per_host_limits_url: Annotated[str, Field(pattern=r"^(redis|rediss|unix)://\S")] | None = Field(
        None, repr=False, description="a redis://, rediss:// or unix:// URL, or null (limits per machine)")
    # video rows (video_shards): a second source of parquet files, each file's shards are video shards
    # (WebVid: video_url_col contentUrl, video_caption_col name); null: an image-only dataset
    video_source: Text | None = Field(None, description="a parquet file, folder or glob (like 'source'), or null")
    video_url_col: Text = "url"
    video_caption_col: Text | None = Field("caption", description="a column name or null (no captions)")
    # videos (shardprep/video/shards.py), the options of video2dataset's subsamplers under its names:
    # video_size + video_resize_mode its ResolutionSubsampler (null size: keep it), video_frame_rate its
    # FrameSubsampler (null: the source's average rate), video_clip_* its ClippingSubsampler (max_length,
    # min_length, max_length_strategy; spans from video_clip_col, else the whole video). Every video is
    # decoded and re-encoded.
    video_size: Annotated[int, Field(gt=0)] | None = Field(None, description="a positive integer or null (keep)")
    video_resize_mode: Literal["scale", "crop", "pad", "scale,crop", "scale,pad", "crop,pad", "scale,crop,pad"] = Field(
        "scale,crop,pad", description="scale, crop, pad or a comma-separated combination in that order")
    video_frame_rate: Annotated[float, Field(gt=0, le=240, allow_inf_nan=False)] | None = Field(
        None, description="frames per second in (0, 240], or null (the source's average rate)")
    video_max_duration: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="a positive number of seconds, or null (no limit)")
    video_clip_length: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="a positive number of seconds, or null (one sample per video)")
    video_min_clip_length: float = Field(0.0, ge=0, allow_inf_nan=False, description="a number of seconds >= 0")
    video_clip_strategy: Literal["all", "first"] = Field("all", description="all or first")
    video_clip_col: Text | None = Field(None, description="a column name or null (clips of the whole video)")
    video_encode_format: Literal["mp4", "webm"] = Field("mp4", description="mp4 (H.264) or webm (VP9)")
    video_crf: int = Field(23, ge=0, le=51, description="an integer in [0, 51] (lower: better and larger)")
    video_preset: Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
                          "veryslow"] = Field("veryfast", description="an x264 preset, ultrafast to veryslow")
    video_thread_count: PositiveInt = 16  # downloads at once per shard (each holds up to max_video_bytes)
    video_decode_threads: NonNegativeInt = Field(0, description="an integer >= 0 (0: one per CPU core)")
    max_video_bytes: PositiveInt = 200_000_000
    max_video_pixels: PositiveInt = 16_777_216  # 4096 x 4096
    video_timeout: float = Field(600.0, gt=0, allow_inf_nan=False, description="a positive number of seconds "
                                 "(decode and encode time per video)")
    # CLIP embeddings (clip-retrieval's model spelling)
    clip_model: Text = "ViT-B/32"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    batch_size: PositiveInt = 256
    enable_text: Flag = True
    # curation scores of every image from its CLIP embedding (image_scores; shardprep/curation/scores.py): a head file
    # in its published format (local path, fsspec URL, or hub id read from the local Hugging Face cache),
    # checked at load against clip_model's embedding width; null: not scored
    aesthetic_model: Text | None = Field(None, description="a score head file (path, URL or hub id) or null")
    nsfw_model: Text | None = Field(None, description="a score head file (path, URL or hub id) or null")
    # LAION's watermark detector (shardprep/models/watermark.py): its watermark_model_v1.pt (or safetensors),
    # path, URL or cached hub id as the heads; run by image_scores on every image's pixels (pwatermark)
    watermark_model: Text | None = Field(None, description="a watermark model file (path, URL or hub id) or null")
    # synthetic captions (captions; shardprep/models/captioner.py): a vision-language model through transformers'
    # auto classes (BLIP, BLIP-2, InstructBLIP, chat VLMs), a local folder or a hub id read from the local
    # Hugging Face cache only; null: no captions (the asset is not in the graph). caption_prompt: the text the
    # model is given (BLIP: the caption's start; chat VLMs: the question), null: unconditional; greedy
    # decoding of at most caption_max_new_tokens tokens; caption_batch_size: images per model call (speed only)
    captioner: Text | None = Field(None, description="a model folder or a hub id in the local cache, or null")
    caption_prompt: Text | None = Field(None, description="a non-empty prompt, or null (unconditional)")
    caption_max_new_tokens: PositiveInt = 30
    caption_batch_size: PositiveInt = 16
    # video shards: a clip is captioned from this many frames evenly spaced over it (shardprep/video/strips.py),
    # the images of one user turn (chat VLMs only: a one-image model leaves video clips uncaptioned)
    caption_video_frames: PositiveInt = 4
    # the text the training outputs use (shardprep/training_text.py): the .txt of balanced tars, the caption
    # of the image energon dataset, the NeMo diffusion samples' T5 states, the DALLE2 prior's text.
    # original: the source's caption; synthetic: the captioner's (the original where it has none); both:
    # half the samples each, chosen by key (SD3's 50/50 recipe), the same choice on every run
    train_caption: Literal["original", "synthetic", "both"] = Field("original", description="original, synthetic or both")
    # duplicates across every image shard (shardprep/curation/dedup.py): exact (same sha256 of the downloaded bytes)
    # and near (cosine of the CLIP image embeddings >= dedup_threshold; clip-retrieval's query-time dedup
    # uses 0.94), the first arrival kept
    dedup: Flag = False
    dedup_threshold: float = Field(0.95, gt=0, le=1, allow_inf_nan=False, description="a cosine similarity in (0, 1]")
    # curation rules (shardprep/curation/selection.py): the samples the training outputs use (balanced tars, precache,
    # both energon datasets, the loaders' selection option); unset: not applied. dedup: true drops duplicates.
    aesthetic_min: Annotated[float, Field(allow_inf_nan=False)] | None = Field(
        None, description="a number (LAION-Aesthetics V2: 4.5 to 6.5; needs aesthetic_model) or null")
    nsfw_max: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="a probability in [0, 1] (LAION: 0.5; needs nsfw_model) or null")
    watermark_max: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="a probability in [0, 1] (SD 1.x: 0.5; needs watermark_model) or null")
    min_original_size: Annotated[int, Field(gt=0)] | None = Field(
        None, description="a positive number of pixels (both original sides at least it) or null")
    caption_min_length: Annotated[int, Field(ge=0)] | None = Field(None, description="an integer >= 0 (characters) or null")
    caption_max_length: Annotated[int, Field(gt=0)] | None = Field(None, description="a positive integer (characters) or null")
    # NeMo text2img: equal-size tars + wdinfo.pkl (reorganize_tar, generate_wdinfo), precached SD encodings
    enable_nemo_text2img: Flag = True
    tar_chunk_size: PositiveInt = 1000
    # the SD autoencoder downsamples 8x (shardprep/nemo/precache.py)
    precache_resolution: int = Field(512, gt=0, multiple_of=8, description="a positive multiple of 8")
    precache_keep_original: Flag = False
    sd_autoencoder: Text = "stabilityai/sd-vae-ft-mse"  # a diffusers AutoencoderKL folder (4 latent channels)
    sd_clip_text_model: Text = "openai/clip-vit-large-patch14"
    # NeMo diffusion samples ({key}..pth latents, ..pickle T5 states, ..json) + Megatron-Energon indexes
    enable_nemo_diffusion: Flag = True
    diffusion_t5_model: Text = "google-t5/t5-11b"  # NeMo DiT's text encoder (d_model 1024)
    diffusion_autoencoder: Text = "black-forest-labs/FLUX.1-schnell/vae"  # 16 latent channels, or cosmos:<dir>
    # 8x autoencoder downsampling, then DiT's 2x2 patches (shardprep/nemo/diffusion.py)
    diffusion_resolution: int = Field(512, gt=0, multiple_of=16, description="a positive multiple of 16")
    nemo_batch_size: PositiveInt = 16
    # video diffusion samples (shardprep/nemo/video_diffusion.py): a causal video autoencoder (cosmos:<dir> of
    # NVIDIA's TorchScript tokenizer, or a diffusers AutoencoderKLCosmos / AutoencoderKLWan folder); clips
    # are cut to video_diffusion_frames at most (then to 1 + k * its temporal compression) and resized
    # so the shorter side is video_diffusion_resolution (both sides multiples of 16)
    video_autoencoder: Text = "nvidia/Cosmos-1.0-Diffusion-7B-Text2World/vae"
    video_diffusion_frames: PositiveInt = 33
    video_diffusion_resolution: int = Field(256, gt=0, multiple_of=16, description="a positive multiple of 16")
    energon_split_ratio: tuple[Share, Share, Share] = Field(  # train, val, test
        (0.9, 0.1, 0.0), description="a list of three non-negative finite numbers [train, val, test], not all zero")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(_describe(e, data)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        # frozen as the dataclass was (pydantic's own refusal is a ValidationError)
        raise AttributeError(f"DatasetConfig is frozen: cannot assign to '{name}'")

    @field_validator("save_additional_columns", "energon_split_ratio", "takedown_lists",
                     "disallowed_header_directives", mode="before")
    @classmethod
    def _list_as_tuple(cls, v: Any, info: ValidationInfo) -> Any:
        # YAML has lists, not tuples; an empty `save_additional_columns:` means none
        if v is None and info.field_name in ("save_additional_columns", "takedown_lists",
                                             "disallowed_header_directives"):
            return ()
        return tuple(v) if isinstance(v, list) else v

    @field_validator("storage_options", mode="before")
    @classmethod
    def _usable_storage_options(cls, v: Any) -> Any:
        # checked before pydantic's types, so the message says which option of which protocol is wrong
        if v is None:  # an empty `storage_options:`
            return {}
        if not isinstance(v, dict):
            raise ValueError(STORAGE_OPTIONS_PROBLEM + "not a mapping")
        for protocol, options in v.items():
            problem = storage.option_problem(str(protocol), options)
            if problem:
                raise ValueError(STORAGE_OPTIONS_PROBLEM + problem)
        return v

    @field_validator("save_additional_columns")
    @classmethod
    def _usable_columns(cls, cols: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(cols)) != len(cols) or _RESERVED_COLUMNS & set(cols):
            raise ValueError("duplicate or reserved column name")
        return cols

    @field_validator("encode_quality")
    @classmethod
    def _quality_in_range(cls, q: int, info: ValidationInfo) -> int:
        hi = 9 if info.data.get("encode_format") == "png" else 100
        if not 0 <= q <= hi:
            raise ValueError(f"out of [0, {hi}]")
        return q

    @field_validator("energon_split_ratio")
    @classmethod
    def _some_split(cls, ratio: tuple[float, float, float]) -> tuple[float, float, float]:
        if not any(ratio):
            raise ValueError("all zero")
        return ratio

    @property
    def oom_sample(self) -> int:
        from shardprep.keys import oom_sample_per_shard

        return oom_sample_per_shard(self.samples_per_shard)

    @property
    def text_embeddings(self) -> bool:
        """clip_embeddings embeds the captions too (``enable_text``, and a caption column to embed)."""
        return self.enable_text and self.caption_col is not None

    @property
    def synthetic_text(self) -> bool:
        """The training outputs take (some of) their text from the synthetic captions (``training_text``)."""
        return self.train_caption != "original"

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump()
        d["save_additional_columns"] = list(self.save_additional_columns)
        d["energon_split_ratio"] = list(self.energon_split_ratio)
        return d


def _without_secrets(value: Any) -> Any:
    """``value`` with the values of options named like credentials masked (errors are logged)."""
    if not isinstance(value, dict):
        return value
    secret = ("key", "secret", "token", "password", "credential")
    return {k: "***" if isinstance(k, str) and any(w in k.lower() for w in secret) else _without_secrets(v)
            for k, v in value.items()}


def _field_error(name: str, value: str, allowed: str | None) -> str:
    return f"config field '{name}': got {value}; allowed: {allowed}"


def _describe(e: ValidationError, raw: dict[str, Any]) -> str:
    """pydantic's errors as one line per field: the field, the value given and what is allowed (the
    field's description, so the validators' own messages are never shown)."""
    fields = DatasetConfig.model_fields
    lines: list[str] = []
    unknown: list[str] = []
    seen: set[str] = set()
    for err in e.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        if err["type"] == "extra_forbidden":
            unknown.append(name)
            continue
        if name in seen:  # one line per field: a list can fail item by item
            continue
        seen.add(name)
        if err["type"] == "missing" and len(err["loc"]) == 1:  # not a short list's missing item
            lines.append(f"config field '{name}' is required")
        elif name == "storage_options":
            problem = str(err.get("ctx", {}).get("error", "")).partition(STORAGE_OPTIONS_PROBLEM)[2]
            given = _without_secrets(raw.get(name))
            lines.append(_field_error(name, f"{given!r} ({type(given).__name__})", fields[name].description)
                         + (f"; here {problem}" if problem else ""))
        elif name in fields:
            given = (f"{raw[name]!r} ({type(raw[name]).__name__})" if name in raw
                     else f"{fields[name].default!r} (the default)")
            lines.append(_field_error(name, given, fields[name].description))
        else:  # not expected: there are no model-level validators
            lines.append(f"config: {err['msg']}")
    if unknown:
        lines.insert(0, _unknown_fields(unknown))
    return "\n".join(lines)


def _unknown_fields(unknown: list[str]) -> str:
    known = sorted(DatasetConfig.model_fields)
    hints = [f"'{close[0]}' instead of '{u}'" for u in unknown
             if (close := difflib.get_close_matches(u, known, n=1))]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"unknown config field(s) {sorted(unknown)}{hint}; known fields: {known}"


def config_from_dict(raw: dict[str, Any], origin: str = "<dict>") -> DatasetConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: the config must be a mapping of fields, got {type(raw).__name__}")
    if not all(isinstance(k, str) for k in raw):  # YAML allows `1: x`; keywords must be strings
        raise ConfigError(f"{origin}: " + _unknown_fields([repr(k) for k in raw if not isinstance(k, str)]))
    try:
        cfg = DatasetConfig(**raw)
    except ConfigError as e:  # every line names the file
        raise ConfigError("\n".join(f"{origin}: {line}" for line in str(e).splitlines())) from None
    if cfg.train_caption != "original" and cfg.captioner is None:
        raise ConfigError(f"{origin}: config field 'train_caption': {cfg.train_caption!r} needs 'captioner' (the model "
                          "that writes the synthetic captions); set one, or train_caption: original")
    if cfg.source is None and cfg.video_source is None:
        raise ConfigError(f"{origin}: config fields 'source' (image rows) and 'video_source' (video rows) are "
                          "both null; set one or both")
    storage.configure(cfg.storage_options)  # before anything under source or output_root is touched
    _check_score_heads(cfg, origin)
    return cfg


# the head kinds (shardprep.curation.scores) each score field takes
SCORE_FIELDS = {"aesthetic_model": ("aesthetic_v2", "aesthetic_v1"), "nsfw_model": ("nsfw_l14", "nsfw_b32", "nsfw_h14")}


def _check_score_heads(cfg: DatasetConfig, origin: str) -> None:
    """Each configured head is readable, of its field's kind, and reads clip_model's embeddings (an L/14
    head on B/32 embeddings is refused here, not after the embeddings are made); the watermark model's
    file is there (its keys are checked when image_scores loads it: that needs torch)."""
    from shardprep.curation.scores import ScoreModelError, load_head
    from shardprep.models.clip import embedding_width
    from shardprep.models.watermark import WatermarkModelError, watermark_file

    problems = [f"config field '{rule}': needs '{field}' (the model whose score it reads)"
                for rule, field in (("aesthetic_min", "aesthetic_model"), ("nsfw_max", "nsfw_model"),
                                    ("watermark_max", "watermark_model"))
                if getattr(cfg, rule) is not None and getattr(cfg, field) is None]
    if cfg.watermark_model is not None:
        try:
            watermark_file(cfg.watermark_model)
        except WatermarkModelError as e:
            problems.append(f"config field 'watermark_model': {e}")
    configured = {name: getattr(cfg, name) for name in SCORE_FIELDS if getattr(cfg, name) is not None}
    width = embedding_width(cfg.clip_model) if configured else None
    for name, spec in configured.items():
        kinds = SCORE_FIELDS[name]
        try:
            head = load_head(spec)
        except ScoreModelError as e:
            problems.append(f"config field '{name}': {e}")
            continue
        if head.kind not in kinds:
            problems.append(f"config field '{name}': {spec} is a {head.kind} head; allowed: {', '.join(kinds)}")
        elif width is not None and head.dim != width:
            problems.append(f"config field '{name}': {spec} ({head.kind}) reads {head.dim}-wide embeddings, but "
                            f"clip_model {cfg.clip_model!r} makes {width}-wide ones: it was trained on another "
                            "CLIP model")
    if problems:
        raise ConfigError("\n".join(f"{origin}: {line}" for line in problems))


def load_config(path: str) -> DatasetConfig:
    """Load a YAML dataset config; relative local paths in it are resolved against the file's folder."""
    import os

    import fsspec

    try:
        with fsspec.open(path, "r") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if isinstance(raw, dict) and "://" not in path:
        base = os.path.dirname(os.path.abspath(path))
        for k in ("source", "video_source", "output_root"):
            v = raw.get(k)
            if isinstance(v, str) and v and "://" not in v and not os.path.isabs(v):
                raw[k] = os.path.normpath(os.path.join(base, v))
    cfg = config_from_dict(raw, origin=path)
    # the shards are written under it: caught here rather than as a FileExistsError mid-run
    if "://" not in cfg.output_root and os.path.isfile(cfg.output_root):
        raise ConfigError(f"{path}: " + _field_error("output_root", f"{cfg.output_root!r}, an existing file",
                                                       "a folder (existing or not)"))
    return cfg


def config_url(path: str) -> str:
    """The config's location as runs carry it: a local path made absolute (the run may execute in
    another directory), a URL (``s3://...``: workers on other machines read the same file) as it is."""
    return os.path.abspath(path) if "://" not in path else path
