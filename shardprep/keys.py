"""Shard and sample keys, exactly as img2dataset computes them, and as webdataset reads them from tars."""

import math
import re

# webdataset's base_plus_ext, which energon shares: a tar member's sample key is its path up to the
# first dot of the basename, the rest is the field; a name without a dot belongs to no sample.
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# members webdataset skips as metadata (``__name__``)
_META_MEMBER = re.compile(r"__[^/]*__($|/)")


def split_member_name(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a tar member name, or None where webdataset would not read one."""
    m = _MEMBER_NAME.match(name)
    return (m.group(1), m.group(2)) if m else None


def is_meta_member(name: str) -> bool:
    return _META_MEMBER.match(name) is not None


def oom_sample_per_shard(samples_per_shard: int) -> int:
    """Digits of the in-shard index part of a key (img2dataset: ceil(log10(spp)))."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    return math.ceil(math.log10(samples_per_shard))


def compute_key(index: int, shard_id: int, oom_sample: int, oom_shard_count: int = 5) -> str:
    """img2dataset's ``compute_key``: ``str(10**oom_sample * shard_id + index)`` zero-padded."""
    return f"{(10**oom_sample) * shard_id + index:0{oom_sample + oom_shard_count}d}"


def shard_key(shard_id: int, oom_shard_count: int = 5) -> str:
    """Partition key and file stem of a shard: ``00012``."""
    return f"{shard_id:0{oom_shard_count}d}"


def partition_key(shard_id: int, shards_per_partition: int = 1, oom_shard_count: int = 5) -> str:
    """The Dagster partition a shard belongs to: the shard's own key when partitions are single shards,
    else its block of consecutive ids, ``00012300-00012399`` (sorts and reads well; fixed whether or not
    the block is full yet)."""
    if shards_per_partition == 1:
        return shard_key(shard_id, oom_shard_count)
    first = shard_id - shard_id % shards_per_partition
    return f"{shard_key(first, oom_shard_count)}-{shard_key(first + shards_per_partition - 1, oom_shard_count)}"


def partition_range(key: str) -> range:
    """The shard ids a partition key covers (``00012`` or ``00012300-00012399``)."""
    first, _, last = key.partition("-")
    if not first.isdigit() or not (last or first).isdigit():
        raise ValueError(f"not a shard partition key: {key!r}")
    return range(int(first), int(last or first) + 1)


def parse_shard_ids(spec: str) -> set[int]:
    """The shard ids of a selection such as ``12-40,55`` (ranges inclusive; keys or plain numbers)."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ValueError(f"not a shard selection: {part!r} (write e.g. 12-40,55)")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


def index_of_key(key: str, index_width: int) -> int:
    """Row of a sample inside its shard, as DALLE2's loader reads it (``int(key[-w:])``)."""
    return int(key[-index_width:]) if index_width > 0 else 0
