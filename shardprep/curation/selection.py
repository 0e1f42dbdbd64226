"""Which samples of each image shard the training outputs use: the config's curation rules applied to
the shard parquet (sizes, captions), the scores (image_scores) and the keep masks (duplicates).

Rules (config fields; unset = not applied), in the order a dropped sample's ``reason`` names the first
it fails: ``dedup`` (a duplicate of an earlier kept sample), ``nsfw_max`` (``nsfw_score`` above it),
``watermark_max`` (``pwatermark`` above it), ``aesthetic_min`` (``aesthetic_score`` below it),
``min_original_size`` (original width or height below it), ``caption_min_length`` /
``caption_max_length`` (caption characters). A sample without the score a rule reads (its embedding was
not finite, its image undecodable) fails that rule.

``<root>/selection/{shard}.parquet``: ``key``, ``keep``, ``reason`` for every successful sample of the
shard; ``selection/state.json`` (written last) records each shard's inputs, so an update redoes only
the shards whose rules or inputs changed; ``selection/summary.json`` counts samples kept and dropped per
rule. Without any rule there is no selection: every sample is used.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import numpy as np

from shardprep import storage
from shardprep.layout import Layout

RULES = ("dedup", "nsfw_max", "watermark_max", "aesthetic_min", "min_original_size", "caption_min_length",
         "caption_max_length")
# rule -> the score column it reads
SCORE_RULES = {"aesthetic_min": "aesthetic_score", "nsfw_max": "nsfw_score", "watermark_max": "pwatermark"}


def active_rules(cfg) -> dict:
    """The rules the config sets, ``{rule: value}`` (``dedup`` only when true)."""
    rules = {r: getattr(cfg, r) for r in RULES if getattr(cfg, r) not in (None, False)}
    if rules.get("dedup"):
        rules["dedup_threshold"] = cfg.dedup_threshold
    return rules


def rules_digest(rules: dict) -> str:
    return hashlib.sha256(json.dumps(rules, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class SelectionReport:
    shards_updated: list[str] = field(default_factory=list)
    shards_waiting: list[str] = field(default_factory=list)
    kept: int = 0  # over every selected shard
    dropped: int = 0
    dropped_by_rule: dict[str, int] = field(default_factory=dict)  # first rule failed
    failing_by_rule: dict[str, int] = field(default_factory=dict)  # every rule failed, overlaps counted
    seconds: float = 0.0


def selection_inputs(layout: Layout, versions: dict[str, str], rules: dict,
                     images: dict[str, dict | None] | None = None) -> dict[str, str | None]:
    """``{shard: identity of what its selection reads}`` for the image shards whose download is complete
    (None: a score or keep mask a rule needs is not there yet), in ledger order. The identity changes when
    the shard's samples, its scores or its keep mask are written again. ``images``: the image shards'
    ``current_stamps`` when the caller has them."""
    from shardprep.curation.dedup import mask_identities
    from shardprep.versions import current_stamps

    if images is None:
        images = current_stamps(layout, "image_shards", versions["image_shards"])
    scored = current_stamps(layout, "image_scores", versions["image_scores"]) if SCORE_RULES.keys() & rules.keys() \
        else {}
    masks = mask_identities(layout) if rules.get("dedup") else {}
    out: dict[str, str | None] = {}
    for key, stamp in images.items():
        if stamp is None or not storage.exists(layout.shard_parquet(key)):
            continue
        parts = [f"images@{stamp.get('written_at')}"]
        if SCORE_RULES.keys() & rules.keys():
            scores = scored.get(key)
            if scores is None:
                out[key] = None
                continue
            parts.append(f"scores@{scores.get('written_at')}")
        if rules.get("dedup"):
            if stamp.get("outputs", {}).get(layout.tar(key)) and key not in masks:
                out[key] = None
                continue
            parts.append(f"dedup@{masks.get(key)}")
        out[key] = ";".join(parts)
    return out


def shards_with_samples(layout: Layout, images: dict[str, dict | None]) -> list[str]:
    """The image shards whose download is complete with at least one sample, of ``images`` (the image
    shards' ``versions.current_stamps``)."""
    return [key for key, stamp in images.items() if stamp and stamp.get("outputs", {}).get(layout.tar(key))]


def select_shard(layout: Layout, shard: str, rules: dict) -> tuple[list[str], np.ndarray, list[str | None], dict]:
    """``(keys, keep, reason, failing)`` of ``shard``'s successful samples under ``rules``."""
    t = storage.read_parquet(layout.shard_parquet(shard)).to_pandas()
    t = t[t["status"] == "success"]
    keys = t["key"].tolist()
    n = len(keys)
    fails: dict[str, np.ndarray] = {}
    if rules.get("dedup"):
        mask = _read_mask(layout.dedup_shard(shard), "keep")
        fails["dedup"] = np.array([not mask.get(k, True) for k in keys], dtype=bool)
    for rule, column in SCORE_RULES.items():
        if rule in rules:
            scores = _read_mask(layout.scores(shard), column)
            x = np.array([scores.get(k, np.nan) for k in keys], dtype=np.float64)
            with np.errstate(invalid="ignore"):
                # a maximum keeps scores <= it, a minimum >= it; NaN fails both
                fails[rule] = ~(x <= rules[rule]) if rule.endswith("_max") else ~(x >= rules[rule])
    if "min_original_size" in rules:
        side = np.minimum(t["original_width"].fillna(0).to_numpy(), t["original_height"].fillna(0).to_numpy())
        fails["min_original_size"] = side < rules["min_original_size"]
    if "caption_min_length" in rules or "caption_max_length" in rules:
        lengths = np.array([len(c) if isinstance(c, str) else 0 for c in t.get("caption", [None] * n)])
        if "caption_min_length" in rules:
            fails["caption_min_length"] = lengths < rules["caption_min_length"]
        if "caption_max_length" in rules:
            fails["caption_max_length"] = lengths > rules["caption_max_length"]
    reason: list[str | None] = [None] * n
    for rule in reversed(RULES):  # the first rule in RULES order wins
        for i in np.flatnonzero(fails.get(rule, np.zeros(n, bool))):
            reason[i] = rule
    keep = np.array([r is None for r in reason], dtype=bool)
    return keys, keep, reason, {r: int(f.sum()) for r, f in fails.items()}


def _read_mask(url: str, column: str) -> dict:
    return storage.read_keyed(url, column) or {}


def update_selection(layout: Layout, inputs: dict[str, str | None], rules: dict) -> SelectionReport:
    """Select the samples of the shards in ``inputs`` (``{shard: identity of its inputs}``, None: an input
    a rule needs is not ready, the shard waits); shards selected before with the same rules and inputs are
    not read again. Without rules the selection folder is removed (every sample is used)."""
    import pyarrow as pa

    start = time.perf_counter()
    report = SelectionReport()
    if not rules:
        storage.remove_tree(layout.selection_dir)
        report.seconds = time.perf_counter() - start
        return report
    digest = rules_digest(rules)
    text = storage.read_text(layout.selection_state)
    state = json.loads(text) if text else {}
    if state.get("rules") != digest:
        state = {"rules": digest, "shards": {}}
    done: dict[str, dict] = state["shards"]
    for shard in [s for s in done if s not in inputs]:  # shards gone from the dataset
        storage.remove(layout.selection(shard))
        del done[shard]
    for shard, ident in inputs.items():
        if ident is None:
            report.shards_waiting.append(shard)
            continue
        if done.get(shard, {}).get("inputs") == ident:
            continue
        keys, keep, reason, failing = select_shard(layout, shard, rules)
        storage.write_parquet(layout.selection(shard), pa.table({
            "key": pa.array(keys, pa.string()), "keep": pa.array(keep, pa.bool_()),
            "reason": pa.array(reason, pa.string())}))
        dropped: dict[str, int] = {}
        for r in reason:
            if r is not None:
                dropped[r] = dropped.get(r, 0) + 1
        done[shard] = {"inputs": ident, "kept": int(keep.sum()), "dropped": dropped, "failing": failing}
        report.shards_updated.append(shard)
    for shard, entry in done.items():
        report.kept += entry["kept"]
        for name, target in (("dropped", report.dropped_by_rule), ("failing", report.failing_by_rule)):
            for rule, n in entry[name].items():
                target[rule] = target.get(rule, 0) + n
    report.dropped = sum(report.dropped_by_rule.values())
    storage.write_bytes(layout.selection_summary, json.dumps({
        "rules": rules, "shards": len(done), "kept": report.kept, "dropped": report.dropped,
        "dropped_by_rule": report.dropped_by_rule, "failing_by_rule": report.failing_by_rule}, indent=1).encode())
    storage.write_bytes(layout.selection_state, json.dumps(state).encode())  # last
    report.seconds = time.perf_counter() - start
    return report


def selected_keys(layout: Layout, shard: str) -> set[str] | None:
    """The kept keys of ``shard``, or None when the shard has no selection file."""
    return selected_in(layout.selection(shard))


def selected_in(url: str) -> set[str] | None:
    keep = storage.read_keyed(url, "keep")
    return None if keep is None else {k for k, kept in keep.items() if kept}


class SelectionFiles:
    """The kept keys of each shard from ``<root>/selection/{shard}.parquet`` files at ``url`` (what the
    loaders' ``selection_url`` names), each file read once, when its shard first comes up; a shard with
    no file yet keeps nothing."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._kept: dict[str, set[str]] = {}
        self._width: int | None = None

    def keys(self, shard: str) -> set[str]:
        if shard not in self._kept:
            self._kept[shard] = selected_in(f"{self.url}/{shard}.parquet") or set()
        return self._kept[shard]

    def __contains__(self, key: str) -> bool:
        """Whether the sample ``key`` is kept (a key starts with its shard id, as wide as the files' names)."""
        if self._width is None:
            fs, path = storage.url_to_fs(self.url)
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)] if fs.exists(path) else []
            shards = [n.removesuffix(".parquet") for n in names if n.endswith(".parquet")]
            self._width = len(shards[0]) if shards else 0
        return key in self.keys(key[:self._width])


def is_selecting(layout: Layout) -> bool:
    """Whether a selection is in force (rules were set when it was last updated)."""
    return storage.exists(layout.selection_state)


def energon_excludes(layout: Layout, tars: list[str]) -> list[str]:
    """split.yaml ``exclude`` entries for the tars (``{shard}.tar`` names) of an energon dataset: the
    samples the selection drops (``"<tar>/<key>"``), and the whole tar of an image shard not selected
    yet. Video shards' tars are not curated. No selection in force: nothing excluded."""
    from shardprep.ledger import shard_media

    if not is_selecting(layout):
        return []
    shards = {name: name.rsplit("/", 1)[-1].removesuffix(".tar") for name in tars}
    media = shard_media(layout, list(shards.values()))
    out = []
    for name, shard in shards.items():
        if media.get(shard, "image") != "image":
            continue
        keep = storage.read_keyed(layout.selection(shard), "keep")
        if keep is None:
            out.append(name)
            continue
        out += [f"{name}/{k}" for k, kept in keep.items() if not kept]
    return out
