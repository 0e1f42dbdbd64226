"""CLIP image/text encoder loaded through all_clip, so every clip-retrieval model spec works.

Specs: ``ViT-B/32`` (OpenAI, clip-anytorch), ``open_clip:ARCH/PRETRAINED``, ``hf_clip:NAME_OR_DIR``.
Embeddings are computed the way clip-retrieval's ``ClipMapper`` does (``encode_image``/``encode_text``,
L2-normalised, stored as float16), so our files are interchangeable with clip-retrieval's.

Fast preprocessing (``encoder.fast_preprocess``, on whenever the model's preprocess is one we can
read: torchvision's Resize/CenterCrop/ToTensor/Normalize or Hugging Face's CLIPImageProcessor):
``decode_for_clip`` decodes a JPEG at reduced DCT scale when it is at least 4x the model input
(PIL ``draft``, keeping >= 2x) and then resizes with OpenCV's area filter; a smaller JPEG is decoded by
libjpeg-turbo directly (simplejpeg: PIL's pixels, at half the CPU) and resized by OpenCV too: bicubic
within 1.25x of the resized size (a 256 px tar image for a 224 px model), area beyond. PIL's own
bicubic, which the reference preprocess uses, costs 5-8x OpenCV's at these sizes and was a third of
the CPU path's time; OpenCV's pixels stay under a grey level from it on average. ``prepare_image``
center crops and writes the image as planes into a row of a reused batch buffer: normalised
float32 on CPU (in the decode thread, while the image is in cache), uint8 in page-locked memory
with a GPU, where ``encode_image_arrays`` normalises the whole batch after one copy (a quarter of
the bytes). Embeddings stay within cosine 0.99 of the per-image preprocess on large photo-like
images and 0.995 on small ones (tests/test_fast_paths.py; bench/RESULTS.md).
``encoder.exact()`` gives the same model with the original per-image preprocess.
"""

from __future__ import annotations

import copy
import io
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from shardprep.allocator import collector_paused, import_paused

# Real model loads in this process (the cache below makes repeated loads free); tests assert on it.
LOAD_COUNT = 0
_CACHE: dict[tuple[str, str, bool], "ClipEncoder"] = {}
_LOCK = threading.Lock()


def resolve_device(device: str = "auto") -> str:
    torch = import_paused("torch")  # often a run worker's first import of it (downloads never import it)

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return device


# a JPEG is DCT-downscaled only while it keeps this many pixels per model-input pixel (both sides)
DRAFT_GAP = 2.0
# an image at most this much larger than the resized size (both sides), or smaller, is resized bicubic
NEAR_SCALE = 1.25


@dataclass(frozen=True)
class ImageSpec:
    """What a CLIP preprocess does to an image, read off the preprocess object."""

    resize: int  # shortest edge after resizing
    crop: tuple[int, int]  # (height, width) of the center crop
    mean: tuple[float, ...]
    std: tuple[float, ...]
    round_offsets: bool  # torchvision rounds the crop offsets, Hugging Face floors them

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(w, h) after the shortest-edge resize, as torchvision and Hugging Face compute it."""
        short, long = (width, height) if width <= height else (height, width)
        if short == self.resize:
            return width, height
        new_long = int(self.resize * long / short)
        return (self.resize, new_long) if width <= height else (new_long, self.resize)


def image_spec_of(preprocess: Callable) -> ImageSpec | None:
    """The ``ImageSpec`` of an all_clip preprocess, or ``None`` when it does anything we do not model
    (then the encoder keeps the per-image preprocess)."""
    try:
        return _torchvision_spec(preprocess) or _hf_spec(preprocess)
    except Exception:  # noqa: BLE001 - an unexpected preprocess object just means "no fast path"
        return None


def _torchvision_spec(preprocess) -> ImageSpec | None:
    import torchvision.transforms as T

    if not isinstance(preprocess, T.Compose):
        return None
    resize = crop = norm = None
    to_tensor = False
    for t in preprocess.transforms:
        if isinstance(t, T.Resize):
            size = t.size if isinstance(t.size, int) else (t.size[0] if len(t.size) == 1 else None)
            if (size is None or t.max_size is not None or t.interpolation != T.InterpolationMode.BICUBIC
                    or resize is not None or crop is not None):
                return None
            resize = size
        elif isinstance(t, T.CenterCrop):
            crop = tuple(t.size) if len(t.size) == 2 else (t.size[0], t.size[0])
        elif isinstance(t, T.ToTensor):
            to_tensor = True
        elif isinstance(t, T.Normalize):
            norm = (tuple(float(x) for x in t.mean), tuple(float(x) for x in t.std))
        elif getattr(t, "__name__", "") in ("_convert_to_rgb", "_convert_image_to_rgb"):
            continue
        else:
            return None
    if resize is None or crop is None or norm is None or not to_tensor or min(crop) > resize:
        return None
    return ImageSpec(resize, crop, norm[0], norm[1], round_offsets=True)


def _hf_spec(preprocess) -> ImageSpec | None:
    # all_clip's hf_clip loader returns ``lambda x: processor(x, return_tensors="pt").pixel_values``
    cells = [c.cell_contents for c in (getattr(preprocess, "__closure__", None) or ())]
    proc = next((c for c in cells if type(c).__name__ == "CLIPImageProcessor"), None)
    if proc is None:
        return None
    size = proc.size or {}
    if (not proc.do_resize or set(size) != {"shortest_edge"} or int(proc.resample) != 3  # PIL BICUBIC
            or not proc.do_center_crop or not proc.do_rescale or abs(proc.rescale_factor - 1 / 255) > 1e-12
            or not proc.do_normalize or not getattr(proc, "do_convert_rgb", True)):
        return None
    crop = (int(proc.crop_size["height"]), int(proc.crop_size["width"]))
    if min(crop) > size["shortest_edge"]:
        return None
    return ImageSpec(int(size["shortest_edge"]), crop, tuple(float(x) for x in proc.image_mean),
                     tuple(float(x) for x in proc.image_std), round_offsets=False)


def decode_for_clip(data: bytes, spec: ImageSpec) -> np.ndarray:
    """Image bytes -> uint8 RGB ``[crop_h, crop_w, 3]``: DCT-reduced JPEG decode, resize, crop.

    Raises like PIL for an undecodable image (the caller records a skip)."""
    return np.ascontiguousarray(_decode_crop(data, spec))


def draft_target(spec: ImageSpec, width: int, height: int) -> tuple[int, int] | None:
    """The size a JPEG of ``width`` x ``height`` may be DCT-reduced to (PIL ``draft``'s request) for
    ``spec``: DRAFT_GAP x the resized size when the image is at least twice that on both sides, else
    None (decoded at full size). Also read by ``shardprep.pixels``, which decodes once for every model."""
    new_w, new_h = spec.resized_size(width, height)
    if new_w * DRAFT_GAP * 2 <= width and new_h * DRAFT_GAP * 2 <= height:
        return int(DRAFT_GAP * new_w + 0.999), int(DRAFT_GAP * new_h + 0.999)
    return None


def _decode_crop(data: bytes, spec: ImageSpec) -> np.ndarray:
    # decode_for_clip without the final copy (the crop is a view of the resized image)
    from PIL import Image

    rgb = _decode_jpeg_rgb(data, spec)
    if rgb is not None:
        return resize_crop(rgb, spec, (rgb.shape[1], rgb.shape[0]), area=False)
    with Image.open(io.BytesIO(data)) as im:
        width, height = im.size
        target = draft_target(spec, width, height) if im.format == "JPEG" else None
        if target is not None:
            # largest DCT reduction that keeps DRAFT_GAP x the target (PIL picks the scale)
            im.draft("RGB", target)
        return resize_crop(im if im.mode == "RGB" else im.convert("RGB"), spec, (width, height),
                           area=im.size != (width, height))


def _decode_jpeg_rgb(data: bytes, spec: ImageSpec) -> np.ndarray | None:
    """A JPEG that ``_decode_crop`` decodes at full size, decoded by libjpeg-turbo directly (simplejpeg:
    the pixels PIL's decoder gives, the same library with the same settings, at half its CPU); None for
    anything else (not a JPEG, CMYK, one DCT-reduced through PIL ``draft``), which PIL decodes as before.
    strict: a libjpeg warning (a truncated file) is an error, as it is for PIL."""
    import simplejpeg

    if data[:2] != b"\xff\xd8":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace not in ("YCbCr", "RGB", "Gray") or draft_target(spec, width, height) is not None:
            return None
        img = simplejpeg.decode_jpeg(data, "RGB", strict=True)
    except ValueError:
        return None  # PIL decodes it, or raises its own error for the skip record
    return img if img.shape[:2] == (height, width) else None


def resize_crop(rgb, spec: ImageSpec, original: tuple[int, int], area: bool) -> np.ndarray:
    """A decoded RGB image (PIL, or a uint8 ``[H, W, 3]`` array) -> uint8 ``[crop_h, crop_w, 3]`` (a
    view): resized to ``spec`` and center cropped; the resized size is the ``original`` (width, height)'s,
    which a DCT-reduced decode only approximates (odd sides round up). ``area``: the image was decoded for
    a DCT reduction (``draft_target``), so it is still >= DRAFT_GAP x the target."""
    import cv2

    new_w, new_h = spec.resized_size(*original)
    arr = np.asarray(rgb)
    height, width = arr.shape[:2]
    if (width, height) != (new_w, new_h):
        # OpenCV at SIMD speed, 5-8x PIL's bicubic. Within NEAR_SCALE of the target (a 256 px tar image
        # for a 224 px model) its bicubic is the closest to PIL's and the cheapest; further down, area
        # averages every source pixel, as PIL's antialiased bicubic does (after a DCT reduction the image
        # is still >= DRAFT_GAP x the target). Measured in bench/E2E.md's notes: < 1 grey level from PIL.
        near = not area and width <= NEAR_SCALE * new_w and height <= NEAR_SCALE * new_h
        arr = cv2.resize(arr, (new_w, new_h), interpolation=cv2.INTER_CUBIC if near else cv2.INTER_AREA)
    crop_h, crop_w = spec.crop
    if spec.round_offsets:
        top, left = int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0))
    else:
        top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
    return arr[top:top + crop_h, left:left + crop_w]


def crop_into(data: bytes, spec: ImageSpec, out: np.ndarray) -> np.ndarray:
    """Image bytes -> ``out``, a uint8 ``[3, H, W]`` row: decoded, resized and cropped as
    ``decode_for_clip`` does, written as planes. What a GPU batch holds; also run by the
    worker processes of ``shardprep.prepare_pool``, which have the spec but no model."""
    # one strided copy (cv2.split and three plane copies cost 4x more on a 16-core GPU host)
    out[...] = _decode_crop(data, spec).transpose(2, 0, 1)
    return out


class ClipEncoder:
    """A loaded CLIP model with its preprocess and tokenizer (as all_clip returns them)."""

    def __init__(self, spec: str, device: str, model: Any, preprocess: Callable, tokenizer: Callable,
                 batch_size: int = 256):
        self.spec = spec
        self.device = device
        self.model = model
        self.preprocess = preprocess  # PIL image -> tensor ([3,H,W], or [1,3,H,W] for hf_clip)
        self.tokenizer = tokenizer  # list[str] -> LongTensor[N, context]
        self.batch_size = batch_size
        self.image_spec = image_spec_of(preprocess)
        # batched uint8 preprocessing (module doc); False: the per-image preprocess above
        self.fast_preprocess = self.image_spec is not None
        self._norm: dict = {}
        # Hugging Face CLIP text towers are causal, pool at the first end-of-text token and take
        # positions from the sequence length, so the all-zero padding columns after the batch's
        # last token change nothing: they are cut (OpenAI/open_clip towers add a fixed 77-row
        # position table, so they keep their padding)
        inner = getattr(model, "inner_model", None)
        self.trim_text_padding = type(inner).__name__ == "CLIPModel" and type(inner).__module__.startswith("transformers")
        self.dim = int(self.encode_texts([""]).shape[1])

    def __repr__(self) -> str:
        mode = "fast" if self.fast_preprocess else "exact"
        return f"ClipEncoder({self.spec!r}, device={self.device!r}, dim={self.dim}, preprocess={mode})"

    def exact(self) -> "ClipEncoder":
        """The same model (shared, not copied) with the original per-image preprocess."""
        other = copy.copy(self)
        other.fast_preprocess = False
        return other

    def prepare_image(self, data: bytes, out: np.ndarray | None = None):
        """Image bytes -> what ``encode_prepared`` takes. Fast: a ``[3, H, W]`` image in the
        buffer's dtype (``out``, a row of ``new_image_buffer``, when given); else the per-image
        preprocess's tensor."""
        if not self.fast_preprocess:
            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                return self.preprocess(im)
        if out is not None and out.dtype == np.uint8:  # GPU: normalised there, after the copy
            return crop_into(data, self.image_spec, out)
        return self.prepare_crop(_decode_crop(data, self.image_spec), out)

    def prepare_crop(self, crop: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """What ``prepare_image`` makes of the image bytes, from their uint8 ``[H, W, 3]`` crop (a
        ``resize_crop``, as ``shardprep.pixels`` makes it from its one decode), into ``out``."""
        import cv2

        if out is None:
            out = np.empty((3, *self.image_spec.crop), self._buffer_dtype())
        if out.dtype == np.uint8:  # GPU: normalised there, after the copy
            out[...] = crop.transpose(2, 0, 1)
            return out
        # CPU: (x / 255 - mean) / std here, in the worker thread, while the cache is warm
        planes = cv2.split(crop)
        scale, shift = self._plane_norm()
        for c in range(3):
            np.multiply(planes[c], scale[c], out=out[c], dtype=np.float32)
            out[c] -= shift[c]
        return out

    def fill_image_rows(self, out: np.ndarray, rows: np.ndarray) -> None:
        """``rows``, uint8 ``[n, 3, H, W]`` made by ``crop_into`` elsewhere (a worker process), into
        ``out``, the first ``n`` rows of a ``new_image_buffer``: copied (GPU), or normalised by the
        float32 operations ``prepare_image`` does on CPU, so the values are the same bits."""
        import torch

        if out.dtype == np.uint8:
            torch.from_numpy(out).copy_(torch.from_numpy(rows))  # torch copies on all its threads
            return
        scale, shift = self._plane_norm()
        for c in range(3):
            np.multiply(rows[:, c], scale[c], out=out[:, c], dtype=np.float32)
            out[:, c] -= shift[c]

    def encode_prepared(self, items) -> np.ndarray:
        """Outputs of ``prepare_image`` (a list, or rows of an image buffer) -> float16 [N, D]."""
        return self.encode_image_arrays(items) if self.fast_preprocess else self.encode_image_tensors(items)

    def _buffer_dtype(self):
        return np.float32 if self.device == "cpu" else np.uint8

    def new_image_buffer(self, n: int) -> np.ndarray:
        """A ``[n, 3, H, W]`` batch buffer for ``prepare_image(out=...)``: float32, normalised, on
        CPU; uint8 in page-locked memory with a GPU (4x fewer bytes to copy, asynchronously)."""
        import torch

        h, w = self.image_spec.crop
        if self.device == "cpu":
            return np.empty((n, 3, h, w), np.float32)
        return torch.empty((n, 3, h, w), dtype=torch.uint8, pin_memory=True).numpy()

    def _plane_norm(self):
        if "plane" not in self._norm:
            mean = np.asarray(self.image_spec.mean, np.float64)
            std = np.asarray(self.image_spec.std, np.float64)
            # (x / 255 - mean) / std as one multiply and one subtraction per element
            self._norm["plane"] = ((1.0 / (255.0 * std)).astype(np.float32), (mean / std).astype(np.float32))
        return self._norm["plane"]

    def encode_image_arrays(self, arrays) -> np.ndarray:
        """``prepare_image`` outputs (a list of ``[3, H, W]`` or a ``[N, 3, H, W]`` buffer slice)
        -> float16 [N, D]. On a GPU the uint8 batch is copied once and normalised there."""
        import torch

        if len(arrays) == 0:
            return np.zeros((0, self.dim), dtype=np.float16)
        x = self._array_input(arrays)
        with torch.inference_mode():
            return self._normalised_f16(self.model.encode_image(x))

    def _array_input(self, arrays):
        import torch

        batch = torch.from_numpy(arrays if isinstance(arrays, np.ndarray) else np.stack(arrays))
        if batch.dtype != torch.uint8:
            return batch.to(self.device)
        scale, shift = (torch.from_numpy(v).view(1, 3, 1, 1).to(self.device) for v in self._plane_norm())
        x = batch.to(self.device, non_blocking=True).float()
        return torch.addcmul(-shift, x, scale)

    @staticmethod
    def _normalised(features):
        import torch

        # normalise in float32 (autocast on GPU may hand back bf16/fp16), then store float16 like
        # clip-retrieval's mapper does
        f = features.float()
        f = f / f.norm(dim=-1, keepdim=True)
        return f.to(torch.float16)

    @classmethod
    def _normalised_f16(cls, features) -> np.ndarray:
        return cls._normalised(features).cpu().numpy()

    def encode_step(self, items, tokens=None):
        """``encode_prepared(items)`` and ``encode_tokens(tokens)`` (None: no text) as float16 tensors on the
        device, without waiting for a GPU to compute them (``.cpu()`` them later): the caller prepares its
        next batch meanwhile, so the GPU never idles between batches. On return the image buffer may be
        refilled: its copy to the GPU is done. The same values as the two calls."""
        import torch

        cuda = self.device.startswith("cuda")
        x = self._array_input(items) if self.fast_preprocess else torch.stack(list(items)).to(self.device)
        copied = None
        if cuda:
            copied = torch.cuda.Event()
            copied.record()
        with torch.inference_mode():
            img = self._normalised(self.model.encode_image(x))
            txt = None
            if tokens is not None:
                tokens = self._trimmed(tokens)
                # from page-locked memory: a copy from pageable memory would wait for the queued work
                tokens = tokens.pin_memory().to(self.device, non_blocking=True) if cuda else tokens
                txt = self._normalised(self.model.encode_text(tokens))
        if copied is not None:
            copied.synchronize()  # the images are on the GPU (this waits for the previous batch, not this one)
        return img, txt

    def encode_image_tensors(self, tensors: Sequence) -> np.ndarray:
        """Preprocessed image tensors (outputs of ``self.preprocess``) -> float16 [N, D]."""
        import torch

        if len(tensors) == 0:
            return np.zeros((0, self.dim), dtype=np.float16)
        # stacked exactly as clip-retrieval's DataLoader collates them (hf_clip squeezes dim 1 itself)
        batch = torch.stack(list(tensors)).to(self.device)
        with torch.inference_mode():
            return self._normalised_f16(self.model.encode_image(batch))

    def encode_images(self, images: Sequence) -> np.ndarray:
        """PIL images -> L2-normalised float16 [N, D], in batches of ``batch_size``."""
        out = [self.encode_image_tensors([self.preprocess(im) for im in images[i : i + self.batch_size]])
               for i in range(0, len(images), self.batch_size)]
        return np.concatenate(out) if out else np.zeros((0, self.dim), dtype=np.float16)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Captions -> L2-normalised float16 [N, D] (tokenised like clip-retrieval: truncated to context)."""
        chunks = [self.encode_tokens(self.tokenizer(list(texts[i : i + self.batch_size])))
                  for i in range(0, len(texts), self.batch_size)]
        if not chunks:
            return np.zeros((0, getattr(self, "dim", 0)), dtype=np.float16)
        return np.concatenate(chunks)

    def encode_tokens(self, tokens) -> np.ndarray:
        """Token ids ``[N, context]`` (``self.tokenizer``'s output) -> float16 [N, D]."""
        import torch

        tokens = self._trimmed(tokens)
        with torch.inference_mode():
            return self._normalised_f16(self.model.encode_text(tokens.to(self.device)))

    def _trimmed(self, tokens):
        if self.trim_text_padding and tokens.ndim == 2 and tokens.shape[1] > 1:
            used = int((tokens != 0).any(dim=0).nonzero().max()) + 1 if bool((tokens != 0).any()) else 1
            tokens = tokens[:, :used]
        return tokens


def load_clip_encoder(spec: str, device: str = "auto", use_jit: bool = False) -> ClipEncoder:
    """Load ``spec`` once per process (cached by spec, device and jit) through ``all_clip.load_clip``."""
    global LOAD_COUNT
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"clip model spec must be a non-empty string, got {spec!r}")
    resolved = resolve_device(device)
    key = (spec, resolved, bool(use_jit))
    with _LOCK:
        enc = _CACHE.get(key)
        if enc is not None:
            return enc
        with collector_paused():  # torch, transformers and the model: no full collections meanwhile
            from all_clip import load_clip

            try:
                model, preprocess, tokenizer = load_clip(
                    clip_model=spec, use_jit=use_jit, warmup_batch_size=1, device=resolved
                )
            except Exception as e:
                raise RuntimeError(f"could not load CLIP model {spec!r} on {resolved}: {type(e).__name__}: {e}") from e
        if hasattr(model, "eval"):
            model.eval()
        enc = ClipEncoder(spec, resolved, model, preprocess, tokenizer)
        LOAD_COUNT += 1
        _CACHE[key] = enc
        return enc


def clear_encoder_cache() -> None:
    """Forget cached encoders (all_clip keeps its own lru_cache; this only resets ours)."""
    with _LOCK:
        _CACHE.clear()


# Image embedding widths of clip-retrieval's OpenAI model names (clip-anytorch) and of open_clip's
# common architectures, so a score head's width is checked at config load without loading CLIP
_OPENAI_WIDTHS = {"RN50": 1024, "RN101": 512, "RN50x4": 640, "RN50x16": 768, "RN50x64": 1024, "ViT-B/32": 512,
                  "ViT-B/16": 512, "ViT-L/14": 768, "ViT-L/14@336px": 768}


def embedding_width(spec: str) -> int | None:
    """The width of ``spec``'s image embeddings, read from its name or its config file (never its
    weights), or None where neither tells (the width is then checked when the embeddings are read)."""
    import json
    import os

    if spec in _OPENAI_WIDTHS:
        return _OPENAI_WIDTHS[spec]
    kind, _, name = spec.partition(":")
    if kind == "open_clip":
        try:
            import open_clip

            cfg = open_clip.get_model_config(name.split("/")[0])
        except Exception:  # noqa: BLE001 - not installed or unknown: checked at run time
            return None
        return int(cfg["embed_dim"]) if cfg and "embed_dim" in cfg else None
    if kind == "hf_clip":
        path = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            try:  # a hub id: its config.json from the local cache, never the network
                from huggingface_hub import try_to_load_from_cache

                path = try_to_load_from_cache(name, "config.json")
            except Exception:  # noqa: BLE001
                return None
            if not isinstance(path, str):
                return None
        try:
            with open(path, encoding="utf-8") as f:
                width = json.load(f).get("projection_dim")
        except (OSError, ValueError):
            return None
        return int(width) if isinstance(width, int) else None
    return None
