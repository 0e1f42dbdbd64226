"""clip_embeddings (clip-retrieval layout) and reordered_embeddings (one npy per tar for DALLE2)."""

import os
from collections.abc import Callable

import dagster as dg

from shardprep.checks import check_clip_embeddings, check_reordered_embeddings
from shardprep.embeddings import write_clip_embeddings
from shardprep.ledger import load_ledger
from shardprep.models import clip as clip_models
from shardprep.models.devices import Device
from shardprep.pixels import PixelPass
from shardprep.reorder import reorder_embeddings
from shardprep.storage import exists
from shardprep_dagster.assets.pixels import Sharing
from shardprep_dagster.assets.shard_runs import (
    SHARD_AUTOMATION,
    ShardRunConfig,
    from_record,
    gpu_device_when_needed,
    materialize_shards,
    shard_check,
)
from shardprep_dagster.resources.clip import ClipResource
from shardprep_dagster.resources.dataset import DatasetResource


def embed_shard(layout, cfg, clip: ClipResource, encoder, key: str, device: Device,
                pixels: Callable[[str], PixelPass | None] | None = None) -> dict:
    """clip_embeddings' work on one shard with a loaded ``encoder`` on ``device`` (also run by
    ``assets.follow``). ``pixels(shard)``: the run's other pixel models to feed from the same decode of
    the images (``assets.pixels.Sharing.pass_for``); their time is in this shard's ``seconds``."""
    if not exists(layout.tar(key)):
        return {"status": "no samples (shard has no tar)", "samples": 0, "model": clip.spec}
    shared = pixels(key) if pixels is not None else None
    report = write_clip_embeddings(key, layout, encoder, batch_size=clip.effective_batch_size,
                                   enable_text=cfg.text_embeddings, pixels=shared)
    meta = {"status": "written", "model": clip.spec, "device": device.name,
            "device_leased_at": round(device.leased_at, 3), "samples": report.samples, "dim": report.dim,
            "seconds": round(report.seconds, 3), "nan_count": report.nan_count,
            "images_per_second": round(report.samples / report.seconds, 1) if report.seconds else 0.0,
            "path": dg.MetadataValue.path(layout.img_emb(key)), "dagster/row_count": report.samples}
    if shared is not None:
        meta["decode_shared_with"] = ", ".join(
            name for name, model in (("image_scores", shared.detector), ("captions", shared.captioner)) if model)
    return meta


@dg.asset(
    **from_record("clip_embeddings"),
    kinds={"numpy", "parquet", "pytorch"},
    automation_condition=SHARD_AUTOMATION,
    check_specs=[shard_check("rows_match_samples", "clip_embeddings",
                             "One finite embedding row per tar sample, aligned with the metadata.")],
)
def clip_embeddings(context: dg.AssetExecutionContext, config: ShardRunConfig, dataset: DatasetResource,
                    clip: ClipResource) -> dg.MaterializeResult:
    """clip-retrieval's inference layout under ``<root>/embeddings/``: ``img_emb/img_emb_{shard}.npy``,
    ``text_emb/text_emb_{shard}.npy`` (float16, L2-normalised) and ``metadata/metadata_{shard}.parquet``."""
    cfg, layout = dataset.config, dataset.layout

    # the device is leased at the first shard to embed: shards embedded following their download
    # (assets.follow) need none, and a step left nothing to do never waits for a busy GPU
    with gpu_device_when_needed(context, dataset) as device:
        # the run's captions and watermark scores made from the same decode of each image (assets.pixels)
        sharing = Sharing(context, dataset, device)

        def embed(key: str) -> dict:
            return embed_shard(layout, cfg, clip, clip.encoder(device().torch_device), key, device(),
                               pixels=sharing.pass_for if sharing else None)

        result = materialize_shards(context, dataset, "clip_embeddings", embed, rebuild=config.rebuild,
                                    describe=lambda key: {"model": clip.spec},
                                    check=("rows_match_samples",
                                           lambda key: check_clip_embeddings(layout, key, cfg.text_embeddings)),
                                    on_done=sharing.finish if sharing else None)
        leased = device(lease=False)
    name = leased.name if leased else "(none: every shard was embedded following its download)"
    # models loaded by this process so far: a batched backfill loads once per run, not once per shard
    return result._replace(metadata={**result.metadata, "model_loads_in_process": clip_models.LOAD_COUNT,
                                     "pid": os.getpid(), "device": name})


@dg.asset(
    **from_record("reordered_embeddings"),
    kinds={"numpy"},
    automation_condition=SHARD_AUTOMATION,
    check_specs=[shard_check("rows_line_up_with_keys", "reordered_embeddings",
                             "Row i is the embedding of the sample whose key ends in i; zeros elsewhere.")],
)
def reordered_embeddings(context: dg.AssetExecutionContext, config: ShardRunConfig,
                         dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/embeddings_reordered/{img,text}/``: one npy per tar, row i = the sample whose key ends
    in index i, zero rows for failed samples (what DALLE2-pytorch's decoder loader reads)."""
    cfg, layout = dataset.config, dataset.layout
    ledger = load_ledger(layout)

    def reorder(key: str) -> dict:
        if not exists(layout.img_emb(key)):
            return {"status": "no samples (shard has no embeddings)", "rows": 0}
        rows = ledger.shard(key).rows
        report = reorder_embeddings(key, layout, rows=rows, index_width=cfg.oom_sample)
        return {"status": "written", "rows": rows, "samples": report.samples,
                "zero_rows": rows - report.samples, "index_width": cfg.oom_sample,
                "path": dg.MetadataValue.path(layout.reordered_img(key))}

    return materialize_shards(context, dataset, "reordered_embeddings", reorder, rebuild=config.rebuild,
                              check=("rows_line_up_with_keys", lambda key: check_reordered_embeddings(
                                  layout, key, ledger.shard(key).rows, cfg.oom_sample)))
