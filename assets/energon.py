"""Megatron-Energon indexes (`.nv-meta/`) over the image shards and the diffusion samples, incremental."""

import dagster as dg

from shardprep.curation.selection import energon_excludes
from shardprep.energon import find_tars, update_energon_index
from shardprep.storage import exists
from shardprep_dagster.assets.shard_runs import GLOBAL_AUTOMATION, from_record, versioned
from shardprep_dagster.resources.dataset import DatasetResource


def _index_metadata(report) -> dict:
    return {"tars": len(report.tars), "samples": report.total_samples,
            "scanned_tars": len(report.scanned_tars), "kept_tars": len(report.kept_tars),
            "excluded_by_selection": report.excluded,
            "splits": dg.MetadataValue.json({k: len(v) for k, v in report.splits.items()}),
            "index_uuid": report.uuid, "path": dg.MetadataValue.path(report.dataset_dir)}


def _covers_every_tar(dataset_dir: str, report) -> dg.AssetCheckResult:
    on_disk = set(find_tars(dataset_dir)) if exists(dataset_dir) else set()
    indexed = set(report.tars) if report else set()
    missing = sorted(on_disk - indexed)
    return dg.AssetCheckResult(
        check_name="covers_every_tar", passed=not missing, severity=dg.AssetCheckSeverity.ERROR,
        description=f"{len(indexed)} of {len(on_disk)} tars indexed",
        metadata={"unindexed_tars": dg.MetadataValue.json(missing[:50])})


def _covers_spec(asset: str) -> dg.AssetCheckSpec:
    return dg.AssetCheckSpec("covers_every_tar", asset=asset, blocking=True,
                             description="Every complete tar in the folder is in the energon index.")


@dg.asset(
    **from_record("image_energon_index"),
    kinds={"sqlite", "yaml"},
    automation_condition=GLOBAL_AUTOMATION,
    check_specs=[_covers_spec("image_energon_index")],
)
def image_energon_index(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/images/.nv-meta/``: a Megatron-Energon dataset over the image shard tars (``CaptioningSample``:
    image = the image member, caption = ``txt``, or with synthetic captions (``train_caption``) the json's
    ``train_caption``), readable by energon 7 and NeMo's pinned 5.2.
    Only tars not indexed before are scanned."""
    cfg, layout = dataset.config, dataset.layout
    if not exists(layout.images_dir) or not find_tars(layout.images_dir):
        return versioned(dataset, "image_energon_index", dg.MaterializeResult(
            metadata={"status": "no image tars yet"},
            check_results=[_covers_every_tar(layout.images_dir, None)]))
    tars = find_tars(layout.images_dir)
    # with synthetic captions the caption is the json's train_caption (shardprep.training_text), in
    # energon's own field access syntax: json[train_caption], else the .txt
    caption = "json[train_caption],txt" if cfg.synthetic_text else "txt"
    report = update_energon_index(layout.images_dir, sample_type="captioning",
                                  field_map={"image": cfg.encode_format, "caption": caption},
                                  split_ratio=cfg.energon_split_ratio, tars=tars,
                                  exclude=energon_excludes(layout, tars))
    return versioned(dataset, "image_energon_index", dg.MaterializeResult(
        metadata=_index_metadata(report), check_results=[_covers_every_tar(layout.images_dir, report)]))


@dg.asset(
    **from_record("diffusion_energon_index"),
    kinds={"sqlite", "yaml"},
    automation_condition=GLOBAL_AUTOMATION,
    check_specs=[_covers_spec("diffusion_energon_index")],
)
def diffusion_energon_index(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/diffusion/.nv-meta/``: a ``CrudeWebdataset`` energon dataset over the diffusion sample tars,
    image and video shards' alike, for NeMo's ``DiffusionDataModule`` (a val split whenever the ratio
    asks for one)."""
    cfg, layout = dataset.config, dataset.layout
    if not exists(layout.diffusion_dir) or not find_tars(layout.diffusion_dir):
        return versioned(dataset, "diffusion_energon_index", dg.MaterializeResult(
            metadata={"status": "no diffusion tars yet"},
            check_results=[_covers_every_tar(layout.diffusion_dir, None)]))
    tars = find_tars(layout.diffusion_dir)
    report = update_energon_index(layout.diffusion_dir, sample_type="crude", split_ratio=cfg.energon_split_ratio,
                                  tars=tars, exclude=energon_excludes(layout, tars))
    return versioned(dataset, "diffusion_energon_index", dg.MaterializeResult(
        metadata=_index_metadata(report), check_results=[_covers_every_tar(layout.diffusion_dir, report)]))
