"""image_scores: aesthetic and NSFW scores of every image from the CLIP embeddings already made, and LAION's
watermark probability from its pixels."""

import contextlib

import dagster as dg

from shardprep.curation.image_scores import write_image_scores
from shardprep.curation.scores import load_head
from shardprep.models.watermark import load_watermark_model, score_watermarks
from shardprep.storage import exists, lock
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
from shardprep_dagster.resources.dataset import DatasetResource


def histogram_markdown(counts: list[int], edges: list[float], width: int = 30) -> str:
    """A histogram as a markdown table of text bars (the Dagster UI has no chart metadata)."""
    top = max(counts) or 1
    rows = [f"| {lo:.3g} to {hi:.3g} | {n} | {'█' * round(width * n / top)} |"
            for n, lo, hi in zip(counts, edges, edges[1:])]
    return "\n".join(["| score | samples | |", "|---|---:|---|", *rows])


def extremes_metadata(layout, key: str, n: int = 8, column: str = "aesthetic_score",
                      sheets: tuple[tuple[str, bool], ...] = (("top_by_aesthetic", True),
                                                             ("bottom_by_aesthetic", False))) -> dict:
    """The shard's ``n`` highest (``(name, True)`` in ``sheets``) or lowest (``False``) values of ``column``
    as inline contact sheets (captions: the score)."""
    from shardprep.report.contact_sheet import ContactSheetError, inline_image, render_sheet, samples_of
    from shardprep.storage import read_parquet

    t = read_parquet(layout.scores(key), ["key", column]).to_pandas().dropna().sort_values(column)
    out = {}
    for name, highest in sheets:
        rows = t.iloc[::-1][:n] if highest else t.iloc[:n]
        try:
            samples = samples_of(layout.tar(key), {k: f"{s:.3f} {k}" for k, s in zip(rows["key"], rows[column])})
            if samples:
                uri, _ = inline_image(render_sheet(samples, thumb=80))
                out[name] = dg.MetadataValue.md(f"![{name.replace('_', ' ')} of shard {key}]({uri})")
        except (ContactSheetError, OSError) as e:
            out[name] = dg.MetadataValue.text(f"(no contact sheet: {type(e).__name__}: {e})")
    return out


@dg.asset(
    **from_record("image_scores"),
    kinds={"parquet", "numpy"},
    automation_condition=SHARD_AUTOMATION,
)
def image_scores(context: dg.AssetExecutionContext, config: ShardRunConfig,
                 dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/scores/{shard}.parquet``: ``key``, ``aesthetic_score`` (LAION's aesthetic predictor, a 1-10
    rating) and ``nsfw_score`` (LAION's punsafe) of every embedded sample, from the configured heads
    (``aesthetic_model``, ``nsfw_model``) applied to the float32, L2-normalised CLIP image embeddings, and
    ``pwatermark`` (LAION's watermark detector, ``watermark_model``, on the shard tar's images); the score
    columns are also joined into clip-retrieval's metadata parquet. No model configured: no file, status
    "no score model configured"."""
    cfg, layout = dataset.config, dataset.layout
    heads, models = score_models(cfg)

    # the heads are a few float32 matrix products per shard, done with numpy on the CPU; the watermark
    # detector (an EfficientNet-B3 on every image) runs on a device leased at the first shard it scores
    with gpu_device_when_needed(context, dataset) as device:
        def score(key: str) -> dict:
            if not models:
                return {"status": "no score model configured (aesthetic_model, nsfw_model, watermark_model)",
                        "samples": 0}
            if not exists(layout.img_emb(key)):
                return {"status": "no samples (shard has no embeddings)", "samples": 0, **models}
            watermark = None
            if cfg.watermark_model is not None:  # before the lock: minutes on a CPU
                detector = load_watermark_model(cfg.watermark_model, device().torch_device)
                watermark = score_watermarks(layout.tar(key), detector, batch_size=cfg.batch_size)
            return score_shard(layout, key, heads, models, watermark,
                               None if watermark is None else device().name)

        return materialize_shards(context, dataset, "image_scores", score, rebuild=config.rebuild,
                                  describe=lambda key: models)


def score_models(cfg) -> tuple[dict, dict]:
    """(the configured score heads by name, the ``*_model`` metadata naming every score model)."""
    heads = {name: load_head(spec) for name, spec in (("aesthetic", cfg.aesthetic_model),
                                                       ("nsfw", cfg.nsfw_model)) if spec is not None}
    models = {f"{n}_model": h.path for n, h in heads.items()}
    if cfg.watermark_model is not None:
        models["watermark_model"] = cfg.watermark_model
    return heads, models


def score_shard(layout, key: str, heads: dict, models: dict, watermark, device_name: str | None) -> dict:
    """image_scores' work on an embedded shard once its watermark scores are known (``watermark``: None
    without a detector; scored on ``device_name``); also run by ``assets.pixels`` with the scores made
    from the clip step's decode of the images."""
    if not exists(layout.img_emb(key)):
        return {"status": "no samples (shard has no embeddings)", "samples": 0, **models}
    # the metadata parquet is clip_embeddings' file: rewritten under its lock, its stamp's size kept true
    same = lock_name("clip_embeddings", key) == lock_name("image_scores", key)
    with contextlib.nullcontext() if same else lock(layout.root, lock_name("clip_embeddings", key)):
        report = write_image_scores(key, layout, heads, watermark)
        restamp_sizes(layout, "clip_embeddings", key, file_sizes([layout.emb_metadata(key)]))
    meta: dict = {"status": "written", "samples": report.samples, "seconds": round(report.seconds, 3),
                  "path": dg.MetadataValue.path(layout.scores(key)), "dagster/row_count": report.samples,
                  **models}
    for col, stats in report.stats.items():
        meta.update({f"{col}_{k}": round(v, 4) if isinstance(v, float) else v for k, v in stats.items()})
    for col, (counts, edges) in report.histograms.items():
        meta[f"{col}_histogram"] = dg.MetadataValue.md(histogram_markdown(counts, edges))
    if "aesthetic" in heads:
        meta.update(extremes_metadata(layout, key))
    if watermark is not None:
        meta["watermark_device"] = device_name
        meta["watermark_skipped"] = len(watermark.skipped)  # images the detector could not decode
        meta.update(extremes_metadata(layout, key, column="pwatermark", sheets=(("top_by_pwatermark", True),)))
    return meta
