"""NeMo text2img outputs: equal-size tars (reorganize_tar), wdinfo.pkl, precached SD encodings.

Unpartitioned and incremental: new shards fill the tail and add tars; a complete tar is written again only
when a sample in it changed or went (a reshard, a takedown), and its encoding with it.
"""

import pickle

import dagster as dg

from shardprep.curation.selection import active_rules, selected_keys
from shardprep.nemo.balanced import complete_tar_counts, source_identities, update_balanced_shards
from shardprep.nemo.precache import plan_precache, record_sources, write_precached_encodings
from shardprep.nemo.wdinfo import write_wdinfo
from shardprep.storage import exists, lock, read_bytes, remove, remove_tree
from shardprep.versions import stamped_version, write_stamp
from shardprep_dagster.assets.shard_runs import GLOBAL_AUTOMATION, from_record, gpu_device, versioned
from shardprep_dagster.resources.dataset import DatasetResource
from shardprep_dagster.resources.nemo import NemoEncoders


class BalancedConfig(dg.Config):
    final: bool = False  # the dataset is complete: publish the last, short tar too (wdinfo excludes it)


def _start_over_if_outdated(layout, folder: str, artifact: str, version: str) -> bool:
    """Delete ``folder`` when its outputs were made at another version (a config change, e.g.
    tar_chunk_size or the image size): every sample changed, so they are rebuilt, not patched."""
    if stamped_version(layout, artifact) == version or not exists(folder):
        return False
    remove_tree(folder)
    return True


@dg.asset(
    **from_record("balanced_shards"),
    kinds={"webdataset"},
    automation_condition=GLOBAL_AUTOMATION,
)
def balanced_shards(context: dg.AssetExecutionContext, config: BalancedConfig,
                    dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/balanced/{n}.tar``: tars of exactly ``tar_chunk_size`` successful samples (NeMo's
    reorganize_tar). New image shards fill them in shard order; a shard made again (reshard) has its
    changed samples replaced and its gone samples removed, only in the tars that hold them; the short
    last tar carries an ``.INCOMPLETE`` marker until it fills. With synthetic captions (``train_caption``)
    each sample's .txt is the caption it trains with."""
    cfg, layout, version = dataset.config, dataset.layout, dataset.versions["balanced_shards"]
    selecting = bool(active_rules(cfg))
    with lock(layout.root, "balanced_shards"):  # one update at a time, whoever launched it
        rebuilt = _start_over_if_outdated(layout, layout.balanced_dir, "balanced_shards", version)
        sources = source_identities(layout, dataset.versions, selecting, training_text=cfg.synthetic_text)
        r = update_balanced_shards(layout, sources, chunk_size=cfg.tar_chunk_size, final=config.final,
                                   selected=(lambda shard: selected_keys(layout, shard)) if selecting else None,
                                   training_text=cfg.synthetic_text)
        write_stamp(layout, "balanced_shards", version)
    if r.rebuilt:
        context.log.warning(f"balanced tars written again from the shards: {r.rebuilt}")
    return versioned(dataset, "balanced_shards", dg.MaterializeResult(metadata={
        "rebuilt_for_new_version": rebuilt, "rebuilt_because": r.rebuilt or "", "version": version,
        "complete_tars": len(r.complete_tars), "new_complete_tars": len(r.new_complete_tars),
        "rewritten_tars": len(r.rewritten_tars), "removed_tars": len(r.removed_tars),
        "partial_tar_samples": r.partial_count, "samples_added": r.samples_added,
        "samples_replaced": r.samples_replaced, "samples_removed": r.samples_removed,
        "total_samples": r.total_samples, "shards_consumed": sum(v is not None for v in sources.values()),
        "shards_changed": len(r.changed_shards), "shards_waiting": sum(v is None for v in sources.values()),
        "chunk_size": r.chunk_size, "changed": r.changed, "path": dg.MetadataValue.path(layout.balanced_dir)}))


def _wdinfo_lists_complete_tars(tar_dir: str, wdinfo_url: str) -> dg.AssetCheckResult:
    listed = pickle.loads(read_bytes(wdinfo_url))["tar_files"] if exists(wdinfo_url) else []
    complete = sorted(complete_tar_counts(tar_dir))
    missing, extra = sorted(set(complete) - set(listed)), sorted(set(listed) - set(complete))
    return dg.AssetCheckResult(
        check_name="lists_every_complete_tar", passed=not missing and not extra,
        severity=dg.AssetCheckSeverity.ERROR,
        description=f"wdinfo lists {len(listed)} tars; {len(complete)} complete tars on disk",
        metadata={"missing_from_wdinfo": dg.MetadataValue.json(missing[:50]),
                  "listed_but_not_complete": dg.MetadataValue.json(extra[:50])})


@dg.asset(
    **from_record("wdinfo"),
    kinds={"pickle"},
    automation_condition=dg.AutomationCondition.eager(),
    check_specs=[dg.AssetCheckSpec("lists_every_complete_tar", asset="wdinfo", blocking=True,
                                   description="wdinfo.pkl lists exactly the complete balanced tars.")],
)
def wdinfo(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/balanced/wdinfo.pkl``: ``{"tar_files", "chunk_size", "total_key_count"}`` over the complete
    balanced tars (paths relative to the balanced folder, subfolders included), as NeMo reads it."""
    cfg, layout = dataset.config, dataset.layout
    info = write_wdinfo(layout.balanced_dir, layout.balanced_wdinfo, cfg.tar_chunk_size)
    return versioned(dataset, "wdinfo", dg.MaterializeResult(
        metadata={"tar_files": len(info["tar_files"]), "total_key_count": info["total_key_count"],
                  "chunk_size": info["chunk_size"], "path": dg.MetadataValue.path(layout.balanced_wdinfo)},
        check_results=[_wdinfo_lists_complete_tars(layout.balanced_dir, layout.balanced_wdinfo)]))


@dg.asset(
    **from_record("precached_encodings"),
    kinds={"webdataset", "pytorch"},
    automation_condition=dg.AutomationCondition.eager(),
)
def precached_encodings(context: dg.AssetExecutionContext, dataset: DatasetResource,
                        nemo: NemoEncoders) -> dg.MaterializeResult:
    """``<root>/precached/{n}.tar`` per complete balanced tar: ``{key}.pickle`` with NeMo Stable Diffusion's
    ``autoencoderkl_image`` (mean‖logvar, float16) and ``clip-vit-large-patch14_text`` (float32, padded to
    a multiple of 8), plus ``precached/wdinfo.pkl``. Only tars not encoded yet, or whose samples changed
    since (their digest in the balanced state), are encoded; encodings of tars no longer complete go."""
    cfg, layout, version = dataset.config, dataset.layout, dataset.versions["precached_encodings"]
    with lock(layout.root, "precached_encodings"):
        rebuilt = _start_over_if_outdated(layout, layout.precached_dir, "precached_encodings", version)
        plan = plan_precache(layout)
        recorded = {i: d for i, d in plan.recorded.items() if i not in plan.gone}
        for i in plan.gone:
            remove(layout.precached_tar(i))
        if plan.gone:
            record_sources(layout, recorded)
        encoded, seconds, nonfinite, device_name = 0, 0.0, [], ""
        if plan.todo:
            with gpu_device(context, dataset) as device:
                device_name = device.name
                for i in plan.todo:
                    r = write_precached_encodings(
                        layout.balanced_tar(i), layout.precached_tar(i), nemo.sd_autoencoder(device.torch_device),
                        nemo.clip_text(device.torch_device), keep_original=cfg.precache_keep_original,
                        resolution=cfg.precache_resolution, batch_size=cfg.nemo_batch_size)
                    recorded[i] = plan.digests[i]
                    record_sources(layout, recorded)  # after each tar: a crash keeps what was encoded
                    encoded, seconds, nonfinite = encoded + r.samples, seconds + r.seconds, nonfinite + r.nonfinite_keys
                    context.log.info(f"precached {layout.precached_tar(i)}: {r.samples} samples in {r.seconds:.1f}s")
        changed = plan.todo or plan.gone or not exists(layout.precached_wdinfo)
        info = write_wdinfo(layout.precached_dir, layout.precached_wdinfo, cfg.tar_chunk_size) if changed and \
            exists(layout.precached_dir) else {"tar_files": sorted(recorded)}
        write_stamp(layout, "precached_encodings", version)
    return versioned(dataset, "precached_encodings", dg.MaterializeResult(metadata={
        "rebuilt_for_new_version": rebuilt, "version": version, "new_tars": len(plan.todo),
        "removed_tars": len(plan.gone), "samples_encoded": encoded, "seconds": round(seconds, 3),
        "device": device_name, "nonfinite_samples": dg.MetadataValue.json(nonfinite[:50]),
        "tar_files": len(info["tar_files"]), "path": dg.MetadataValue.path(layout.precached_dir)}))
