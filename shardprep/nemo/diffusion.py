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

import contextlib
import hashlib
import io
import json
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from shardprep import storage
from shardprep.clip_samples import IMAGE_EXTS
from shardprep.encode import encode_tar, finish, input_missing, positive_int
from shardprep.layout import Layout
from shardprep.models.nemo import preprocess_image
from shardprep.tars import MemberHeader, TarWriter, header_samples, read_payloads
from shardprep.training_text import train_text

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
    latents_reused: int = 0  # copied from the tar this one replaces (same image, autoencoder, resolution)
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


def parse_sample(sample: dict, url: str, exts: tuple[str, ...], what: str,
                 synthetic_text: bool = False) -> tuple[str, str, dict] | dict:
    """``(media extension, caption, json meta)`` of a tar sample a diffusion sample is made from, or a
    failure record ``{"key", "reason"}`` (no ``what`` member among ``exts``, no or undecodable caption,
    invalid json: recorded, never a crash). ``synthetic_text``: the caption is the one the json says the
    sample trains with (``shardprep.training_text``)."""
    key = sample["__key__"]
    ext = next((e for e in exts if e in sample), None)
    if ext is None:
        return {"key": key, "reason": f"no {what} member (" + "/".join(exts) + ")"}
    try:
        caption = sample["txt"].decode("utf-8") if "txt" in sample else None
    except UnicodeDecodeError as e:
        return {"key": key, "reason": f"caption is not UTF-8: {e}"}
    try:
        meta = json.loads(sample["json"].decode("utf-8")) if "json" in sample else {}
    except ValueError as e:
        return {"key": key, "reason": f"{url}: .json is not valid JSON ({e})"}
    meta = meta if isinstance(meta, dict) else {}
    caption = train_text(meta, caption, synthetic_text)
    if caption is None:
        return {"key": key, "reason": "no .txt caption"}
    return ext, caption, meta


def latent_id(image: bytes, autoencoder: str, resolution: int) -> str:
    """What a latent is made from: the image's bytes, the autoencoder and the resolution (stored in the
    sample's json, so a later run whose text alone changed keeps the latent)."""
    h = hashlib.blake2b(image, digest_size=12)
    h.update(f"\0{autoencoder}\0{resolution}".encode("utf-8"))
    return h.hexdigest()


def _old_latents(url: str) -> dict[str, tuple[str, MemberHeader]]:
    """``{key: (latent_id, the .pth member's header)}`` of the diffusion tar already at ``url`` (none, or
    unreadable: {} -- everything is encoded)."""
    if not storage.exists(url):
        return {}
    try:
        samples, _ = header_samples(url)
        jsons = read_payloads(url, [{"__key__": s["__key__"], "json": s[".json"]} for s in samples if ".json" in s])
        out = {}
        for s in samples:
            lid = json.loads(jsons[s["__key__"]]["json"]).get("latent_id") if s["__key__"] in jsons else None
            if isinstance(lid, str) and ".pth" in s:
                out[s["__key__"]] = (lid, s[".pth"])
        return out
    except Exception:  # noqa: BLE001 - a tar we cannot read back is simply made again
        return {}


def _prepare(sample: dict, resolution: int, url: str, synthetic_text: bool = False,
             latent_of: Callable[[bytes], str] | None = None, held: dict | None = None) -> dict:
    """Decode + preprocess one sample (worker thread); a bad sample becomes a failure record.
    ``latent_of(image)``: its ``latent_id``; ``held``: ``_old_latents`` of the tar being replaced (a sample
    whose latent it holds is not decoded: ``"reused"``)."""
    key, parsed = sample["__key__"], parse_sample(sample, url, IMAGE_EXTS, "image", synthetic_text)
    if isinstance(parsed, dict):
        return parsed
    ext, caption, meta = parsed
    lid = latent_of(sample[ext]) if latent_of is not None else None
    item = {"key": key, "caption": caption, "meta": meta, "latent_id": lid}
    if held and key in held and held[key][0] == lid:
        return {**item, "reused": True}
    try:
        return {**item, "tensor": preprocess_image(sample[ext], resolution)}
    except Exception as e:  # noqa: BLE001 - a bad image is a recorded failure, never a crash
        return {"key": key, "reason": f"image decode/preprocess failed: {type(e).__name__}: {e}"}


def pth_bytes(latent) -> bytes:
    import torch

    buf = io.BytesIO()
    # clone: torch.save writes a view's whole storage (here the entire batch) without it
    torch.save(latent.to(torch.bfloat16).contiguous().clone(), buf)
    return buf.getvalue()


def write_diffusion_samples(shard: str, layout: Layout, t5: "T5TextEncoder", vae: "ImageAutoencoder",
                            resolution: int = 256, batch_size: int = 16,
                            scores: dict[str, dict[str, float]] | None = None,
                            synthetic_text: bool = False, reuse_latents: bool = True) -> DiffusionReport:
    """Encode every sample of ``layout.tar(shard)`` and write ``layout.diffusion_tar(shard)``.

    ``resolution`` must be a multiple of 16 (8x autoencoder downsampling, then DiT's 2x2 patches).
    ``scores``: ``{key: {"aesthetic_score": x}}`` (``image_scores.read_scores``), used over the source's.
    ``synthetic_text``: the T5 states and the json's ``caption`` are of the caption each sample trains with
    (its json's ``train_caption``, ``shardprep.training_text``). ``reuse_latents``: a latent the existing tar
    holds for the same image bytes, autoencoder and resolution (its json's ``latent_id``) is copied, not
    encoded again.
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

    # a latent already in the tar, of the same image, autoencoder and resolution, is kept: a run whose
    # text alone changed (train_caption) encodes the T5 states again, never an image
    old = _old_latents(out_url) if reuse_latents else {}

    def prepare(sample: dict) -> dict:
        return _prepare(sample, resolution, in_url, synthetic_text,
                        lambda image: latent_id(image, vae.path, resolution), old)

    def encode(ready: list[dict], out: TarWriter, old_file) -> None:
        fresh = [it for it in ready if "tensor" in it]
        made = iter(vae.encode(torch.stack([it["tensor"] for it in fresh]), output="mean") if fresh else [])
        texts = t5.encode([it["caption"] for it in ready])
        for it, txt in zip(ready, texts):
            if "tensor" in it:
                lat = next(made).to(torch.bfloat16).unsqueeze(1)  # [C, T=1, h, w]; checked as stored
                problem = latent_problem(lat)
            else:  # reused: checked when it was first written
                header = old[it["key"]][1]
                old_file.seek(header.data_offset)
                lat, problem = old_file.read(header.size), None
                report.latents_reused += 1
                if report.latent_shape is None:  # every latent of a shard has one shape
                    report.latent_shape = list(torch.load(io.BytesIO(lat), weights_only=True).shape)
            if problem is None and not np.isfinite(txt).all():
                problem = "T5 text states have NaN/Inf values"
            if problem is not None:
                report.failures.append({"key": it["key"], "reason": problem})
                continue
            meta = {"image_height": resolution, "image_width": resolution,
                    "aesthetic_score": aesthetic_score({**it["meta"], **(scores or {}).get(it["key"], {})}),
                    "caption": it["caption"],
                    "source_key": it["key"], "latent_id": it["latent_id"]}
            out.add(it["key"], {
                ".json": json.dumps(meta),
                ".pickle": pickle.dumps(txt),
                ".pth": lat if isinstance(lat, bytes) else pth_bytes(lat),
            })
            if not isinstance(lat, bytes):
                report.latent_shape = list(lat.shape)
            report.text_dim = int(txt.shape[1])

    # decoding/resizing of upcoming samples runs in threads while the models encode a batch; the tar
    # being replaced stays readable until the new one is published (atomic)
    with storage.open_read(out_url) if old else contextlib.nullcontext() as old_file:
        done = encode_tar(in_url, out_url, prepare, lambda ready, out: encode(ready, out, old_file),
                          batch_size=batch_size, threads=_DECODE_THREADS, in_flight=2 * batch_size,
                          failures=report.failures)
    report.input_samples, report.samples = done.read, done.written
    report.tar_written, report.tar_bytes = done.written > 0, done.tar_bytes
    return finish(report, start)
