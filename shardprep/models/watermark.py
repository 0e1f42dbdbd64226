"""LAION's watermark detector (LAION-AI/LAION-5B-WatermarkDetection), read from its published weights.

The file (``watermark_model_v1.pt``: a ``torch.save``d state dict; or the same keys as ``.safetensors``)
holds timm's EfficientNet-B3 with its classifier replaced by LAION's MLP (``build_detector``). Its input
is LAION's ``example_use.py``/``inference.py`` preprocess: ``T.Resize((256, 256))`` (both sides: the
aspect is not kept; PIL bilinear with antialiasing), ``ToTensor``, ``Normalize`` with ImageNet's mean/std;
the RGB conversion is ours (LAION's code feeds a grey or RGBA image as it is, which the model refuses).

``pwatermark`` (LAION's parquet column) is the softmax of the two logits at index 0. Relied on:
``example_use.py`` unpacks ``water_sym, clear_sym = softmax(pred)`` and ``inference.py`` writes
``out[i][0], out[i][1]`` as columns ``'P Watermark', 'P Clean'``: index 0 is the watermark.

Speed: a JPEG bigger than 256 px on both sides is decoded at a reduced DCT scale (PIL ``draft``) that
keeps both sides >= 256, then resized exactly as above: a big photo costs about a third of a full decode
and scores within 0.02 of the full-size preprocess (tests/test_watermark.py); other images are exact.
Images are decoded in a thread pool (PIL releases the GIL), one batch ahead of the model.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import numpy as np

from shardprep.clip_samples import IMAGE_EXTS
from shardprep.curation.scores import ScoreModelError, head_file

SIZE = 256  # LAION's T.Resize((256, 256))
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as LAION's Normalize
WATERMARK_INDEX = 0  # softmax index of "watermark" (see the module docstring)


class WatermarkModelError(ScoreModelError):
    """The watermark model's file cannot be read or is not LAION's detector."""


def build_detector():
    """LAION's architecture with random weights (``eval()`` not called): timm's EfficientNet-B3, its
    classifier replaced by LAION's 1536 -> 625 -> 256 -> 2 MLP."""
    import timm
    from torch import nn

    # LAION names "efficientnet_b3a", which timm >= 0.9 maps (with a warning) to "efficientnet_b3": the
    # same network ("a" only named other pretrained weights and test size); asked by its current name
    model = timm.create_model("efficientnet_b3", pretrained=False, num_classes=2)
    model.classifier = nn.Sequential(nn.Linear(1536, 625), nn.ReLU(), nn.Dropout(p=0.3),
                                     nn.Linear(625, 256), nn.ReLU(), nn.Linear(256, 2))
    return model


@dataclass
class WatermarkDetector:
    """LAION's detector loaded on ``device``; called with uint8 RGB ``[N, 256, 256, 3]`` images."""

    path: str  # as configured
    device: str
    model: Any  # the torch module, in eval mode

    def __call__(self, images: np.ndarray) -> np.ndarray:
        """``pwatermark`` (float32 [N]) of ``decode_for_watermark`` outputs stacked."""
        import torch

        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
            # ToTensor then Normalize: the same float32 operations in the same order, into the same
            # contiguous NCHW layout (a channels-last input picks other conv kernels: other low bits)
            x = x.permute(0, 3, 1, 2).contiguous().float().div(255)
            mean = torch.tensor(MEAN, device=self.device).view(3, 1, 1)
            std = torch.tensor(STD, device=self.device).view(3, 1, 1)
            probs = torch.softmax(self.model(x.sub(mean).div(std)), dim=1)
            return probs[:, WATERMARK_INDEX].float().cpu().numpy()


_CACHE: dict[tuple[str, str, float, int, str], WatermarkDetector] = {}
_LOCK = threading.Lock()


def watermark_file(spec: str) -> str:
    """A local file holding the model ``spec`` names, found as score heads are (``head_file``); no torch."""
    try:
        return head_file(spec)
    except ScoreModelError as e:  # its message, naming a watermark model
        raise WatermarkModelError(str(e).replace("score head", "watermark model", 1)) from None


def load_watermark_model(spec: str, device: str = "auto") -> WatermarkDetector:
    """LAION's detector from ``spec`` (a local path, an fsspec URL or a cached hub id, as score heads:
    ``curation.scores.head_file``), loaded strictly on ``device`` (``auto``: CUDA when there is one); once
    per process, file version and device."""
    from shardprep.models.clip import resolve_device

    local = watermark_file(spec)
    resolved = resolve_device(device)
    st = os.stat(local)
    key = (spec, local, st.st_mtime, st.st_size, resolved)  # a rewritten file is loaded again
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = WatermarkDetector(spec, resolved, _load(local, spec).to(resolved))
        return _CACHE[key]


def _load(local: str, spec: str):
    import torch

    try:
        if local.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(local)
        else:
            state = torch.load(local, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is named with its cause
        raise WatermarkModelError(f"watermark model {spec}: cannot read it as a state dict "
                                  f"({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WatermarkModelError(f"watermark model {spec}: holds a {type(state).__name__}, not a state dict "
                                  "of tensors (LAION's watermark_model_v1.pt is one)")
    model = build_detector()
    not_it = f"watermark model {spec}: not LAION's watermark detector (EfficientNet-B3 + a 1536-625-256-2 classifier)"
    try:  # strict, with the keys named: strict=True's message lists every one of hundreds
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        raise WatermarkModelError(f"{not_it}: {str(e).splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise WatermarkModelError(f"{not_it}: {len(missing)} keys missing {missing[:4]}, "
                                  f"{len(unexpected)} unexpected {unexpected[:4]}")
    return model.eval()


def decode_for_watermark(data: bytes) -> np.ndarray:
    """Image bytes -> uint8 RGB ``[256, 256, 3]``, what LAION's ``T.Resize((256, 256))`` makes of the
    RGB image; raises like PIL for an undecodable image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.format == "JPEG":
            # DCT scaling: PIL picks the largest 1/2, 1/4, 1/8 that keeps both sides >= SIZE (none when the
            # image is smaller); the exact resize below then averages what is left
            im.draft("RGB", (SIZE, SIZE))
        return watermark_pixels(im.convert("RGB"))


def watermark_pixels(rgb) -> np.ndarray:
    """A decoded RGB PIL image -> uint8 ``[256, 256, 3]`` (also ``shardprep.pixels``' step after its one
    decode, which may keep more pixels than the DCT reduction above: the resize averages them all)."""
    from PIL import Image

    if rgb.size != (SIZE, SIZE):
        rgb = rgb.resize((SIZE, SIZE), Image.BILINEAR)  # torchvision's Resize on a PIL image: this call
    return np.asarray(rgb)


class WatermarkScores(NamedTuple):
    keys: list[str]  # every sample of the tar, in tar order
    pwatermark: np.ndarray  # float32, NaN where skipped
    skipped: list[dict]  # {"key", "reason"}: no image, or it cannot be decoded
    model: str  # the detector's path, as configured


def _decode_sample(sample: dict) -> np.ndarray:
    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    if ext is None:
        raise ValueError("no image member (" + "/".join(IMAGE_EXTS) + ")")
    return decode_for_watermark(sample[ext])


def score_watermarks(tar_url: str, detector: WatermarkDetector, batch_size: int = 64,
                     threads: int = 0) -> WatermarkScores:
    """``pwatermark`` of every sample of the webdataset tar at ``tar_url``; a sample whose image cannot be
    decoded is a recorded skip (NaN), never an error. ``threads``: decode threads (0: one per core)."""
    from shardprep.tars import iter_samples

    keys: list[str] = []
    scores: list[np.ndarray] = []
    skipped: list[dict] = []

    def run(batch: list[tuple[str, Future]]) -> None:
        out = np.full(len(batch), np.nan, np.float32)
        rows, at = [], []
        for i, (key, decoded) in enumerate(batch):
            keys.append(key)
            try:
                rows.append(decoded.result())
                at.append(i)
            except Exception as e:  # noqa: BLE001 - a bad image is a recorded skip
                skipped.append({"key": key, "reason": f"image decode failed: {type(e).__name__}: {e}"})
        if rows:
            out[at] = detector(np.stack(rows))
        scores.append(out)

    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    samples = iter_samples(tar_url)
    with ThreadPoolExecutor(threads) as pool:
        ahead: list[tuple[str, Future]] = []  # decoded while the model scores the batch before
        while True:
            started = [(s["__key__"], pool.submit(_decode_sample, s)) for s in islice(samples, batch_size)]
            if ahead:
                run(ahead)
            if not started:
                break
            ahead = started
    pw = np.concatenate(scores) if scores else np.zeros(0, np.float32)
    return WatermarkScores(keys, pw, skipped, detector.path)
