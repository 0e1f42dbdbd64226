"""NeMo diffusion (DiT) samples of one image shard, in the format NeMo's ``BasicDiffusionTaskEncoder`` reads.

``layout.tar(shard)`` (img2dataset layout) -> ``layout.diffusion_tar(shard)`` with, per image, the
members (note the double dot, as NeMo's ``ShardWriter`` keys ``".pth"`` etc. produce):

* ``{key}..pth``: ``torch.save`` of the bfloat16 latent ``[C, T=1, h, w]`` (no batch dim), the
  autoencoder's ``latent_dist.mean`` of the image resized (shorter side, bicubic) and center-cropped
  to ``resolution`` -- unscaled, as the Cosmos tokenizer's latent would be stored;
* ``{key}..pickle``: pickle of the numpy float16 T5 hidden states ``[L, d]``, L = the caption's real
  token count (no padding; the task encoder pads to 512);
* ``{key}..json``: ``image_height``/``image_width`` (of the resized image fed to the autoencoder),
  ``aesthetic_score`` (the computed score of image_scores when given, else the sample json's
  ``aesthetic_score``/``AESTHETIC_SCORE``/``aesthetic`` field when numeric, else 0.0 -- the task encoder raises KeyError without it and skips scores below its
  threshold, 0.0 by default), ``caption`` and ``source_key`` (the image key).

Keys are the image keys (globally unique, as Megatron-Energon requires). A sample without a
decodable image or a ``.txt`` caption, or whose latent NeMo would skip (NaN/Inf or ``max|x| > 1e3``)
or whose T5 states are not finite, is a recorded failure and not written. A shard with no written
sample gets no tar (energon's ``prepare`` asserts on empty shards); the tar is written atomically.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shardprep.clip_samples import IMAGE_EXTS
from shardprep.encode import encode_tar, finish, input_missing, positive_int
from shardprep.layout import Layout
from shardprep.models.nemo import preprocess_image
from shardprep.tars import TarWriter

if TYPE_CHECKING:
    from shardprep.models.nemo import ImageAutoencoder, T5TextEncoder

LATENT_ABS_LIMIT = 1e3  # BasicDiffusionTaskEncoder.encode_sample skips latents above it
AESTHETIC_FIELDS = ("aesthetic_score", "AESTHETIC_SCORE", "aesthetic")
_DECODE_THREADS = 2


@dataclass
class DiffusionReport:
    shard: str
    input_samples: int = 0
    samples: int = 0  # written
    failures: list[dict] = field(default_factory=list)  # {"key", "reason"} per sample not written
    latent_shape: list[int] | None = None  # [C, 1, h, w]
    text_dim: int | None = None
    tar_written: bool = False
    tar_bytes: int = 0
    seconds: float = 0.0


def latent_problem(latent) -> str | None:
    """Why NeMo's task encoder would skip this latent (NaN/Inf, ``max|x| > 1e3``), or None."""
    import torch

    if not bool(torch.isfinite(latent).all()):
        return "latent has NaN/Inf values"
    peak = float(latent.abs().max()) if latent.numel() else 0.0
    if peak > LATENT_ABS_LIMIT:
        return f"latent max |x| = {peak:.4g} > {LATENT_ABS_LIMIT:g}"
    return None


def aesthetic_score(meta: dict) -> float:
    for name in AESTHETIC_FIELDS:
        v = meta.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return 0.0


def parse_sample(sample: dict, url: str, exts: tuple[str, ...], what: str) -> tuple[str, str, dict] | dict:
    """``(media extension, caption, json meta)`` of a tar sample a diffusion sample is made from, or a
    failure record ``{"key", "reason"}`` (no ``what`` member among ``exts``, no or undecodable caption,
    invalid json: recorded, never a crash)."""
    key = sample["__key__"]
    ext = next((e for e in exts if e in sample), None)
    if ext is None:
        return {"key": key, "reason": f"no {what} member (" + "/".join(exts) + ")"}
    if "txt" not in sample:
        return {"key": key, "reason": "no .txt caption"}
    try:
        caption = sample["txt"].decode("utf-8")
    except UnicodeDecodeError as e:
        return {"key": key, "reason": f"caption is not UTF-8: {e}"}
    try:
        meta = json.loads(sample["json"].decode("utf-8")) if "json" in sample else {}
    except ValueError as e:
        return {"key": key, "reason": f"{url}: .json is not valid JSON ({e})"}
    return ext, caption, meta if isinstance(meta, dict) else {}


def _prepare(sample: dict, resolution: int, url: str) -> dict:
    """Decode + preprocess one sample (worker thread); a bad sample becomes a failure record."""
    key, parsed = sample["__key__"], parse_sample(sample, url, IMAGE_EXTS, "image")
    if isinstance(parsed, dict):
        return parsed
    ext, caption, meta = parsed
    try:
        tensor = preprocess_image(sample[ext], resolution)
    except Exception as e:  # noqa: BLE001 - a bad image is a recorded failure, never a crash
        return {"key": key, "reason": f"image decode/preprocess failed: {type(e).__name__}: {e}"}
    return {"key": key, "tensor": tensor, "caption": caption, "meta": meta}


def pth_bytes(latent) -> bytes:
    import torch

    buf = io.BytesIO()
    # clone: torch.save writes a view's whole storage (here the entire batch) without it
    torch.save(latent.to(torch.bfloat16).contiguous().clone(), buf)
    return buf.getvalue()


def write_diffusion_samples(shard: str, layout: Layout, t5: "T5TextEncoder", vae: "ImageAutoencoder",
                            resolution: int = 256, batch_size: int = 16,
                            scores: dict[str, dict[str, float]] | None = None) -> DiffusionReport:
    """Encode every sample of ``layout.tar(shard)`` and write ``layout.diffusion_tar(shard)``.

    ``resolution`` must be a multiple of 16 (8x autoencoder downsampling, then DiT's 2x2 patches).
    ``scores``: ``{key: {"aesthetic_score": x}}`` (``image_scores.read_scores``), used over the source's.
    A missing input tar, or no sample surviving, leaves no output tar (a stale one is removed).
    """
    import torch

    positive_int("diffusion resolution", resolution, multiple=16)
    positive_int("batch_size", batch_size)
    start = time.perf_counter()
    report = DiffusionReport(shard=shard)
    in_url, out_url = layout.tar(shard), layout.diffusion_tar(shard)
    if input_missing(in_url, out_url):
        return finish(report, start)

    def prepare(sample: dict) -> dict:
        return _prepare(sample, resolution, in_url)

    def encode(ready: list[dict], out: TarWriter) -> None:
        latents = vae.encode(torch.stack([it["tensor"] for it in ready]), output="mean")
        texts = t5.encode([it["caption"] for it in ready])
        for it, lat, txt in zip(ready, latents, texts):
            lat = lat.to(torch.bfloat16).unsqueeze(1)  # [C, T=1, h, w]; checked as stored
            problem = latent_problem(lat)
            if problem is None and not np.isfinite(txt).all():
                problem = "T5 text states have NaN/Inf values"
            if problem is not None:
                report.failures.append({"key": it["key"], "reason": problem})
                continue
            meta = {"image_height": resolution, "image_width": resolution,
                    "aesthetic_score": aesthetic_score({**it["meta"], **(scores or {}).get(it["key"], {})}),
                    "caption": it["caption"],
                    "source_key": it["key"]}
            out.add(it["key"], {
                ".json": json.dumps(meta),
                ".pickle": pickle.dumps(txt),
                ".pth": pth_bytes(lat),
            })
            report.latent_shape = list(lat.shape)
            report.text_dim = int(txt.shape[1])

    # decoding/resizing of upcoming samples runs in threads while the models encode a batch
    done = encode_tar(in_url, out_url, prepare, encode, batch_size=batch_size, threads=_DECODE_THREADS,
                      in_flight=2 * batch_size, failures=report.failures)
    report.input_samples, report.samples = done.read, done.written
    report.tar_written, report.tar_bytes = done.written > 0, done.tar_bytes
    return finish(report, start)
