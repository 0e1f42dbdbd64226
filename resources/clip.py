"""CLIP encoder resource: loads the configured model once per process (clip-retrieval's loader)."""

import dagster as dg

from shardprep.models.clip import ClipEncoder, load_clip_encoder
from shardprep_dagster.resources.dataset import DatasetResource


class ClipResource(dg.ConfigurableResource):
    """A CLIP model in clip-retrieval's spelling; empty fields fall back to the dataset config."""

    dataset: DatasetResource
    clip_model: str = ""
    device: str = ""
    batch_size: int = 0

    @property
    def spec(self) -> str:
        return self.clip_model or self.dataset.config.clip_model

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size or self.dataset.config.batch_size

    def encoder(self, device: str | None = None) -> ClipEncoder:
        """The model on ``device`` (the step's leased device; default: the configured one). Cached per
        process and device in shardprep.models.clip, so a multi-shard run loads the model once."""
        return load_clip_encoder(self.spec, device=device or self.device or self.dataset.config.device)
