"""Text and image encoders for the NeMo writers, each model loaded once per process.

* ``T5TextEncoder``: ``T5TokenizerFast`` + ``T5EncoderModel`` (any HF folder or name, e.g.
  google-t5/t5-11b or ``tests.fixtures.tiny_nemo.build_tiny_t5``), encoding exactly like NeMo's
  ``prepare_energon_dataset.encode_for_batch``: pad to ``max_length``, ``last_hidden_state``,
  positions past the real length dropped, float16.
* ``ClipTextEncoder``: ``CLIPTokenizer`` + ``CLIPTextModel`` like NeMo's ``FrozenCLIPEmbedder``
  (SD precache text key): padded to 77, no attention mask, ``last_hidden_state``, zero-padded to a
  multiple of 8 (80), float32. A full ``CLIPModel`` folder works too (its text tower is loaded).
* ``ImageAutoencoder``: a ``diffusers.AutoencoderKL`` folder (``latent_dist.mean`` or
  ``latent_dist.parameters`` = mean||logvar), or a Cosmos tokenizer given as ``cosmos:<dir>``, the
  folder holding NVIDIA's TorchScript ``encoder.jit`` (as in nvidia/Cosmos-*-Tokenizer-CV*; loaded
  with plain ``torch.jit.load``, so no extra package; continuous tokenizers only, no logvar).

Device ``auto`` = CUDA when available. On CUDA T5 and the autoencoders run in bfloat16 (T5 overflows
in float16), on CPU in float32; CLIP text always runs in float32 (NeMo's precache_sd.yaml stores it
at precision 32). The cache is keyed by model path/spec and resolved device; ``LOAD_COUNT`` counts
real loads.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import numpy as np

from shardprep.errors import ShardprepError
from shardprep.models.clip import resolve_device

# Real model loads in this process (the cache makes repeated loads free); tests assert on it.
LOAD_COUNT = 0
_CACHE: dict[tuple[str, str, str], Any] = {}
_LOCK = threading.Lock()

COSMOS_PREFIX = "cosmos:"
LATENT_OUTPUTS = ("mean", "parameters")


class ModelLoadError(ShardprepError, RuntimeError):
    """A configured model could not be loaded (missing folder, wrong kind of checkpoint, ...)."""


def compute_dtype(device: str):
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def hf_dtype_kwarg(dtype) -> dict:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56 (the old name warns); loading in the
    target dtype directly keeps an 11B T5 from materialising in float32 first."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def check_path(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{what} model path must be a non-empty string, got {path!r}")
    return path


def cached_load(kind: str, path: str, device: str, load):
    """``load()`` once per (kind, path, device) in this process; failures name the model and device."""
    global LOAD_COUNT
    key = (kind, path, device)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        try:
            value = load()
        except Exception as e:
            raise ModelLoadError(f"could not load {kind} model {path!r} on {device}: {type(e).__name__}: {e}") from e
        LOAD_COUNT += 1
        _CACHE[key] = value
        return value


def clear_cache() -> None:
    """Forget every loaded model (the next use loads again)."""
    with _LOCK:
        _CACHE.clear()


class T5TextEncoder:
    """Captions -> unpadded T5 hidden states, as NeMo's diffusion data preparation stores them."""

    def __init__(self, path: str, device: str = "auto", max_length: int = 512, batch_size: int = 32):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"T5TextEncoder: max_length must be a positive integer, got {max_length!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"T5TextEncoder: batch_size must be a positive integer, got {batch_size!r}")
        self.path = check_path(path, "T5")
        self.device = resolve_device(device)
        self.max_length = max_length
        self.batch_size = batch_size
        self.tokenizer, self.model = cached_load("t5", self.path, self.device, self._load)
        self.dim = int(self.model.config.d_model)

    def _load(self):
        from transformers import T5EncoderModel, T5TokenizerFast

        tokenizer = T5TokenizerFast.from_pretrained(self.path)
        model = T5EncoderModel.from_pretrained(self.path, **hf_dtype_kwarg(compute_dtype(self.device)))
        return tokenizer, model.to(self.device).eval()

    def __repr__(self) -> str:
        return f"T5TextEncoder({self.path!r}, device={self.device!r}, dim={self.dim})"

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """float16 ``[L_i, d]`` per text, ``L_i`` = its real token count (with ``</s>``, at most max_length)."""
        import torch

        out: list[np.ndarray] = []
        texts = list(texts)
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", truncation=True,
                                 padding="max_length", max_length=self.max_length)
            ids = enc.input_ids.to(self.device)
            mask = enc.attention_mask.to(self.device)
            with torch.inference_mode():
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            lengths = mask.sum(dim=1).tolist()
            hidden = hidden.float().cpu().numpy()  # numpy has no bfloat16; float32 -> float16 like NeMo
            out.extend(np.ascontiguousarray(hidden[j, :n].astype(np.float16)) for j, n in enumerate(lengths))
        return out


class ClipTextEncoder:
    """Captions -> CLIP text hidden states, padded like NeMo's ``FrozenCLIPEmbedder`` (SD precache)."""

    def __init__(self, path: str, device: str = "auto", max_length: int = 77, batch_size: int = 64):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"ClipTextEncoder: max_length must be a positive integer, got {max_length!r}")
        self.path = check_path(path, "CLIP text")
        self.device = resolve_device(device)
        self.max_length = max_length
        self.batch_size = batch_size
        self.tokenizer, self.model = cached_load("clip_text", self.path, self.device, self._load)
        self.dim = int(self.model.config.hidden_size)
        self.padded_length = (max_length + 7) // 8 * 8

    def _load(self):
        from transformers import CLIPTextModel, CLIPTokenizer

        tokenizer = CLIPTokenizer.from_pretrained(self.path)
        model = CLIPTextModel.from_pretrained(self.path)  # float32, as NeMo's precache stores it
        return tokenizer, model.to(self.device).eval()

    def __repr__(self) -> str:
        return f"ClipTextEncoder({self.path!r}, device={self.device!r}, dim={self.dim})"

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """float32 ``[N, ceil8(max_length), d]`` (``[N, 80, 768]`` for clip-vit-large-patch14)."""
        import torch

        texts = list(texts)
        out = np.zeros((len(texts), self.padded_length, self.dim), dtype=np.float32)
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], truncation=True, max_length=self.max_length,
                                 padding="max_length", return_tensors="pt")
            with torch.inference_mode():
                # FrozenCLIPEmbedder passes no attention mask: pad positions keep their (causal) states
                hidden = self.model(input_ids=enc.input_ids.to(self.device)).last_hidden_state
            out[i : i + hidden.shape[0], : hidden.shape[1]] = hidden.float().cpu().numpy()
        return out


class ImageAutoencoder:
    """Images in [-1, 1] -> latents, from a diffusers ``AutoencoderKL`` folder or ``cosmos:<dir>``."""

    def __init__(self, path: str, device: str = "auto"):
        self.path = check_path(path, "image autoencoder")
        self.device = resolve_device(device)
        self.dtype = compute_dtype(self.device)
        self.is_cosmos = self.path.startswith(COSMOS_PREFIX)
        self.model = cached_load("autoencoder", self.path, self.device, self._load)
        if self.is_cosmos:
            self.latent_channels = None  # known after the first encode
        else:
            self.latent_channels = int(self.model.config.latent_channels)

    def _load(self):
        import torch

        if self.is_cosmos:
            folder = self.path[len(COSMOS_PREFIX) :]
            enc_path = os.path.join(folder, "encoder.jit")
            if not os.path.exists(enc_path):
                raise FileNotFoundError(
                    f"Cosmos tokenizer folder {folder!r} has no encoder.jit (download e.g. "
                    "nvidia/Cosmos-0.1-Tokenizer-CV8x8x8 or CosmosCausalCV_f4x8x8 there first; hubs are not "
                    "reached at run time)")
            model = torch.jit.load(enc_path, map_location=self.device)
            return model.to(self.dtype).eval()
        from diffusers import AutoencoderKL

        model = AutoencoderKL.from_pretrained(self.path, torch_dtype=self.dtype, low_cpu_mem_usage=False)
        return model.to(self.device).eval()

    def __repr__(self) -> str:
        return f"ImageAutoencoder({self.path!r}, device={self.device!r})"

    def encode(self, images, output: str = "mean"):
        """``images``: float tensor ``[B, 3, H, W]`` in [-1, 1]. Returns float32 CPU ``[B, C, h, w]``:
        ``output="mean"`` -> ``latent_dist.mean``; ``"parameters"`` -> mean||logvar (``2C`` channels,
        what NeMo's SD precache stores). Cosmos: its continuous latent of the 1-frame video, "mean" only."""
        import torch

        if output not in LATENT_OUTPUTS:
            raise ValueError(f"output must be one of {LATENT_OUTPUTS}, got {output!r}")
        if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
            shape = tuple(images.shape) if hasattr(images, "shape") else type(images).__name__
            raise ValueError(f"images must be a float tensor [B, 3, H, W], got {shape}")
        x = images.to(self.device, self.dtype)
        with torch.inference_mode():
            if self.is_cosmos:
                if output != "mean":
                    raise ValueError(f"{self.path}: a Cosmos tokenizer has no latent distribution; use output='mean'")
                lat = self.model(x.unsqueeze(2))  # B x 3 x T=1 x H x W
                lat = lat[0] if isinstance(lat, (tuple, list)) else lat
                if lat.ndim != 5 or lat.shape[2] != 1:
                    raise ValueError(f"{self.path}: encoder.jit returned {tuple(lat.shape)}, expected [B, C, 1, h, w]")
                lat = lat[:, :, 0]
            else:
                dist = self.model.encode(x).latent_dist
                lat = dist.mean if output == "mean" else dist.parameters
        return lat.float().cpu()


def _transform(resolution: int):
    from torchvision import transforms as T

    return T.Compose([
        T.Resize(resolution, interpolation=T.InterpolationMode.BICUBIC, antialias=True),
        T.CenterCrop(resolution),
        T.ToTensor(),
        T.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    ])


_TRANSFORMS: dict[int, Any] = {}


def preprocess_image(data: bytes, resolution: int):
    """Encoded image bytes -> float32 ``[3, resolution, resolution]`` in [-1, 1], as NeMo's precache
    prepares autoencoder input: RGB, Resize(shorter side, bicubic, antialias) -> CenterCrop ->
    ToTensor -> Normalize(0.5, 0.5). Raises on undecodable data (callers record it)."""
    import io

    from PIL import Image

    transform = _TRANSFORMS.get(resolution)
    if transform is None:
        transform = _TRANSFORMS.setdefault(resolution, _transform(resolution))
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        rgb = im.convert("RGB")
    return transform(rgb)
