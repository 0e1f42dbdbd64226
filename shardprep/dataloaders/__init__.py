"""DALLE2-pytorch-compatible dataloaders (decoder: tars + reordered embeddings; prior: embedding-reader)."""

from .decoder import ImageEmbeddingDataset, create_image_embedding_dataloader
from .prior import PriorEmbeddingDataset, get_reader, make_splits

__all__ = [
    "ImageEmbeddingDataset",
    "create_image_embedding_dataloader",
    "get_reader",
    "make_splits",
    "PriorEmbeddingDataset",
]
