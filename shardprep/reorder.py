"""Per-shard reordering of clip-retrieval embeddings for DALLE2-pytorch's decoder loader.

The contract of Veldrovive/embedding-dataset-reordering, without its bugs: ``img_emb_<shard>.npy``
where row i is the embedding of the sample whose key ends in i (``int(key[-index_width:])``), zero
rows where the shard has no sample. Unlike the original we pad to the shard's full input row count
(trailing zero rows too) and keep the source dtype (float16) for the zero rows.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shardprep.errors import ShardprepError
from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep.storage import atomic_write, url_to_fs


class ReorderError(ShardprepError, ValueError):
    """Embeddings and keys of a shard cannot be laid out by key index."""


@dataclass
class ReorderReport:
    shard: str
    samples: int  # embeddings placed
    rows: int  # length of the written files (0 when nothing was written)
    holes: int  # zero rows
    wrote_text: bool


def reorder_array(embeddings: np.ndarray, keys: Sequence[str], rows: int, index_width: int,
                  shard: str = "?") -> np.ndarray:
    """``out[index_of_key(k)] = embeddings[j]`` for the j-th key; zero rows elsewhere; ``rows`` long."""
    embeddings = np.asarray(embeddings)
    if embeddings.ndim != 2:
        raise ReorderError(f"shard {shard}: embeddings must be 2-D [N, D], got shape {embeddings.shape}")
    if len(keys) != embeddings.shape[0]:
        raise ReorderError(f"shard {shard}: {embeddings.shape[0]} embeddings but {len(keys)} keys")
    if index_width < 1:
        raise ReorderError(f"shard {shard}: index_width must be >= 1, got {index_width}")
    if rows < 0:
        raise ReorderError(f"shard {shard}: rows must be >= 0, got {rows}")
    positions = np.empty(len(keys), dtype=np.int64)
    owner: dict[int, str] = {}
    for j, key in enumerate(keys):
        key = str(key)
        tail = key[-index_width:]
        if len(key) < index_width or not tail.isdigit():
            raise ReorderError(f"shard {shard}: key {key!r} has no {index_width}-digit index at its end")
        i = index_of_key(key, index_width)
        if i >= rows:
            raise ReorderError(f"shard {shard}: key {key!r} has index {i}, beyond the shard's {rows} rows")
        if i in owner:
            raise ReorderError(f"shard {shard}: keys {owner[i]!r} and {key!r} both have index {i}")
        owner[i] = key
        positions[j] = i
    out = np.zeros((rows, embeddings.shape[1]), dtype=embeddings.dtype)
    out[positions] = embeddings
    return out


def _load_npy(url: str) -> np.ndarray:
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        return np.load(io.BytesIO(f.read()), allow_pickle=False)


def _save_npy(url: str, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    with atomic_write(url) as f:
        f.write(buf.getbuffer())


def _remove(url: str) -> None:
    fs, path = url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


def reorder_embeddings(shard: str, layout: Layout, rows: int, index_width: int) -> ReorderReport:
    """Write ``layout.reordered_img(shard)`` (and ``reordered_text`` when text embeddings exist).

    A shard with no embeddings (0 successful samples) gets no file, and loses any stale one: DALLE2's
    loader skips tars without an embedding file, and it could not hold a sample anyway.
    """
    import pyarrow.parquet as pq

    img_url, text_url, meta_url = layout.img_emb(shard), layout.text_emb(shard), layout.emb_metadata(shard)
    fs, img_path = url_to_fs(img_url)
    if not fs.exists(img_path):
        _remove(layout.reordered_img(shard))
        _remove(layout.reordered_text(shard))
        return ReorderReport(shard=shard, samples=0, rows=0, holes=0, wrote_text=False)

    mfs, meta_path = url_to_fs(meta_url)
    if not mfs.exists(meta_path):
        raise ReorderError(f"shard {shard}: {img_url} exists but its metadata {meta_url} does not")
    with mfs.open(meta_path, "rb") as f:
        pf = pq.ParquetFile(f)
        if "image_path" not in pf.schema_arrow.names:
            raise ReorderError(f"shard {shard}: {meta_url} has no 'image_path' column (the sample keys)")
        keys = [str(k) for k in pf.read(columns=["image_path"]).column("image_path").to_pylist()]

    img = _load_npy(img_url)
    if img.shape[0] != len(keys):
        raise ReorderError(f"shard {shard}: {img_url} has {img.shape[0]} rows but {meta_url} has {len(keys)}")
    out_img = reorder_array(img, keys, rows, index_width, shard=shard)

    tfs, text_path = url_to_fs(text_url)
    out_text = None
    if tfs.exists(text_path):
        text = _load_npy(text_url)
        if text.shape[0] != len(keys):
            raise ReorderError(f"shard {shard}: {text_url} has {text.shape[0]} rows but {meta_url} has {len(keys)}")
        out_text = reorder_array(text, keys, rows, index_width, shard=shard)

    _save_npy(layout.reordered_img(shard), out_img)
    if out_text is not None:
        _save_npy(layout.reordered_text(shard), out_text)
    else:
        _remove(layout.reordered_text(shard))
    return ReorderReport(shard=shard, samples=len(keys), rows=rows, holes=rows - len(keys),
                         wrote_text=out_text is not None)
