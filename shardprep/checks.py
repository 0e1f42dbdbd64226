"""Data quality checks per shard (the Dagster layer runs them as blocking asset checks).

Each returns a ``CheckOutcome``: passed, a one-line description, and numbers worth showing.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from shardprep.keys import index_of_key, split_member_name
from shardprep.layout import Layout
from shardprep.storage import exists, url_to_fs



@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict = field(default_factory=dict)


def tar_keys(url: str) -> list[str]:
    """Sample keys of a tar in order, reading headers only."""
    fs, path = url_to_fs(url)
    keys: list[str] = []
    with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
        for member in tar:
            split = split_member_name(member.name) if member.isreg() else None
            if split and (not keys or keys[-1] != split[0]):
                keys.append(split[0])
    return keys


def _success_keys(layout: Layout, shard: str) -> list[str]:
    table = pq.read_table(layout.shard_parquet(shard), columns=["key", "status"]).to_pydict()
    return sorted(k for k, s in zip(table["key"], table["status"]) if s == "success")


def check_image_shard(layout: Layout, shard: str) -> CheckOutcome:
    """The tar holds exactly the parquet's successful samples (and no tar when there are none)."""
    expected = _success_keys(layout, shard)
    keys = tar_keys(layout.tar(shard)) if exists(layout.tar(shard)) else []
    meta = {"tar_samples": len(keys), "parquet_successes": len(expected)}
    if sorted(keys) != expected:
        missing, extra = sorted(set(expected) - set(keys)), sorted(set(keys) - set(expected))
        return CheckOutcome(False, f"shard {shard}: tar has {len(keys)} samples, parquet says {len(expected)} "
                            f"successes (missing {missing[:5]}, unexpected {extra[:5]})", meta)
    if len(set(keys)) != len(keys):
        return CheckOutcome(False, f"shard {shard}: duplicate keys in the tar", meta)
    return CheckOutcome(True, f"shard {shard}: {len(keys)} samples match the parquet", meta)


def check_clip_embeddings(layout: Layout, shard: str, enable_text: bool = True) -> CheckOutcome:
    """One embedding row per sample of the tar (same keys, same order as the metadata), no NaN/Inf."""
    samples = tar_keys(layout.tar(shard)) if exists(layout.tar(shard)) else []
    if not samples:
        ok = not exists(layout.img_emb(shard))
        return CheckOutcome(ok, f"shard {shard}: no samples" + ("" if ok else " but an embedding file exists"))
    img = np.load(layout.img_emb(shard), mmap_mode="r")
    meta_keys = pq.read_table(layout.emb_metadata(shard), columns=["image_path"])["image_path"].to_pylist()
    arrays = {"img": img}
    if enable_text:
        arrays["text"] = np.load(layout.text_emb(shard), mmap_mode="r")
    bad = {name: int((~np.isfinite(a)).any(axis=1).sum()) for name, a in arrays.items()}
    meta = {"samples": len(samples), "img_rows": len(img), "metadata_rows": len(meta_keys),
            **{f"{n}_nonfinite_rows": v for n, v in bad.items()}}
    if any(len(a) != len(meta_keys) for a in arrays.values()):
        return CheckOutcome(False, f"shard {shard}: embedding rows {[len(a) for a in arrays.values()]} != "
                            f"{len(meta_keys)} metadata rows", meta)
    if sorted(meta_keys) != sorted(samples):
        return CheckOutcome(False, f"shard {shard}: embedded keys differ from the tar's "
                            f"({len(set(samples) - set(meta_keys))} samples without an embedding)", meta)
    if any(bad.values()):
        return CheckOutcome(False, f"shard {shard}: NaN/Inf in embeddings {bad}", meta)
    return CheckOutcome(True, f"shard {shard}: {len(img)} rows, one per sample, all finite", meta)


def check_reordered_embeddings(layout: Layout, shard: str, rows: int, index_width: int) -> CheckOutcome:
    """Row i of the reordered file is the embedding of the sample whose key ends in i; zeros elsewhere."""
    if not exists(layout.img_emb(shard)):
        ok = not exists(layout.reordered_img(shard))
        return CheckOutcome(ok, f"shard {shard}: no samples" + ("" if ok else " but a reordered file exists"))
    src = np.load(layout.img_emb(shard))
    out = np.load(layout.reordered_img(shard))
    keys = pq.read_table(layout.emb_metadata(shard), columns=["image_path"])["image_path"].to_pylist()
    meta = {"rows": int(out.shape[0]), "samples": len(keys)}
    if out.shape != (rows, src.shape[1]) or out.dtype != src.dtype:
        return CheckOutcome(False, f"shard {shard}: reordered shape {out.shape} {out.dtype}, expected "
                            f"({rows}, {src.shape[1]}) {src.dtype}", meta)
    idx = np.array([index_of_key(k, index_width) for k in keys], dtype=np.int64)
    misplaced = int((out[idx] != src).any(axis=1).sum())
    holes = np.setdiff1d(np.arange(rows), idx)
    nonzero_holes = int(out[holes].any(axis=1).sum())
    meta.update(misplaced_rows=misplaced, nonzero_hole_rows=nonzero_holes)
    if misplaced or nonzero_holes:
        return CheckOutcome(False, f"shard {shard}: {misplaced} rows not at their key's index, "
                            f"{nonzero_holes} non-zero rows for failed samples", meta)
    return CheckOutcome(True, f"shard {shard}: {len(keys)} rows at their key's index, {len(holes)} zero rows", meta)
