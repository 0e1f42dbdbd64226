"""Causal video autoencoders for NeMo's video diffusion samples, each model loaded once per process.

``VideoAutoencoder(path)`` encodes a clip ``[3, T, H, W]`` in [-1, 1] to its latent ``[C, T', h, w]``:

* ``cosmos:<dir>``: NVIDIA's Cosmos tokenizer TorchScript folder (``encoder.jit``, as in
  nvidia/Cosmos-*-Tokenizer-CV4x8x8), loaded with plain ``torch.jit.load``. A TorchScript module carries
  no config, and the folder names NVIDIA ships do not all follow one pattern (``CV4x8x8``,
  ``CosmosCausalCV_f4x8x8``), so the compression factors are measured: one encode of a small blank clip.
* a diffusers folder (or ``org/repo/subfolder``) of ``AutoencoderKLCosmos`` or ``AutoencoderKLWan``, the
  class read from its ``config.json``; the factors come from the config as diffusers' pipelines compute
  them. The latent is the distribution's mode (Cosmos: deterministic; Wan: the mean), unscaled, as the
  image path stores ``latent_dist.mean``.

Causal tokenizers encode the first frame alone, then ``tc`` frames per latent frame:
``T' = 1 + (T - 1) / tc``. Cosmos pads other lengths up and Wan drops the tail silently, so
``frames_to_use`` cuts a clip to ``1 + k * tc`` frames before encoding and T' is exact.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from shardprep.models.clip import resolve_device
from shardprep.models.nemo import COSMOS_PREFIX, cached_load, check_path, compute_dtype

DIFFUSERS_CLASSES = ("AutoencoderKLCosmos", "AutoencoderKLWan")
_PROBE_FRAMES, _PROBE_SIDE = 17, 64  # the blank clip a TorchScript tokenizer's factors are measured on


@dataclass(frozen=True)
class Compression:
    temporal: int  # tc: frames per latent frame after the first
    spatial: int  # pixels per latent pixel, each side


def frames_to_use(frames: int, max_frames: int, temporal: int) -> int:
    """The most frames, at most ``frames`` and ``max_frames``, of the form ``1 + k * temporal`` (0: none)."""
    n = min(frames, max_frames)
    return 0 if n < 1 else 1 + (n - 1) // temporal * temporal


def latent_frames(frames: int, temporal: int) -> int:
    return 1 + (frames - 1) // temporal


def _split_hub_path(path: str) -> tuple[str, str | None]:
    """``org/repo/sub/folder`` -> (``org/repo``, ``sub/folder``): the published VAEs live in a subfolder."""
    parts = path.strip("/").split("/")
    return "/".join(parts[:2]), "/".join(parts[2:]) or None


def _diffusers_class_name(path: str) -> str:
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("_class_name", "")
    from diffusers import AutoencoderKLCosmos  # any ConfigMixin class reads the folder's config.json

    repo, sub = _split_hub_path(path)
    return AutoencoderKLCosmos.load_config(repo, subfolder=sub).get("_class_name", "")


class VideoAutoencoder:
    """Clips in [-1, 1] -> causal video latents (see the module docstring)."""

    def __init__(self, path: str, device: str = "auto"):
        self.path = check_path(path, "video autoencoder")
        self.device = resolve_device(device)
        self.dtype = compute_dtype(self.device)
        self.is_cosmos = self.path.startswith(COSMOS_PREFIX)
        self.model, self.compression = cached_load("video_autoencoder", self.path, self.device, self._load)

    def __repr__(self) -> str:
        return f"VideoAutoencoder({self.path!r}, device={self.device!r})"

    def _load(self):
        import torch

        if self.is_cosmos:
            folder = self.path[len(COSMOS_PREFIX):]
            enc_path = os.path.join(folder, "encoder.jit")
            if not os.path.exists(enc_path):
                raise FileNotFoundError(
                    f"Cosmos tokenizer folder {folder!r} has no encoder.jit (download e.g. "
                    "nvidia/Cosmos-0.1-Tokenizer-CV4x8x8 there first; hubs are not reached at run time)")
            model = torch.jit.load(enc_path, map_location=self.device).to(self.dtype).eval()
            return model, self._probe(model)
        name = _diffusers_class_name(self.path)
        if name not in DIFFUSERS_CLASSES:
            raise ValueError(f"{self.path}: a {name or 'model without _class_name'}; a video autoencoder is "
                             f"cosmos:<dir> or one of {', '.join(DIFFUSERS_CLASSES)}")
        import diffusers

        cls = getattr(diffusers, name)
        if os.path.isdir(self.path):
            model = cls.from_pretrained(self.path, torch_dtype=self.dtype, low_cpu_mem_usage=False)
        else:
            repo, sub = _split_hub_path(self.path)
            model = cls.from_pretrained(repo, subfolder=sub, torch_dtype=self.dtype, low_cpu_mem_usage=False)
        model = model.to(self.device).eval()
        cfg = model.config
        if name == "AutoencoderKLWan":  # as pipeline_wan computes them
            comp = Compression(2 ** sum(cfg.temperal_downsample), 2 ** len(cfg.temperal_downsample))
        else:
            comp = Compression(int(cfg.temporal_compression_ratio), int(cfg.spatial_compression_ratio))
        return model, comp

    def _probe(self, model) -> Compression:
        """A TorchScript tokenizer's factors, from one encode of a blank clip."""
        import torch

        with torch.inference_mode():
            x = torch.zeros(1, 3, _PROBE_FRAMES, _PROBE_SIDE, _PROBE_SIDE, device=self.device, dtype=self.dtype)
            lat = self._raw(model, x)
        t, h = int(lat.shape[2]), int(lat.shape[3])
        if lat.ndim != 5 or t < 2 or h < 1 or (_PROBE_FRAMES - 1) % (t - 1) or _PROBE_SIDE % h:
            raise ValueError(f"{self.path}: encoder.jit maps a [1, 3, {_PROBE_FRAMES}, {_PROBE_SIDE}, {_PROBE_SIDE}] "
                             f"clip to {tuple(lat.shape)}: not a causal video tokenizer")
        return Compression((_PROBE_FRAMES - 1) // (t - 1), _PROBE_SIDE // h)

    def _raw(self, model, x):
        if self.is_cosmos:
            lat = model(x)
            return lat[0] if isinstance(lat, (tuple, list)) else lat
        return model.encode(x).latent_dist.mode()

    def side_multiple(self) -> int:
        """Frame sides must be multiples of this: the spatial compression times DiT's 2x2 patches, and 16."""
        return math.lcm(16, 2 * self.compression.spatial)

    def encode(self, clip):
        """``clip``: float tensor ``[3, T, H, W]`` in [-1, 1], T = 1 + k * tc, H and W multiples of
        ``side_multiple()``. Returns the float32 CPU latent ``[C, T', h, w]``."""
        import torch

        if not isinstance(clip, torch.Tensor) or clip.ndim != 4 or clip.shape[0] != 3:
            shape = tuple(clip.shape) if hasattr(clip, "shape") else type(clip).__name__
            raise ValueError(f"clip must be a float tensor [3, T, H, W], got {shape}")
        t = int(clip.shape[1])
        if (t - 1) % self.compression.temporal:
            raise ValueError(f"clip has {t} frames; a causal autoencoder with temporal compression "
                             f"{self.compression.temporal} needs 1 + k * {self.compression.temporal}")
        with torch.inference_mode():
            lat = self._raw(self.model, clip.unsqueeze(0).to(self.device, self.dtype))[0]
        expected = latent_frames(t, self.compression.temporal)
        if lat.ndim != 4 or lat.shape[1] != expected:
            raise ValueError(f"{self.path}: {t} frames encoded to {tuple(lat.shape)}; expected [C, {expected}, h, w]")
        return lat.float().cpu()
