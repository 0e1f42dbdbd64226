"""sample_selection: the config's curation rules applied to every image shard."""

import dagster as dg

from assets.duplicates import duplicates
from assets.images import image_shards
from assets.scores import image_scores
from assets.shard_runs import GLOBAL_AUTOMATION, versioned
from resources.dataset import DatasetResource
from shardprep.dedup import load_state
from shardprep.ledger import load_ledger
from shardprep.selection import SCORE_RULES, active_rules, update_selection
from shardprep.storage import exists, lock
from shardprep.versions import read_stamp, write_stamp


def selection_inputs(dataset: DatasetResource, rules: dict) -> dict[str, str | None]:
    """``{shard: identity of what its selection reads}`` for the image shards whose download is complete
    (None: a score or keep mask a rule needs is not there yet), in ledger order."""
    layout, versions = dataset.layout, dataset.versions
    ledger = load_ledger(layout)
    dedup = (load_state(layout) or {}).get("shards", {}) if rules.get("dedup") else {}
    out: dict[str, str | None] = {}
    for key in ledger.keys() if ledger else []:
        if ledger.media(key) != "image":
            continue
        images = read_stamp(layout, "image_shards", key)
        if not images or images["version"] != versions["image_shards"] or not exists(layout.shard_parquet(key)):
            continue
        parts = [f"images@{images.get('written_at')}"]
        if SCORE_RULES.keys() & rules.keys():
            scores = read_stamp(layout, "image_scores", key)
            if not scores or scores["version"] != versions["image_scores"]:
                out[key] = None
                continue
            parts.append(f"scores@{scores.get('written_at')}")
        if rules.get("dedup"):
            has_tar = exists(layout.tar(key))
            if has_tar and key not in dedup:
                out[key] = None
                continue
            parts.append(f"dedup@{dedup.get(key)}")
        out[key] = ";".join(parts)
    return out


@dg.asset(
    deps=[dg.AssetDep(image_shards, partition_mapping=dg.AllPartitionMapping()),
          dg.AssetDep(image_scores, partition_mapping=dg.AllPartitionMapping()), duplicates],
    group_name="curation",
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
    with lock(layout.root, "sample_selection"):
        r = update_selection(layout, selection_inputs(dataset, rules) if rules else {}, rules)
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
