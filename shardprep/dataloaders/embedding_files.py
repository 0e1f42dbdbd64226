"""Finding and reading the per-shard embedding files next to webdataset tars.

DALLE2-pytorch's decoder loader pairs ``images/00001.tar`` with ``<folder>/<prefix>_00001.npy``.
It guesses the prefix and zero padding from the first ``*.npy`` it globs and parses *every*
entry of the folder as ``int(name.split("_")[-1].split(".")[0])``, so a README or a temp file
crashes it. Here the folder is listed once, only ``<prefix>_<int>.npy`` regular files count,
and anything else is ignored.
"""

import posixpath
import re

import fsspec
import numpy as np
import torch

# `<prefix>_<digits>.npy`, not hidden: atomic_write temps (`.img_emb_00001.npy.tmp-…`) never match
_EMBEDDING_FILE = re.compile(r"^(?!\.)(?P<prefix>.+)_(?P<shard>\d+)\.npy$")


def shard_id_of_url(url: str) -> int:
    """Shard id of a tar URL, as DALLE2 reads it: the basename before its first dot.

    Works for ``…/00001.tar``, ``file:///…/00001.tar`` and ``pipe:cmd s3://…/00001.tar -``.
    """
    stem = url.strip().split("/")[-1].split(".")[0]
    try:
        return int(stem)
    except ValueError:
        raise ValueError(
            f"tar URL {url!r}: the basename must start with an integer shard id (e.g. 00001.tar) "
            "to pair it with an embedding file"
        ) from None


def list_embedding_files(folder_url: str) -> dict[int, str]:
    """Map shard id -> fsspec URL of every ``*_<int>.npy`` file directly in ``folder_url``."""
    fs, path = fsspec.core.url_to_fs(folder_url)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"embedding folder {folder_url!r} does not exist") from None
    found: dict[int, str] = {}
    for entry in entries:
        if entry.get("type") != "file":
            continue
        name = posixpath.basename(entry["name"].rstrip("/"))
        match = _EMBEDDING_FILE.match(name)
        if match is None:
            continue
        shard = int(match["shard"])
        url = fs.unstrip_protocol(entry["name"])
        if shard in found:
            raise ValueError(
                f"embedding folder {folder_url!r}: two files for shard {shard}: "
                f"{found[shard]!r} and {url!r}"
            )
        found[shard] = url
    if not found:
        raise ValueError(f"embedding folder {folder_url!r} holds no <prefix>_<int>.npy file")
    return found


def load_embeddings(url: str) -> torch.Tensor:
    """The whole ``[rows, dim]`` array of one shard, dtype kept (float16 from shardprep)."""
    with fsspec.open(url, "rb") as f:
        data = np.load(f)
    if data.ndim != 2:
        raise ValueError(f"embedding file {url!r}: expected a 2-D [rows, dim] array, got shape {data.shape}")
    return torch.from_numpy(data)
