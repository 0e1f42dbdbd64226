"""The reordering step of today's glue: Veldrovive/embedding-dataset-reordering's per-shard algorithm
(``embedding_dataset_reordering/apiv2.py``: ``reorder_embeddings`` -> ``reorder_shard``), as a script.

    python bench/reorder_glue.py --embeddings_folder E --metadata_folder M --output_folder O \
        [--index_width 4] [--output_shard_width 6]

Its package cannot be used as is: ``apiv2`` imports a ``helper`` module only its source tree has and
S3FileSystem, and ``DataFrame.drop(cols, 1)`` (positional axis) raises on pandas >= 2. What is kept, step
for step: for each clip-retrieval output partition (``img_emb_{n}.npy`` + ``metadata_{n}.parquet``,
sorted by n), read the metadata with pandas, split ``image_path`` (the sample key) into shard =
``key[:-index_width]`` and index = ``key[-index_width:]``, sort by (shard, index), walk the rows with
``iterrows`` filling each gap before a key with zero rows, save one ``img_emb_{shard}.npy`` per shard
(``np.save`` of the list of rows: float64 when a gap was filled, the embeddings' dtype otherwise) to a
temporary folder, then put the files into the output folder. No rows after a shard's last key (the
original does not know the shard's size). ``index_width`` and ``output_shard_width`` are the original's
parameters (its ``reorder_embeddings`` passes 4 and 6); the benchmark passes its dataset's widths.
Image embeddings only, like the original.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import fsspec
import numpy as np
import pandas as pd


def get_shard(file_path: str) -> str:
    return os.path.basename(file_path).split("_")[-1].split(".")[0]


def reorder_shard(embedding_file: str, metadata_file: str, output_folder: str, index_width: int,
                  output_shard_width: int) -> None:
    with tempfile.TemporaryDirectory() as tmpdir:
        with fsspec.open(metadata_file, "rb") as f:
            metadata_df = pd.read_parquet(f)
        metadata_df["img_shard"] = metadata_df.image_path.str[:-index_width].astype(int)
        metadata_df["img_index"] = metadata_df.image_path.str[-index_width:].astype(int)
        metadata_df["original_index"] = metadata_df.index
        # the original passes axis positionally (`drop(cols, 1, ...)`), which pandas 2 rejects
        metadata_df.drop(metadata_df.columns.difference(["original_index", "img_shard", "img_index"]), axis=1,
                         inplace=True)
        metadata_df = metadata_df.sort_values(by=["img_shard", "img_index"])
        with fsspec.open(embedding_file, "rb") as f:
            embeddings = np.load(f)
        assert len(embeddings) == len(metadata_df)
        embedding_shape = embeddings.shape[1:]

        shard_embeddings: list = []
        current_shard = None
        last_index = -1
        for _, row in metadata_df.iterrows():
            img_shard, img_index = row.img_shard, row.img_index
            embedding = embeddings[row.original_index]
            if current_shard is None or current_shard != img_shard:
                if current_shard is not None:
                    np.save(os.path.join(tmpdir, f"img_emb_{str(current_shard).zfill(output_shard_width)}.npy"),
                            shard_embeddings)
                shard_embeddings = []
                current_shard = img_shard
                last_index = -1
            if img_index > last_index + 1:  # failed samples keep their index: fill the gap with zeros
                shard_embeddings.extend(np.zeros((img_index - last_index - 1, *embedding_shape)))
            shard_embeddings.append(embedding)
            last_index = img_index
        np.save(os.path.join(tmpdir, f"img_emb_{str(current_shard).zfill(output_shard_width)}.npy"),
                shard_embeddings)

        output_fs, output_path = fsspec.core.url_to_fs(output_folder)
        output_fs.makedirs(output_path, exist_ok=True)
        for file in os.listdir(tmpdir):
            output_fs.put(os.path.join(tmpdir, file), os.path.join(output_path, file))


def reorder_embeddings(output_folder: str, embeddings_folder: str, metadata_folder: str, index_width: int,
                       output_shard_width: int) -> int:
    embeddings_fs, embeddings_path = fsspec.core.url_to_fs(embeddings_folder)
    metadata_fs, metadata_path = fsspec.core.url_to_fs(metadata_folder)
    embedding_paths = sorted(embeddings_fs.ls(embeddings_path, detail=False), key=lambda p: int(get_shard(p)))
    metadata_paths = sorted(metadata_fs.ls(metadata_path, detail=False), key=lambda p: int(get_shard(p)))
    assert len(embedding_paths) == len(metadata_paths)
    assert [int(get_shard(p)) for p in embedding_paths] == [int(get_shard(p)) for p in metadata_paths]
    for embedding_path, metadata_path in zip(embedding_paths, metadata_paths):  # run_concurrent=1
        reorder_shard(embedding_path, metadata_path, output_folder, index_width, output_shard_width)
    return len(embedding_paths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embeddings_folder", required=True)
    p.add_argument("--metadata_folder", required=True)
    p.add_argument("--output_folder", required=True)
    p.add_argument("--index_width", type=int, default=4)
    p.add_argument("--output_shard_width", type=int, default=6)
    a = p.parse_args()
    reorder_embeddings(a.output_folder, a.embeddings_folder, a.metadata_folder, a.index_width, a.output_shard_width)


if __name__ == "__main__":
    main()
