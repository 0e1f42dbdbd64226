"""NeMo ``generate_wdinfo``: the ``wdinfo.pkl`` that NeMo's ``WebDatasetCommon`` reads.

A pickle (default protocol) of exactly
``{"tar_files": [sorted paths relative to tar_dir], "chunk_size": int, "total_key_count": int}``
with ``total_key_count = len(tar_files) * chunk_size``. Only complete tars are listed: size > 0 and
no ``{tar}.INCOMPLETE`` sidecar. Unlike NeMo's script (top level only), tars in subfolders are
listed too (``task0000/00000.tar``). NeMo's sampler assumes every listed tar holds exactly
``chunk_size`` samples, so each one is checked and a mismatch raises, naming the tar.
"""

from __future__ import annotations

import os
import pickle
import posixpath
import tarfile

from shardprep.balanced import INCOMPLETE_SUFFIX, complete_tar_counts
from shardprep.keys import split_member_name
from shardprep.storage import atomic_write, is_local, url_to_fs



def list_complete_tars(tar_dir: str) -> list[str]:
    """Sorted paths (relative to ``tar_dir``) of the non-empty tars without an ``.INCOMPLETE`` sidecar.

    Hidden files and folders (``.nv-meta``, temp files of atomic writes) are skipped.
    """
    fs, root = url_to_fs(tar_dir)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"{tar_dir}: not a folder")
    found = fs.find(root, detail=True)
    names = {posixpath.relpath(p, root): info for p, info in found.items()}
    out = []
    for rel, info in names.items():
        if not rel.endswith(".tar") or any(part.startswith(".") for part in rel.split("/")):
            continue
        if rel + INCOMPLETE_SUFFIX in names or not info.get("size"):
            continue
        out.append(rel)
    return sorted(out)


def _count_from_tar_idx(fs, tar_path: str) -> int | None:
    # energon's .tar.idx has count + 1 offsets; trusted only if not older than the tar itself
    idx = tar_path + ".idx"
    if not fs.exists(idx):
        return None
    if is_local(tar_path) and os.stat(idx).st_mtime_ns < os.stat(tar_path).st_mtime_ns:
        return None
    size = fs.size(idx)
    if size < 8 or size % 8:
        return None
    return size // 8 - 1


def count_tar_samples(url: str) -> int:
    """Samples in a tar as webdataset groups them: consecutive members sharing a key."""
    fs, path = url_to_fs(url)
    n = 0
    last = None
    with fs.open(path, "rb") as f:
        try:
            with tarfile.open(fileobj=f, mode="r:*") as tar:
                for m in tar:  # headers only: payloads are skipped by seeking
                    if not m.isreg():
                        continue
                    split = split_member_name(m.name)
                    if split is None:
                        continue
                    if split[0] != last:
                        n += 1
                        last = split[0]
        except tarfile.TarError as e:
            raise ValueError(f"{url}: not a readable tar ({e})") from e
    return n


def write_wdinfo(tar_dir: str, out_url: str, chunk_size: int) -> dict:
    """Write ``out_url`` (pickle) listing the complete tars under ``tar_dir``; returns the dict."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tar_files = list_complete_tars(tar_dir)
    fs, root = url_to_fs(tar_dir)
    root = root.rstrip("/")
    from_state = complete_tar_counts(tar_dir)  # cheapest source; then .tar.idx; then the tar itself
    for rel in tar_files:
        path = f"{root}/{rel}"
        count = from_state.get(rel)
        if count is None:
            count = _count_from_tar_idx(fs, path)
        if count is None:
            count = count_tar_samples(f"{tar_dir.rstrip('/')}/{rel}")
        if count != chunk_size:
            raise ValueError(f"{tar_dir.rstrip('/')}/{rel}: holds {count} samples, but wdinfo chunk_size is "
                             f"{chunk_size}; NeMo assumes every listed tar holds exactly chunk_size samples "
                             f"(mark a short tar with a '{INCOMPLETE_SUFFIX}' sidecar to leave it out)")
    info = {"tar_files": tar_files, "chunk_size": int(chunk_size),
            "total_key_count": len(tar_files) * int(chunk_size)}
    with atomic_write(out_url) as f:
        pickle.dump(info, f)
    return info
