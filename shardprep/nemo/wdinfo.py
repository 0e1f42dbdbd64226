"""NeMo ``generate_wdinfo``: the ``wdinfo.pkl`` that NeMo's ``WebDatasetCommon`` reads.

A pickle (default protocol) of exactly
``{"tar_files": [sorted paths relative to tar_dir], "chunk_size": int, "total_key_count": int}``
with ``total_key_count = len(tar_files) * chunk_size``. Only complete tars are listed: size > 0 and
no ``{tar}.INCOMPLETE`` sidecar. Unlike NeMo's script (top level only), tars in subfolders are
listed too (``task0000/00000.tar``). NeMo's sampler assumes every listed tar holds exactly
``chunk_size`` samples, so each one is checked and a mismatch raises, naming the tar.
"""

from __future__ import annotations

import pickle

from shardprep import storage
from shardprep.errors import ShardprepError
from shardprep.nemo.balanced import complete_tar_counts
from shardprep.tars import INCOMPLETE_SUFFIX, header_samples, list_tars


class WdinfoError(ShardprepError, ValueError):
    """A wdinfo.pkl cannot be written as asked (a listed tar does not hold ``chunk_size`` samples)."""


def _count_from_tar_idx(tar_url: str) -> int | None:
    # energon's .tar.idx has count + 1 offsets; trusted only if not older than the tar itself (on any
    # filesystem: a shard's tar rewritten on S3 leaves its old .tar.idx until the index is updated)
    idx = tar_url + ".idx"
    if not storage.exists(idx):
        return None
    size, _ = storage.stat(idx)
    tar_time, idx_time = storage.modified(tar_url), storage.modified(idx)
    if tar_time is not None and (idx_time is None or idx_time < tar_time):
        return None
    if size < 8 or size % 8:
        return None
    return size // 8 - 1


def count_tar_samples(url: str) -> int:
    """Samples in a tar as webdataset groups them (consecutive members sharing a key), from its
    headers only."""
    return len(header_samples(url)[0])


def write_wdinfo(tar_dir: str, out_url: str, chunk_size: int) -> dict:
    """Write ``out_url`` (pickle) listing the complete tars under ``tar_dir``; returns the dict."""
    if chunk_size < 1:
        raise WdinfoError(f"chunk_size must be >= 1, got {chunk_size}")
    fs, root = storage.url_to_fs(tar_dir)
    if not fs.isdir(root.rstrip("/")):
        raise FileNotFoundError(f"{tar_dir}: not a folder")
    tar_files = list_tars(tar_dir, skip_empty=True)
    from_state = complete_tar_counts(tar_dir)  # cheapest source; then .tar.idx; then the tar itself
    for rel in tar_files:
        url = storage.join(tar_dir, rel)
        count = from_state.get(rel)
        if count is None:
            count = _count_from_tar_idx(url)
        if count is None:
            count = count_tar_samples(url)
        if count != chunk_size:
            raise WdinfoError(f"{tar_dir.rstrip('/')}/{rel}: holds {count} samples, but wdinfo chunk_size is "
                              f"{chunk_size}; NeMo assumes every listed tar holds exactly chunk_size samples "
                              f"(mark a short tar with a '{INCOMPLETE_SUFFIX}' sidecar to leave it out)")
    info = {"tar_files": tar_files, "chunk_size": int(chunk_size),
            "total_key_count": len(tar_files) * int(chunk_size)}
    storage.write_bytes(out_url, pickle.dumps(info))
    return info
