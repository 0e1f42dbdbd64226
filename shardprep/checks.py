"""The blocking per-shard checks the Dagster layer runs: ``shardprep.verify``'s deep checks, each turned
into a ``CheckOutcome`` (passed, a one-line description naming the shard and file, numbers to show)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardprep.layout import Layout
from shardprep.verify import (
    Findings,
    verify_clip_embeddings,
    verify_image_shard,
    verify_reordered_embeddings,
    verify_video_shard,
)


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict = field(default_factory=dict)


def _outcome(shard: str, findings: Findings, passed: str) -> CheckOutcome:
    if findings.ok:
        return CheckOutcome(True, f"shard {shard}: {passed}", findings.facts)
    return CheckOutcome(False, f"shard {shard}: " + "; ".join(findings.problems), findings.facts)


def check_image_shard(layout: Layout, shard: str) -> CheckOutcome:
    """The tar holds exactly the parquet's successful samples (and no tar when there are none)."""
    f = verify_image_shard(layout, shard)
    return _outcome(shard, f, f"{f.facts.get('tar_samples', 0)} samples match the parquet")


def check_video_shard(layout: Layout, shard: str) -> CheckOutcome:
    """The video tar holds exactly the parquet's successful clips (and no tar when there are none)."""
    f = verify_video_shard(layout, shard)
    return _outcome(shard, f, f"{f.facts.get('tar_samples', 0)} clips match the parquet")


def check_clip_embeddings(layout: Layout, shard: str, enable_text: bool = True) -> CheckOutcome:
    """One embedding row per sample of the tar (same keys as the metadata), no NaN/Inf."""
    f = verify_clip_embeddings(layout, shard, enable_text, deep=True)
    return _outcome(shard, f, f"{f.facts.get('metadata_rows') or 0} rows, one per sample, all finite")


def check_reordered_embeddings(layout: Layout, shard: str, rows: int, index_width: int) -> CheckOutcome:
    """Row i of the reordered file is the embedding of the sample whose key ends in i; zeros elsewhere."""
    f = verify_reordered_embeddings(layout, shard, rows, index_width, deep=True)
    return _outcome(shard, f, f"{f.facts.get('samples', 0)} rows at their key's index")
