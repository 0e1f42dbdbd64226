"""NeMo encoders (T5, image and video autoencoders, CLIP text) as a resource; each model loads once per
process."""

import dagster as dg

from shardprep.models.nemo import ClipTextEncoder, ImageAutoencoder, T5TextEncoder
from shardprep.models.video_autoencoders import VideoAutoencoder
from shardprep_dagster.resources.dataset import DatasetResource


class NemoEncoders(dg.ConfigurableResource):
    """Model paths and sizes come from the dataset config; models are cached per process by
    shardprep.models.nemo, so a batched backfill run loads each of them once."""

    dataset: DatasetResource

    # ``device``: the step's leased device (default: the configured one)

    def t5(self, device: str | None = None) -> T5TextEncoder:
        cfg = self.dataset.config
        return T5TextEncoder(cfg.diffusion_t5_model, device=device or cfg.device, max_length=512)

    def diffusion_autoencoder(self, device: str | None = None) -> ImageAutoencoder:
        cfg = self.dataset.config
        return ImageAutoencoder(cfg.diffusion_autoencoder, device=device or cfg.device)

    def video_autoencoder(self, device: str | None = None) -> VideoAutoencoder:
        cfg = self.dataset.config
        return VideoAutoencoder(cfg.video_autoencoder, device=device or cfg.device)

    def sd_autoencoder(self, device: str | None = None) -> ImageAutoencoder:
        cfg = self.dataset.config
        return ImageAutoencoder(cfg.sd_autoencoder, device=device or cfg.device)

    def clip_text(self, device: str | None = None) -> ClipTextEncoder:
        cfg = self.dataset.config
        return ClipTextEncoder(cfg.sd_clip_text_model, device=device or cfg.device)
