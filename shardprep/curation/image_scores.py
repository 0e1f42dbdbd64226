"""Curation scores of one image shard: from its CLIP embeddings, and LAION's watermark detector from pixels.

``layout.img_emb(shard)`` + ``layout.emb_metadata(shard)`` (clip-retrieval's layout: row i of the npy is
the sample ``image_path`` of metadata row i) -> ``layout.scores(shard)``: a parquet with ``key`` (the
metadata's order) and one float32 column per configured model (``aesthetic_score``: LAION's aesthetic
predictor, 1-10 scale; ``nsfw_score``: LAION's ``punsafe``, 1 = unsafe; ``pwatermark``: LAION's watermark
probability, from the shard tar's images: ``shardprep.models.watermark``), and ``aesthetic_model`` /
``nsfw_model`` / ``watermark_model`` naming the model files. The same score columns are joined into the
metadata parquet (replacing columns of the same name, e.g. an ``aesthetic_score`` or ``pwatermark``
copied from the source), so clip-retrieval's index and back end show them. Rows whose embedding is not
finite, or whose image the detector could not decode, get NaN scores (a sample with no usable score is
never selected by a minimum or a maximum).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

import numpy as np

from shardprep.curation.scores import ScoreHead
from shardprep.layout import Layout
from shardprep.models.watermark import WatermarkScores
from shardprep.storage import atomic_write, exists, read_npy, read_parquet, remove, write_parquet

SCORE_COLUMNS = {"aesthetic": "aesthetic_score", "nsfw": "nsfw_score", "watermark": "pwatermark"}  # model -> column
HISTOGRAM_BINS = 20


@dataclass
class ScoresReport:
    shard: str
    samples: int = 0
    stats: dict[str, dict[str, float]] = field(default_factory=dict)  # column -> min/mean/max/nan
    histograms: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # counts, edges
    seconds: float = 0.0


def score_table(keys: list[str], embeddings: np.ndarray, heads: dict[str, ScoreHead],
                watermark: WatermarkScores | None = None):
    """The scores parquet's table: ``key``, a column per head (and ``pwatermark``, ``watermark``'s scores
    taken by key: NaN for a key it did not score), and the model files' names."""
    import pyarrow as pa

    cols: dict[str, pa.Array] = {"key": pa.array(keys, pa.string())}
    models = {name: head.path for name, head in heads.items()}
    for name, head in heads.items():
        with np.errstate(invalid="ignore", over="ignore"):
            cols[SCORE_COLUMNS[name]] = pa.array(head(embeddings), pa.float32())
    if watermark is not None:
        by_key = dict(zip(watermark.keys, watermark.pwatermark.tolist()))
        cols[SCORE_COLUMNS["watermark"]] = pa.array(np.array([by_key.get(k, np.nan) for k in keys], np.float32))
        models["watermark"] = watermark.model
    for name, path in models.items():
        cols[f"{name}_model"] = pa.DictionaryArray.from_arrays(pa.array(np.zeros(len(keys), np.int32)),
                                                               pa.array([path]))
    return pa.table(cols)


def write_image_scores(shard: str, layout: Layout, heads: dict[str, ScoreHead],
                       watermark: WatermarkScores | None = None) -> ScoresReport:
    """Score every embedded sample of ``shard`` with ``heads`` (``{"aesthetic": head, "nsfw": head}``,
    either may be absent) and take its ``pwatermark`` from ``watermark`` (``score_watermarks`` of the
    shard's tar, run by the caller: it takes minutes, not under the metadata's lock); write
    ``layout.scores(shard)`` and join the columns into the metadata. A shard with no embeddings gets no
    scores file (a stale one is removed)."""
    start = time.perf_counter()
    report = ScoresReport(shard=shard)
    emb_url, meta_url = layout.img_emb(shard), layout.emb_metadata(shard)
    if not exists(emb_url) or (not heads and watermark is None):
        remove(layout.scores(shard))
        report.seconds = time.perf_counter() - start
        return report
    embeddings = read_npy(emb_url)
    meta = read_parquet(meta_url)
    if meta.num_rows != len(embeddings):
        raise ValueError(f"{meta_url}: {meta.num_rows} rows, but {emb_url} has {len(embeddings)} embeddings")
    keys = meta.column("image_path").to_pylist()
    table = score_table(keys, embeddings, heads, watermark)
    write_parquet(layout.scores(shard), table)
    _join_into_metadata(meta_url, meta, table)
    report.samples = len(keys)
    for col in (SCORE_COLUMNS[n] for n in [*heads, *(["watermark"] if watermark is not None else [])]):
        values = table.column(col).to_numpy(zero_copy_only=False).astype(np.float64)
        finite = values[np.isfinite(values)]
        report.stats[col] = {"min": float(finite.min()) if finite.size else float("nan"),
                             "mean": float(finite.mean()) if finite.size else float("nan"),
                             "max": float(finite.max()) if finite.size else float("nan"),
                             "nan": int(values.size - finite.size)}
        if finite.size:
            # a probability over [0, 1] (shards compare); the heads' scores over their range
            span = (0.0, 1.0) if col == SCORE_COLUMNS["watermark"] else None
            counts, edges = np.histogram(finite, bins=HISTOGRAM_BINS, range=span)
            report.histograms[col] = (counts.tolist(), edges.tolist())
    report.seconds = time.perf_counter() - start
    return report


def _join_into_metadata(url: str, meta, scores) -> None:
    """``meta`` (the metadata parquet's table, same row order) with the score columns set, rewritten
    atomically in pandas' parquet form, as clip_embeddings writes it."""
    df = meta.to_pandas()
    for name in scores.column_names:
        if name in SCORE_COLUMNS.values():
            df[name] = scores.column(name).to_numpy(zero_copy_only=False)
    buf = io.BytesIO()
    df.to_parquet(buf)
    with atomic_write(url) as f:
        f.write(buf.getbuffer())


def read_scores(layout: Layout, shard: str, columns: list[str] | None = None) -> dict[str, dict[str, float]]:
    """``{key: {column: score}}`` of ``shard`` (empty when it was not scored)."""
    url = layout.scores(shard)
    if not exists(url):
        return {}
    table = read_parquet(url)
    cols = [c for c in table.column_names if c in SCORE_COLUMNS.values() and (columns is None or c in columns)]
    keys = table.column("key").to_pylist()
    values = {c: table.column(c).to_pylist() for c in cols}
    return {k: {c: values[c][i] for c in cols} for i, k in enumerate(keys)}
