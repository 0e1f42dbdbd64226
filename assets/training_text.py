"""training_text: the caption each image sample trains with when synthetic captions take part
(``train_caption: synthetic | both``), written into the image tar's json where every training output reads it."""

import contextlib

import dagster as dg

from shardprep.storage import exists, lock
from shardprep.training_text import write_prior_text, write_training_text
from shardprep.verify import file_sizes
from shardprep.versions import restamp_sizes
from shardprep_dagster.assets.shard_runs import (
    SHARD_AUTOMATION,
    ShardRunConfig,
    from_record,
    gpu_device_when_needed,
    lock_name,
    materialize_shards,
)
from shardprep_dagster.resources.clip import ClipResource
from shardprep_dagster.resources.dataset import DatasetResource


@dg.asset(
    **from_record("training_text"),
    kinds={"parquet", "json"},
    automation_condition=SHARD_AUTOMATION,
)
def training_text(context: dg.AssetExecutionContext, config: ShardRunConfig, dataset: DatasetResource,
                  clip: ClipResource) -> dg.MaterializeResult:
    """Each sample's ``.json`` in ``<root>/images/{shard}.tar`` gains ``synthetic_caption`` (the ``captions``
    asset's), ``train_caption`` and ``train_caption_source`` (``train_caption``: synthetic, or both = half
    the samples by key); ``<root>/training_text/{shard}.parquet`` lists the choice. The balanced tars' .txt,
    the image energon dataset's caption and the NeMo diffusion samples' T5 states follow it; for the DALLE2
    prior, ``<root>/training_text/metadata/`` and ``text_emb/`` are clip-retrieval's layout of the training
    caption (CLIP text embeddings with ``enable_text``), row for row with the image embeddings. Changing
    ``train_caption`` redoes this, those and the precached encodings, never a download or an image latent.
    In the graph only when ``train_caption`` is not ``original``."""
    cfg, layout = dataset.config, dataset.layout

    # the CLIP text tower (a device leased) only at the first shard with embeddings to match
    with gpu_device_when_needed(context, dataset) as device:
        def choose(key: str) -> dict:
            # the tar is image_shards' file: rewritten under its lock, its stamp's sizes kept true
            same = lock_name("image_shards", key) == lock_name("training_text", key)
            with contextlib.nullcontext() if same else lock(layout.root, lock_name("image_shards", key)):
                report = write_training_text(key, layout, cfg.train_caption)
                if report.jsons_rewritten:
                    restamp_sizes(layout, "image_shards", key, file_sizes([layout.tar(key)]))
            if not report.samples:
                write_prior_text(key, layout)  # removes stale files
                return {"status": "no samples (shard has no tar)", "samples": 0, "train_caption": cfg.train_caption}
            encoder = clip.encoder(device().torch_device) if cfg.text_embeddings and exists(layout.img_emb(key)) else None
            prior_rows = write_prior_text(key, layout, encoder)
            return {"status": "written", "train_caption": cfg.train_caption, "samples": report.samples,
                    "synthetic": report.synthetic, "original": report.samples - report.synthetic,
                    "without_synthetic_caption": report.without_synthetic, "jsons_rewritten": report.jsons_rewritten,
                    "prior_rows": prior_rows, "text_embeddings": encoder is not None,
                    "seconds": round(report.seconds, 3), "dagster/row_count": report.samples,
                    "path": dg.MetadataValue.path(layout.training_text(key))}

        return materialize_shards(context, dataset, "training_text", choose, rebuild=config.rebuild,
                                  describe=lambda key: {"train_caption": cfg.train_caption})
