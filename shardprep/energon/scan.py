"""A tar's energon index rows from its headers (energon's ``_preprocess_tar``), and ``.tar.idx`` files."""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

from shardprep import storage
from shardprep.energon.format import EnergonIndexError
from shardprep.tars import MemberHeader, header_samples


@dataclass
class TarScan:
    name: str  # relative to the dataset folder
    size: int
    mtime: str
    offsets: array  # count + 1 values: each sample's first header, then the end offset
    keys: list[str]
    parts: list[tuple[int, str, int, int]]  # (sample_index, part_name, data offset, data size)


def scan_tar(dataset_dir: str, rel: str) -> TarScan:
    """Read one tar's headers into energon's index rows, as energon's ``_preprocess_tar`` does: same
    members, same key/part split, same offsets. Raises on a repeated key and on a tar without samples."""
    url = storage.join(dataset_dir, rel)
    try:
        size, mtime = storage.stat(url)
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: tar listed for indexing does not exist") from None
    samples, end = header_samples(url)
    offsets = array("Q")
    keys: list[str] = []
    parts: list[tuple[int, str, int, int]] = []
    for index, sample in enumerate(samples):
        key = sample["__key__"]
        members = [h for h in sample.values() if isinstance(h, MemberHeader)]
        offsets.append(members[0].offset)  # first header of the sample (incl. pax/GNU ones)
        keys.append(key)
        # energon's part name keeps its case (the sample dict's extension is lower-cased)
        parts.extend((index, h.name[len(key) + 1:], h.data_offset, h.size) for h in members)
    if not keys:
        raise EnergonIndexError(f"{url}: tar has no samples; energon prepare aborts on a 0-sample shard "
                                "(leave it out of the dataset)")
    offsets.append(end)
    return TarScan(rel, size, mtime, offsets, keys, parts)


def read_tar_idx(url: str) -> list[int]:
    """The offsets of a ``.tar.idx`` file (for checks and tools)."""
    data = storage.read_bytes(url)
    return list(struct.unpack(f"{len(data) // 8}Q", data))
