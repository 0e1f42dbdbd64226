"""Build a small shardprep-layout dataset (tars + embeddings) for loader tests.

``build_loader_dataset(root)`` writes, with the layout shardprep's writers use:

- ``images/{shard}.tar``: img2dataset webdataset members ``{key}.jpg/.txt/.json`` (failed samples
  absent), key = ``compute_key(index, shard, oom_sample, 5)``;
- ``embeddings_reordered/{img,text}/…_{shard}.npy``: float16, row i = key index i, zero rows at
  failed samples (what DALLE2's decoder loader reads);
- ``embeddings/{img_emb,text_emb,metadata}/…_{shard}``: clip-retrieval layout, successful samples
  in tar order, parquet ``image_path`` (= key), ``caption`` and json columns (what the prior reads).

The returned ``LoaderDataset`` holds the ground truth (jpeg bytes, embeddings, captions by key).
"""

import io
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import webdataset as wds
from PIL import Image

from shardprep.keys import compute_key, oom_sample_per_shard, shard_key
from shardprep.layout import Layout
from shardprep.storage import atomic_write

DEFAULT_FAILED = ((0, 2), (1, 5), (2, 0))  # (shard, index) of failed downloads: holes


@dataclass
class LoaderDataset:
    root: str
    layout: Layout
    shard_ids: list[int]
    samples_per_shard: int
    index_width: int  # digits of the in-shard index in a key (oom_sample)
    keys: list[str]  # successful samples, in tar (= clip-retrieval) order
    failed_keys: list[str]
    jpg: dict[str, bytes] = field(default_factory=dict)
    caption: dict[str, str] = field(default_factory=dict)
    img_emb: dict[str, np.ndarray] = field(default_factory=dict)
    text_emb: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def shard_width(self) -> int:
        return 5

    @property
    def tar_pattern(self) -> str:
        first, last = shard_key(self.shard_ids[0]), shard_key(self.shard_ids[-1])
        return f"{self.layout.images_dir}/{{{first}..{last}}}.tar"


def _l2_normalised(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def _jpeg(rng: np.random.Generator, size: int) -> bytes:
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _save_npy(url: str, array: np.ndarray) -> None:
    with atomic_write(url) as f:
        np.save(f, array)


def build_loader_dataset(
    root: str,
    *,
    n_shards: int = 3,
    rows_per_shard: int = 8,
    samples_per_shard: int = 10,
    failed=DEFAULT_FAILED,
    dim: int = 8,
    image_size: int = 32,
    seed: int = 0,
) -> LoaderDataset:
    """Write the dataset under ``root`` (a local path) and return its ground truth."""
    rng = np.random.default_rng(seed)
    layout = Layout(root)
    oom = oom_sample_per_shard(samples_per_shard)
    failed = set(failed)
    ds = LoaderDataset(root, layout, list(range(n_shards)), samples_per_shard, oom, [], [])
    for shard in ds.shard_ids:
        name = shard_key(shard)
        img = _l2_normalised(rng, rows_per_shard, dim)
        txt = _l2_normalised(rng, rows_per_shard, dim)
        ok_rows, meta = [], []
        with atomic_write(layout.tar(name)) as f:
            writer = wds.TarWriter(f)
            for index in range(rows_per_shard):
                key = compute_key(index, shard, oom, 5)
                if (shard, index) in failed:
                    ds.failed_keys.append(key)
                    img[index] = 0
                    txt[index] = 0
                    continue
                caption = f"sample {key}: a photo of thing {index} in shard {shard}"
                jpg = _jpeg(rng, image_size)
                info = {"url": f"http://127.0.0.1/{key}.jpg", "key": key, "status": "success",
                        "error_message": None, "caption": caption, "width": image_size, "height": image_size}
                writer.write({"__key__": key, "jpg": jpg, "txt": caption, "json": info})
                ds.keys.append(key)
                ds.jpg[key], ds.caption[key] = jpg, caption
                ds.img_emb[key], ds.text_emb[key] = img[index], txt[index]
                ok_rows.append(index)
                meta.append({"image_path": key, "caption": caption, "url": info["url"],
                             "width": image_size, "height": image_size, "status": "success"})
            writer.close()
        _save_npy(layout.reordered_img(name), img)
        _save_npy(layout.reordered_text(name), txt)
        _save_npy(layout.img_emb(name), img[ok_rows])
        _save_npy(layout.text_emb(name), txt[ok_rows])
        with atomic_write(layout.emb_metadata(name)) as f:
            pd.DataFrame(meta).to_parquet(f, index=False)
    return ds
