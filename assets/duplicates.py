"""duplicates: exact and near duplicates across every image shard, updated as shards arrive."""

import dagster as dg

from shardprep.curation.dedup import embedded_shards, update_duplicates
from shardprep.curation.selection import shards_with_samples
from shardprep.storage import exists, lock, remove_tree
from shardprep.versions import current_stamps, write_stamp
from shardprep_dagster.assets.shard_runs import GLOBAL_AUTOMATION, from_record, versioned
from shardprep_dagster.resources.dataset import DatasetResource


@dg.asset(
    **from_record("duplicates"),
    kinds={"faiss", "parquet"},
    automation_condition=GLOBAL_AUTOMATION,
)
def duplicates(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/dedup/``: ``duplicates.parquet`` (``key``, ``kept_key``, ``similarity``, ``reason`` exact or
    near, ``shard``) and ``shards/{shard}.parquet`` (every embedded sample's ``keep``), with ``dedup: true``.
    A sample is dropped when an earlier kept one has the same image bytes or a CLIP image embedding at
    cosine >= ``dedup_threshold``. Shards finished since the last update are checked against a FAISS
    index of everything kept before; old shards are not read again."""
    cfg, layout, version = dataset.config, dataset.layout, dataset.versions["duplicates"]
    if not cfg.dedup:
        if exists(layout.dedup_dir):  # turned off: no keep mask may outlive it
            remove_tree(layout.dedup_dir)
        return versioned(dataset, "duplicates", dg.MaterializeResult(metadata={"status": "off (dedup: false)"}))
    shards = embedded_shards(layout, dataset.versions["clip_embeddings"])
    if not shards:
        # nothing to compare: materializing would claim a dedup of samples nobody looked at
        waiting = shards_with_samples(layout, current_stamps(layout, "image_shards", dataset.versions["image_shards"]))
        if waiting:
            raise dg.Failure(description=f"no image shard has CLIP embeddings at the current version: the "
                             f"{len(waiting)} shard(s) with samples ({', '.join(waiting[:5])}"
                             f"{', ...' if len(waiting) > 5 else ''}) wait for clip_embeddings")
    with lock(layout.root, "duplicates"):  # one update at a time, whoever launched it
        r = update_duplicates(layout, shards, cfg.dedup_threshold)
        write_stamp(layout, "duplicates", version)
    context.log.info(f"dedup: {len(r.shards_added)} shard(s) added ({r.samples_added} samples: {r.exact} exact and "
                     f"{r.near} near duplicates); {r.kept_total} kept in the index")
    return versioned(dataset, "duplicates", dg.MaterializeResult(metadata={
        "shards_added": len(r.shards_added), "samples_added": r.samples_added, "exact_duplicates_added": r.exact,
        "near_duplicates_added": r.near, "kept_samples": r.kept_total, "duplicates": r.duplicates_total,
        "rebuilt": r.rebuilt, "index": r.index, "threshold": cfg.dedup_threshold, "seconds": round(r.seconds, 2),
        "path": dg.MetadataValue.path(layout.dedup_table)}))
