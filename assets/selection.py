"""sample_selection: the config's curation rules applied to every image shard."""

import dagster as dg

from shardprep.curation.selection import active_rules, selection_inputs, shards_with_samples, update_selection
from shardprep.storage import lock
from shardprep.versions import current_stamps, write_stamp
from shardprep_dagster.assets.shard_runs import GLOBAL_AUTOMATION, from_record, versioned
from shardprep_dagster.resources.dataset import DatasetResource


@dg.asset(
    **from_record("sample_selection"),
    kinds={"parquet"},
    automation_condition=GLOBAL_AUTOMATION,
)
def sample_selection(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/selection/{shard}.parquet`` (``key``, ``keep``, ``reason``): the samples that the balanced
    tars, the precached encodings, both energon datasets and the loaders' ``selection_url`` use, by the
    rules ``dedup``, ``nsfw_max``, ``aesthetic_min``, ``min_original_size``, ``caption_min_length`` and
    ``caption_max_length``. Only shards whose rules or inputs changed are selected again; a shard whose
    scores or keep mask are not ready waits (the outputs leave it out until then). No rule: no selection,
    every sample is used."""
    layout, version = dataset.layout, dataset.versions["sample_selection"]
    rules = active_rules(dataset.config)
    # the image shards' stamps, read once for both
    images = current_stamps(layout, "image_shards", dataset.versions["image_shards"]) if rules else {}
    inputs = selection_inputs(layout, dataset.versions, rules, images) if rules else {}
    with_samples = set(shards_with_samples(layout, images))
    if with_samples and all(inputs.get(s) is None for s in with_samples):
        # every shard with samples waits for a score or keep mask: a selection of nothing is no selection
        waiting = sorted(with_samples)
        raise dg.Failure(description=f"no image shard can be selected yet: the {len(waiting)} shard(s) with samples "
                         f"({', '.join(waiting[:5])}{', ...' if len(waiting) > 5 else ''}) wait for the scores or "
                         "keep masks the rules read (image_scores, duplicates)")
    with lock(layout.root, "sample_selection"):
        r = update_selection(layout, inputs, rules)
        write_stamp(layout, "sample_selection", version)
    if not rules:
        return versioned(dataset, "sample_selection", dg.MaterializeResult(
            metadata={"status": "no rule configured: every sample is used"}))
    total = r.kept + r.dropped
    rows = [f"| {rule} | {rules.get(rule, '')} | {r.failing_by_rule.get(rule, 0)} | {r.dropped_by_rule.get(rule, 0)} |"
            for rule in rules if rule != "dedup_threshold"]
    table = "\n".join(["| rule | value | samples failing it | dropped by it first |", "|---|---|---:|---:|", *rows,
                       f"| **kept** | | | {r.kept} of {total} |"])
    return versioned(dataset, "sample_selection", dg.MaterializeResult(metadata={
        "kept": r.kept, "dropped": r.dropped, "kept_share": round(r.kept / total, 4) if total else 0.0,
        "rules": dg.MetadataValue.md(table), "shards_updated": len(r.shards_updated),
        "shards_waiting": len(r.shards_waiting), "path": dg.MetadataValue.path(layout.selection_dir)}))
