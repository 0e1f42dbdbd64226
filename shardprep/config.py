"""The dataset config: one YAML file names the source, the output root and every processing choice.

A wrong or missing field fails at load with a message naming the field (and the file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import yaml

RESIZE_MODES = ("no", "border", "keep_ratio", "keep_ratio_largest", "center_crop")
ENCODE_FORMATS = ("jpg", "png", "webp")


class ConfigError(ValueError):
    """A config field is missing, unknown or has a bad value."""


@dataclass(frozen=True)
class DatasetConfig:
    # where the data comes from and goes to (any fsspec URL; a glob for the source)
    source: str
    output_root: str
    url_col: str = "url"
    caption_col: str | None = "caption"
    save_additional_columns: tuple[str, ...] = ()
    # sharding (img2dataset semantics)
    samples_per_shard: int = 10_000
    oom_shard_count: int = 5
    # images
    image_size: int = 256
    resize_mode: str = "border"
    resize_only_if_bigger: bool = False
    encode_format: str = "jpg"
    encode_quality: int = 95
    extract_exif: bool = True
    # fast_decode: JPEGs that are downscaled are decoded at 1/2-1/8 scale (libjpeg DCT scaling)
    # before the same area resize; same sizes and statuses as img2dataset, pixels within a few
    # grey levels (false: byte-identical to img2dataset's resizer). decode_threads: images
    # decoded/resized at once per shard (0: one per CPU core); downloads keep thread_count.
    fast_decode: bool = True
    decode_threads: int = 0
    # downloads
    timeout: float = 10.0
    retries: int = 0
    thread_count: int = 64
    max_image_bytes: int = 50_000_000
    max_image_pixels: int = 89_478_485  # PIL's decompression-bomb threshold
    allow_private_addresses: bool = False
    user_agent: str = "shardprep/0.1 (+https://github.com/shardprep)"
    # CLIP embeddings (clip-retrieval's model spelling)
    clip_model: str = "ViT-B/32"
    device: str = "auto"
    batch_size: int = 256
    enable_text: bool = True
    # NeMo text2img: equal-size tars + wdinfo.pkl (reorganize_tar, generate_wdinfo), precached SD encodings
    enable_nemo_text2img: bool = True
    tar_chunk_size: int = 1000
    precache_resolution: int = 512
    precache_keep_original: bool = False
    sd_autoencoder: str = "stabilityai/sd-vae-ft-mse"  # a diffusers AutoencoderKL folder (4 latent channels)
    sd_clip_text_model: str = "openai/clip-vit-large-patch14"
    # NeMo diffusion samples ({key}..pth latents, ..pickle T5 states, ..json) + Megatron-Energon indexes
    enable_nemo_diffusion: bool = True
    diffusion_t5_model: str = "google-t5/t5-11b"  # NeMo DiT's text encoder (d_model 1024)
    diffusion_autoencoder: str = "black-forest-labs/FLUX.1-schnell/vae"  # 16 latent channels, or cosmos:<dir>
    diffusion_resolution: int = 512
    nemo_batch_size: int = 16
    energon_split_ratio: tuple[float, float, float] = (0.9, 0.1, 0.0)  # train, val, test

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def oom_sample(self) -> int:
        from shardprep.keys import oom_sample_per_shard

        return oom_sample_per_shard(self.samples_per_shard)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["save_additional_columns"] = list(self.save_additional_columns)
        d["energon_split_ratio"] = list(self.energon_split_ratio)
        return d


_REQUIRED = ("source", "output_root")
def _fail(name: str, msg: str) -> None:
    raise ConfigError(f"config field '{name}': {msg}")


def _validate(c: DatasetConfig) -> None:
    for name in ("source", "output_root", "url_col", "clip_model", "device", "user_agent"):
        v = getattr(c, name)
        if not isinstance(v, str) or not v.strip():
            _fail(name, f"must be a non-empty string, got {v!r}")
    if c.caption_col is not None and (not isinstance(c.caption_col, str) or not c.caption_col):
        _fail("caption_col", f"must be a column name or null, got {c.caption_col!r}")
    for name in ("samples_per_shard", "image_size", "thread_count", "batch_size",
                 "max_image_bytes", "max_image_pixels", "oom_shard_count"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(name, f"must be a positive integer, got {v!r}")
    if isinstance(c.decode_threads, bool) or not isinstance(c.decode_threads, int) or c.decode_threads < 0:
        _fail("decode_threads", f"must be an integer >= 0 (0: one per CPU core), got {c.decode_threads!r}")
    if isinstance(c.retries, bool) or not isinstance(c.retries, int) or c.retries < 0:
        _fail("retries", f"must be an integer >= 0, got {c.retries!r}")
    if isinstance(c.timeout, bool) or not isinstance(c.timeout, (int, float)) or c.timeout <= 0:
        _fail("timeout", f"must be a positive number of seconds, got {c.timeout!r}")
    if c.resize_mode not in RESIZE_MODES:
        _fail("resize_mode", f"must be one of {', '.join(RESIZE_MODES)}; got {c.resize_mode!r}")
    if c.encode_format not in ENCODE_FORMATS:
        _fail("encode_format", f"must be one of {', '.join(ENCODE_FORMATS)}; got {c.encode_format!r}")
    q = c.encode_quality
    lo, hi = (0, 9) if c.encode_format == "png" else (0, 100)
    if isinstance(q, bool) or not isinstance(q, int) or not lo <= q <= hi:
        _fail("encode_quality", f"must be an integer in [{lo}, {hi}] for {c.encode_format}, got {q!r}")
    for name in ("resize_only_if_bigger", "extract_exif", "allow_private_addresses", "enable_text", "fast_decode"):
        if not isinstance(getattr(c, name), bool):
            _fail(name, f"must be true or false, got {getattr(c, name)!r}")
    if not (c.device == "auto" or c.device == "cpu" or c.device.startswith("cuda")):
        _fail("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {c.device!r}")
    reserved = {"url", "caption", "key", "status", "error_message", "width", "height",
                "original_width", "original_height", "exif", "sha256"}
    for col in c.save_additional_columns:
        if not isinstance(col, str) or col in reserved:
            _fail("save_additional_columns", f"{col!r} is not a usable column name (reserved: {sorted(reserved)})")


def config_from_dict(raw: dict[str, Any], origin: str = "<dict>") -> DatasetConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: the config must be a mapping of fields, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(DatasetConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{origin}: unknown config field(s) {unknown}; known fields: {sorted(known)}")
    missing = [k for k in _REQUIRED if raw.get(k) in (None, "")]
    if missing:
        raise ConfigError(f"{origin}: config field '{missing[0]}' is required")
    values = dict(raw)
    if isinstance(values.get("energon_split_ratio"), list):
        values["energon_split_ratio"] = tuple(values["energon_split_ratio"])
    if "save_additional_columns" in values:
        cols = values["save_additional_columns"] or []
        if not isinstance(cols, (list, tuple)):
            raise ConfigError(f"{origin}: config field 'save_additional_columns': must be a list of column names")
        values["save_additional_columns"] = tuple(cols)
    try:
        return DatasetConfig(**values)
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None


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
        for k in ("source", "output_root"):
            v = raw.get(k)
            if isinstance(v, str) and v and "://" not in v and not os.path.isabs(v):
                raw[k] = os.path.normpath(os.path.join(base, v))
    return config_from_dict(raw, origin=path)
