"""image_shards: downloaded, resized images as img2dataset-layout webdataset tars."""

import json
from typing import Callable

import dagster as dg

from shardprep.checks import check_image_shard
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from shardprep.report.contact_sheet import contact_sheet, inline_image
from shardprep.storage import atomic_write, exists, read_bytes, read_parquet, remove, url_to_fs
from shardprep_dagster.assets.follow import embedding as embedding_follows
from shardprep_dagster.assets.shard_runs import (
    SHARD_AUTOMATION,
    ShardRunConfig,
    failures_table,
    from_record,
    materialize_shards,
    shard_check,
)
from shardprep_dagster.resources.clip import ClipResource
from shardprep_dagster.resources.dataset import DatasetResource


def _stats_metadata(stats: dict, tar_url: str, tar_bytes: int) -> dict:
    count = stats["count"] or 1
    seconds = float(stats.get("duration") or 0.0)
    return {
        "samples": stats["count"],
        "successes": stats["successes"],
        "failed_to_download": stats["failed_to_download"],
        "failed_to_resize": stats["failed_to_resize"],
        "success_rate": round(stats["successes"] / count, 4),
        "failures_by_reason": failures_table(stats.get("status_dict", {})),
        "bytes": tar_bytes,
        "seconds": round(seconds, 3),
        "images_per_second": round(stats["count"] / seconds, 1) if seconds else 0.0,
        "tar": dg.MetadataValue.path(tar_url) if tar_bytes else dg.MetadataValue.text("(no tar: 0 successes)"),
        "dagster/row_count": stats["successes"],
    }


def contact_sheet_metadata(layout: Layout, key: str, rebuild: bool,
                           make: Callable[[str], bytes] = contact_sheet, tar_url: str | None = None) -> dict:
    """The shard's contact sheet (``<root>/previews/{shard}.png``, made from ``tar_url`` by ``make`` when
    missing) inlined in the metadata as a markdown image, so the UI shows it on the partition's page. A
    preview that cannot be made is reported, never a failed shard."""
    out = layout.contact_sheet(key)
    try:
        if exists(out) and not rebuild:
            png = read_bytes(out)
        else:
            png = make(tar_url or layout.tar(key))
            with atomic_write(out) as f:
                f.write(png)
        uri, _ = inline_image(png)
    except Exception as e:  # noqa: BLE001 - a preview is optional
        return {"contact_sheet": dg.MetadataValue.text(f"(no contact sheet: {type(e).__name__}: {e})")}
    # markdown image syntax: the UI's markdown renders no raw HTML, and allows data: image sources
    return {"contact_sheet": dg.MetadataValue.md(f"![contact sheet of shard {key}]({uri})"),
            "contact_sheet_png": dg.MetadataValue.path(out)}


@dg.asset(
    **from_record("image_shards"),
    kinds={"webdataset"},
    automation_condition=SHARD_AUTOMATION,
    check_specs=[shard_check("tar_matches_parquet", "image_shards",
                             "The tar holds exactly the samples the parquet marks as success.")],
)
def image_shards(context: dg.AssetExecutionContext, config: ShardRunConfig,
                 dataset: DatasetResource, clip: ClipResource) -> dg.MaterializeResult:
    """``<root>/images/{shard}.tar``, ``{shard}.parquet`` and ``{shard}_stats.json`` in img2dataset's
    webdataset layout. Bad URLs and images are recorded failures; a shard with no success gets no tar."""
    cfg, layout = dataset.config, dataset.layout

    def describe(key: str) -> dict:
        stats = json.loads(read_bytes(layout.shard_stats(key)))
        fs, path = url_to_fs(layout.tar(key))
        tar_bytes = fs.size(path) if fs.exists(path) else 0
        sheet = contact_sheet_metadata(layout, key, rebuild=False) if tar_bytes else {}
        return {**_stats_metadata(stats, layout.tar(key), tar_bytes), **sheet}

    def download(key: str) -> dict:
        table = read_parquet(layout.source_parquet(key))
        report = write_image_shard(table, int(key), cfg, layout)
        stats = json.loads(read_bytes(layout.shard_stats(key)))
        context.log.info(f"shard {key}: {report.successes}/{report.count} images in {report.seconds:.1f}s")
        if report.tar_written:
            sheet = contact_sheet_metadata(layout, key, rebuild=True)
        else:  # a rebuilt shard without successes: an older preview would show images it no longer has
            sheet = {}
            remove(layout.contact_sheet(key))
        return {**_stats_metadata(stats, layout.tar(key), report.tar_bytes), **sheet, "status": "written"}

    # a run that also embeds these shards starts embedding each one as its download ends (assets.follow)
    with embedding_follows(context, dataset, clip, rebuild=config.rebuild) as on_done:
        return materialize_shards(context, dataset, "image_shards", download, rebuild=config.rebuild,
                                  describe=describe, on_done=on_done,
                                  check=("tar_matches_parquet", lambda key: check_image_shard(layout, key)))
