"""NeMo Stable-Diffusion precached encodings of one balanced tar (NeMo-Framework-Launcher's
``precache_encodings`` stage with ``precache_sd.yaml``).

Per input sample ``{key}`` (img2dataset members: an image and ``.txt``), the output tar holds
``{key}.pickle`` = ``pickle.dumps({"autoencoderkl_image": float16 [2C, h, w], "clip-vit-large-patch14_text":
float32 [80, d]})`` -- the two keys NeMo's ``build_train_valid_precached_datasets`` reads:

* ``autoencoderkl_image``: the autoencoder's ``latent_dist.parameters`` (mean||logvar; ``[8, 64, 64]``
  for SD's 4-channel VAE at 512), of the image prepared as NeMo does: RGB, Resize(resolution, bicubic)
  -> CenterCrop -> ToTensor -> Normalize(0.5) ([-1, 1]);
* ``clip-vit-large-patch14_text``: CLIP text ``last_hidden_state`` for 77 tokens zero-padded to 80
  (``nemo_encoders.ClipTextEncoder``, as NeMo's ``FrozenCLIPEmbedder``).

With ``keep_original`` the original image and ``.txt`` members are copied too (NeMo's
``save_original_in_tar``; here the original bytes, not a re-encode). Members are named by the source
key rather than NeMo's running index (readers only group by key), so samples stay traceable.

NeMo's wdinfo reader assumes every tar holds exactly ``chunk_size`` samples, so this stage never drops
one: a sample without an image or caption, or with an undecodable image, is an error naming the tar
and key (balanced tars hold images img2dataset already decoded). Non-finite encodings are written
(count preserved) and listed in the report.
"""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shardprep import storage
from shardprep.clip_samples import IMAGE_EXTS
from shardprep.encode import encode_tar, finish, positive_int
from shardprep.errors import ShardprepError
from shardprep.layout import Layout
from shardprep.models.nemo import preprocess_image
from shardprep.nemo.balanced import tar_digests
from shardprep.storage import exists
from shardprep.tars import TarWriter, numbered_tars

if TYPE_CHECKING:
    from shardprep.models.nemo import ClipTextEncoder, ImageAutoencoder

IMAGE_KEY = "autoencoderkl_image"
TEXT_KEY = "clip-vit-large-patch14_text"


class PrecacheError(ShardprepError, ValueError):
    """A balanced tar cannot be precached without dropping a sample."""


@dataclass
class PrecacheReport:
    input_url: str
    output_url: str
    samples: int = 0
    image_shape: list[int] | None = None  # [2C, h, w]
    text_shape: list[int] | None = None  # [80, d]
    nonfinite_keys: list[str] = field(default_factory=list)  # written anyway (count must match)
    tar_written: bool = False
    tar_bytes: int = 0
    seconds: float = 0.0


def write_precached_encodings(balanced_tar_url: str, out_url: str, vae: "ImageAutoencoder",
                              clip_text: "ClipTextEncoder", keep_original: bool = False,
                              resolution: int = 512, batch_size: int = 16) -> PrecacheReport:
    """Precache every sample of ``balanced_tar_url`` into the tar ``out_url`` (written atomically)."""
    import torch

    positive_int("precache resolution", resolution, multiple=8)
    positive_int("batch_size", batch_size)
    start = time.perf_counter()
    report = PrecacheReport(input_url=balanced_tar_url, output_url=out_url)
    if not exists(balanced_tar_url):
        raise FileNotFoundError(f"balanced tar {balanced_tar_url} does not exist")

    def encode(batch: list[dict], out: TarWriter) -> None:
        images = []
        for it in batch:
            try:
                images.append(preprocess_image(it["sample"][it["ext"]], resolution))
            except Exception as e:
                raise PrecacheError(f"{balanced_tar_url}: sample {it['key']!r}: image cannot be decoded "
                                    f"({type(e).__name__}: {e}); precache would lose a sample") from e
        params = vae.encode(torch.stack(images), output="parameters").to(torch.float16).numpy()
        texts = clip_text.encode([it["caption"] for it in batch])  # float32 [B, 80, d]
        for it, img, txt in zip(batch, params, texts):
            img = np.ascontiguousarray(img)
            txt = np.ascontiguousarray(txt)
            if not (np.isfinite(img).all() and np.isfinite(txt).all()):
                report.nonfinite_keys.append(it["key"])
            members: dict[str, bytes | str] = {"pickle": pickle.dumps({IMAGE_KEY: img, TEXT_KEY: txt})}
            if keep_original:
                members[it["ext"]] = it["sample"][it["ext"]]
                members["txt"] = it["sample"]["txt"]
            out.add(it["key"], members)
            report.image_shape, report.text_shape = list(img.shape), list(txt.shape)

    def checked(s: dict) -> dict:
        ext = next((e for e in IMAGE_EXTS if e in s), None)
        if ext is None or "txt" not in s:
            what = "an image (" + "/".join(IMAGE_EXTS) + ")" if ext is None else "a .txt caption"
            raise PrecacheError(f"{balanced_tar_url}: sample {s['__key__']!r} has no {what}; "
                                "precache would lose a sample")
        try:
            caption = s["txt"].decode("utf-8")
        except UnicodeDecodeError as e:
            raise PrecacheError(f"{balanced_tar_url}: sample {s['__key__']!r}: caption is not UTF-8 ({e})") from e
        # a new dict, not the sample: a member named "reason" must not read as a failure record
        return {"key": s["__key__"], "ext": ext, "caption": caption, "sample": s}

    # streamed batch by batch (checked in this thread: cheap), images decoded per batch; an error
    # mid-way leaves no output
    done = encode_tar(balanced_tar_url, out_url, checked, encode, batch_size=batch_size)
    report.samples, report.tar_written, report.tar_bytes = done.written, done.written > 0, done.tar_bytes
    return finish(report, start)


# ---------------------------------------------------------------- which balanced tars to (re-)encode

SOURCES_NAME = ".sources.json"  # hidden: wdinfo and energon list only tars


def sources_url(layout: Layout) -> str:
    return f"{layout.precached_dir}/{SOURCES_NAME}"


def recorded_sources(layout: Layout) -> dict[int, str]:
    """``{tar index: digest of the balanced tar it was encoded from}``. A folder written before digests
    were recorded adopts the balanced tars' current digests for the tars it has (complete balanced tars
    never changed then)."""
    text = storage.read_text(sources_url(layout))
    if text is not None:
        return {int(i): d for i, d in json.loads(text)["tars"].items()}
    digests = tar_digests(layout)
    return {i: d for i, d in digests.items() if storage.exists(layout.precached_tar(i))}


def record_sources(layout: Layout, sources: dict[int, str]) -> None:
    storage.write_bytes(sources_url(layout), json.dumps(
        {"tars": {f"{i:05d}": d for i, d in sorted(sources.items())}}).encode("utf-8"))


@dataclass
class PrecachePlan:
    todo: list[int]  # complete balanced tars without a current encoding
    gone: list[int]  # encodings whose balanced tar is no longer complete (its samples moved or went)
    digests: dict[int, str]  # the complete balanced tars' digests
    recorded: dict[int, str]


def plan_precache(layout: Layout) -> PrecachePlan:
    """What precached_encodings must do to match the balanced tars: encode the complete tars that are
    new or whose samples changed since they were encoded, remove encodings of tars no longer complete."""
    digests, recorded = tar_digests(layout), recorded_sources(layout)
    on_disk = numbered_tars(layout.precached_dir)
    todo = [i for i in sorted(digests) if recorded.get(i) != digests[i] or i not in on_disk]
    gone = sorted((set(recorded) | on_disk) - set(digests))
    return PrecachePlan(todo, gone, digests, recorded)
