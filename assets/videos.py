"""video_shards: downloaded, cut and re-encoded videos as video2dataset-layout webdataset tars."""

import json

import dagster as dg

from shardprep.checks import check_video_shard
from shardprep.layout import Layout
from shardprep.report.contact_sheet import video_contact_sheet
from shardprep.storage import read_bytes, read_parquet, remove, url_to_fs
from shardprep.takedown.lists import takedown_set
from shardprep.video.shards import write_video_shard
from shardprep.video.summary import clip_summary
from shardprep_dagster.assets.images import contact_sheet_metadata
from shardprep_dagster.assets.shard_runs import (
    SHARD_AUTOMATION,
    ShardRunConfig,
    failures_table,
    from_record,
    materialize_shards,
    shard_check,
)
from shardprep_dagster.resources.dataset import DatasetResource


def _sheet(layout: Layout, key: str, rebuild: bool) -> dict:
    """A frame strip per clip, inlined like the image shards' contact sheet."""
    return contact_sheet_metadata(layout, key, rebuild, make=video_contact_sheet, tar_url=layout.video_tar(key))


def _metadata(layout: Layout, key: str) -> dict:
    stats = json.loads(read_bytes(layout.video_stats(key)))
    fs, path = url_to_fs(layout.video_tar(key))
    tar_bytes = fs.size(path) if fs.exists(path) else 0
    clips = clip_summary(layout.video_tar(key)) if tar_bytes else {}
    count = stats["count"] or 1
    seconds = float(stats.get("duration") or 0.0)
    return {
        "samples": stats["count"],  # input rows, as image_shards counts them
        "successes": stats["successes"],
        "failed_to_download": stats["failed_to_download"],
        "failed_to_subsample": stats["failed_to_subsample"],
        "success_rate": round(stats["successes"] / count, 4),
        "failures_by_reason": failures_table(stats.get("status_dict", {})),
        "clips": clips.get("clips", 0),
        "clip_seconds": clips.get("seconds", 0.0),
        "clip_seconds_min": clips.get("min", 0.0),
        "clip_seconds_max": clips.get("max", 0.0),
        "frames": clips.get("frames", 0),
        "bytes_downloaded": int(stats.get("bytes_downloaded") or 0),
        "bytes": tar_bytes,
        "seconds": round(seconds, 3),
        "clips_per_second": round(clips.get("clips", 0) / seconds, 2) if seconds else 0.0,
        "tar": dg.MetadataValue.path(layout.video_tar(key)) if tar_bytes
        else dg.MetadataValue.text("(no tar: 0 successes)"),
        "dagster/row_count": clips.get("clips", 0),
    }


@dg.asset(
    **from_record("video_shards"),
    kinds={"webdataset"},
    automation_condition=SHARD_AUTOMATION,
    check_specs=[shard_check("tar_matches_parquet", "video_shards",
                             "The tar holds exactly the clips the parquet marks as success.")],
)
def video_shards(context: dg.AssetExecutionContext, config: ShardRunConfig,
                 dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/videos/{shard}.tar``, ``{shard}.parquet`` and ``{shard}_stats.json`` in video2dataset's
    webdataset layout, for the shards of ``video_source`` files (image shards: not applicable). A clip
    is a sample (``{key}_{clip}``); bad URLs and videos are recorded failures; no success, no tar."""
    cfg, layout = dataset.config, dataset.layout

    def download(key: str) -> dict:
        table = read_parquet(layout.source_parquet(key))
        report = write_video_shard(table, int(key), cfg, layout.videos_dir,
                                   takedowns=takedown_set(layout, cfg.takedown_lists))
        context.log.info(f"shard {key}: {report.successes}/{report.count} videos, {report.samples} clips "
                         f"in {report.seconds:.1f}s")
        if report.tar_written:
            sheet = _sheet(layout, key, rebuild=True)
        else:  # an older preview would show clips the shard no longer has
            sheet = {}
            remove(layout.contact_sheet(key))
        return {**_metadata(layout, key), **sheet, "status": "written"}

    def describe(key: str) -> dict:
        meta = _metadata(layout, key)
        return {**meta, **(_sheet(layout, key, rebuild=False) if meta["bytes"] else {})}

    return materialize_shards(context, dataset, "video_shards", download, rebuild=config.rebuild, describe=describe,
                              check=("tar_matches_parquet", lambda key: check_video_shard(layout, key)))
