"""The ``duplicates`` engine at 1M embeddings: indexing and querying time, peak memory, and the recall
of near-duplicates against brute force.

    python bench/dedup.py [--rows 1000000] [--dim 512] [--shard 10000] [--steps 2] [--out bench/DEDUP.md]

Builds a synthetic dataset in ``bench/work/dedup-*`` (clip-retrieval's layout: float16 L2-normalised
``img_emb`` + metadata per shard, and the shard parquet's ``sha256``): random unit vectors (512-d, as
ViT-B/32's), with planted duplicates: 1% of rows are near copies of an earlier row (cosine 0.95-0.995,
half of them from an earlier shard) and 0.2% exact copies (same bytes: same sha256 and embedding). Then
``update_duplicates`` takes the shards in ``--steps`` arrivals (the later ones checked against the
earlier index, never re-reading old shards). Brute force: for 2,000 sampled rows (1,000 planted near
copies, 1,000 others), the exact maximum cosine to every earlier row the run kept, with numpy, in float32,
from the stored float16 embeddings (what an exact index would answer); recall = the share of rows brute force calls duplicates (>= threshold) that
the index also drops, precision the converse. Random vectors have no cluster structure, the hardest
case for an IVF index, so real CLIP embeddings should do no worse.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from shardprep.curation.dedup import IVF_AT, NPROBE, REGROW, update_duplicates  # noqa: E402
from shardprep.layout import Layout  # noqa: E402

THRESHOLD = 0.95


def make_dataset(root: str, rows: int, dim: int, shard: int, seed: int = 0) -> dict:
    """Write the shards; returns the planted rows ``{"near": [global rows], "exact": [...]}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    layout = Layout(root)
    for d in ("embeddings/img_emb", "embeddings/metadata", "images"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    rng = np.random.default_rng(seed)
    stored = np.zeros((rows, dim), dtype=np.float16)  # what the files hold, for the brute force
    near, exact = [], []
    for s, start in enumerate(range(0, rows, shard)):
        n = min(shard, rows - start)
        e = rng.standard_normal((n, dim), dtype=np.float32)
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        hashes = [f"{s:05d}-{i}" for i in range(n)]
        if start:
            for i in rng.choice(n, size=n // 100, replace=False):  # near copies of an earlier row
                # half from an earlier shard, half from earlier in this one
                src = int(rng.integers(start, start + i)) if i and rng.random() < 0.5 else int(rng.integers(0, start))
                target = float(rng.uniform(0.95, 0.995))
                base = (stored[src].astype(np.float32) if src < start else e[src - start])
                base = base / np.linalg.norm(base)
                noise = rng.standard_normal(dim).astype(np.float32)
                noise -= noise @ base * base
                noise /= np.linalg.norm(noise)
                e[i] = target * base + np.sqrt(1 - target ** 2) * noise
                near.append(start + i)
            for i in rng.choice(n, size=n // 500, replace=False):  # exact copies: same bytes
                if start + i in near:
                    continue
                src = int(rng.integers(0, start))
                e[i] = stored[src].astype(np.float32)
                hashes[i] = f"{src // shard:05d}-{src % shard}"
                exact.append(start + i)
        stored[start:start + n] = e.astype(np.float16)
        key = f"{s:05d}"
        keys = [f"{key}{i:05d}" for i in range(n)]
        np.save(layout.img_emb(key), stored[start:start + n])
        pq.write_table(pa.table({"image_path": keys}), layout.emb_metadata(key))
        pq.write_table(pa.table({"key": keys, "sha256": hashes}), layout.shard_parquet(key))
    np.save(os.path.join(root, "all.npy"), stored)
    return {"near": sorted(map(int, near)), "exact": sorted(map(int, exact))}


def brute_force(stored: np.ndarray, kept: np.ndarray, rows: list[int], block: int = 50_000) -> dict[int, float]:
    """Each row's maximum cosine to any earlier kept row (float32 from the stored float16): what an
    exact index would have answered for it. All queries at once, over blocks of the stored rows."""
    rows_arr = np.asarray(rows)
    q = stored[rows_arr].astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    best = np.full(len(rows_arr), -1.0, dtype=np.float32)
    for start in range(0, len(stored), block):
        stop = min(len(stored), start + block)
        b = stored[start:stop].astype(np.float32)
        b /= np.linalg.norm(b, axis=1, keepdims=True)
        sims = q @ b.T
        cols = np.arange(start, stop)
        sims[(cols[None, :] >= rows_arr[:, None]) | ~kept[start:stop][None, :]] = -1.0
        best = np.maximum(best, sims.max(axis=1))
    return dict(zip(rows_arr.tolist(), best.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--shard", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "DEDUP.md"))
    args = ap.parse_args()
    root = os.path.join(HERE, "work", f"dedup-{args.rows}-{args.dim}")
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    # in a child process, so this process's peak memory is the dedup's (and the brute force's, after it)
    import multiprocessing as mp

    child = mp.get_context("fork").Process(target=lambda: json.dump(
        make_dataset(root, args.rows, args.dim, args.shard), open(os.path.join(root, "planted.json"), "w")))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"making the dataset failed ({child.exitcode})")
    planted = json.load(open(os.path.join(root, "planted.json")))
    print(f"dataset: {time.perf_counter() - t0:.0f} s", flush=True)
    layout = Layout(root)
    shards = [f"{s:05d}" for s in range(-(-args.rows // args.shard))]
    steps = []
    for k in range(args.steps):
        upto = shards[:len(shards) * (k + 1) // args.steps]
        report = update_duplicates(layout, {s: "v1" for s in upto}, THRESHOLD)
        steps.append({"shards": len(report.shards_added), "samples": report.samples_added,
                      "seconds": round(report.seconds, 1), "index": report.index, "kept": report.kept_total,
                      "duplicates": report.duplicates_total})
        print(steps[-1], flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    again = update_duplicates(layout, {s: "v1" for s in shards}, THRESHOLD)

    import pandas as pd

    decided = pd.concat([pd.read_parquet(layout.dedup_shard(s)) for s in shards], ignore_index=True)
    dropped = ~decided["keep"].to_numpy()
    stored = np.load(os.path.join(root, "all.npy"), mmap_mode="r")
    rng = np.random.default_rng(1)
    near = rng.choice(planted["near"], size=min(1000, len(planted["near"])), replace=False).tolist()
    others = [int(r) for r in rng.choice(args.rows, size=1200, replace=False) if r not in set(planted["near"])][:1000]
    t1 = time.perf_counter()
    truth = brute_force(stored, ~dropped, near + others)
    brute_s = time.perf_counter() - t1
    positives = [r for r, s in truth.items() if s >= THRESHOLD]
    found = [r for r in positives if dropped[r]]
    false = [r for r, s in truth.items() if s < THRESHOLD and dropped[r]]
    exact_found = int(dropped[planted["exact"]].sum())
    result = {"rows": args.rows, "dim": args.dim, "shard": args.shard, "threshold": THRESHOLD, "ivf_at": IVF_AT,
              "nprobe": NPROBE, "steps": steps, "noop_seconds": round(again.seconds, 3), "peak_rss_mb": round(peak_mb),
              "planted_near": len(planted["near"]), "planted_exact": len(planted["exact"]),
              "exact_found": exact_found, "sampled": len(truth), "brute_positives": len(positives),
              "recall": round(len(found) / max(1, len(positives)), 4),
              "false_drops": len(false), "brute_force_seconds_per_query": round(brute_s / len(truth), 3),
              "cores": os.cpu_count()}
    print(json.dumps(result, indent=1))
    total = sum(s["seconds"] for s in steps)
    lines = [
        "# Duplicates at 1M embeddings", "",
        f"`python bench/dedup.py --rows {args.rows} --dim {args.dim}` on {os.cpu_count()} cores "
        "(shardprep/curation/dedup.py; method in bench/dedup.py's docstring).", "",
        "| figure | value |", "|---|---:|",
        f"| embeddings ({args.dim}-d float16, {args.shard:,} per shard) | {args.rows:,} |",
        f"| planted near copies (cosine 0.95-0.995) / exact copies | {len(planted['near']):,} / "
        f"{len(planted['exact']):,} |",
        *[f"| arrival {i + 1}: {s['shards']} shards, {s['samples']:,} samples, index {s['index']} | {s['seconds']} s |"
          for i, s in enumerate(steps)],
        f"| all {args.rows:,} indexed and queried | {total:.0f} s ({args.rows / total:,.0f} samples/s) |",
        f"| nothing new (state read only) | {again.seconds:.3f} s |",
        f"| peak memory (RSS) | {peak_mb:,.0f} MB |",
        f"| duplicates dropped | {result['steps'][-1]['duplicates']:,} |",
        f"| exact copies found | {exact_found:,} of {len(planted['exact']):,} |",
        f"| recall of near duplicates vs brute force ({len(truth):,} sampled rows, {len(positives):,} duplicates "
        f"by brute force) | {result['recall']:.2%} |",
        f"| false drops among the sampled rows | {len(false)} |",
        f"| brute force, per query over all earlier kept rows (numpy, 2,000 queries at once) | {result['brute_force_seconds_per_query']} s |",
        "", f"Settings: threshold {THRESHOLD}, exact `IndexFlatIP` up to {IVF_AT:,} kept samples, then "
        f"`IVF{{4 sqrt n}},SQfp16` (trained again with more lists at {REGROW}x the size its lists were made for), "
        f"nprobe {NPROBE}. Peak memory: the bench process over both arrivals, measured before the "
        "brute force (the dataset is made in a child process). The second arrival is slower: each query scans "
        "a larger index, and the index is trained again (3,896 lists) once.", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
