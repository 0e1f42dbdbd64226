"""The shard ledger: which rows of which source file make each shard, decided once and never changed.

Stored as ``<root>/ledger.json``. Shard ids continue across source files (as img2dataset's do), so
keys are unique in the whole dataset and a new source file only appends shards.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from dataclasses import dataclass, field

from shardprep.config import DatasetConfig
from shardprep.keys import shard_key
from shardprep.layout import Layout
from shardprep.sources import SourceError, SourceInfo, fingerprint, inspect_source, list_source_files
from shardprep.storage import exists, is_local, read_bytes, url_to_fs, write_bytes

LEDGER_VERSION = 1


class LedgerError(ValueError):
    """The ledger disagrees with the config (e.g. samples_per_shard changed)."""


@dataclass(frozen=True)
class Shard:
    shard_id: int
    key: str
    source: str
    row_start: int
    row_stop: int

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start


@dataclass
class Ledger:
    samples_per_shard: int
    oom_shard_count: int
    files: list[dict] = field(default_factory=list)

    @property
    def next_shard_id(self) -> int:
        return max((f["first_shard"] + f["num_shards"] for f in self.files), default=0)

    def shards(self) -> list[Shard]:
        out = []
        for f in self.files:
            for i in range(f["num_shards"]):
                start = i * self.samples_per_shard
                sid = f["first_shard"] + i
                out.append(Shard(sid, shard_key(sid, self.oom_shard_count), f["source"], start,
                                 min(start + self.samples_per_shard, f["rows"])))
        return out

    def shard(self, key: str) -> Shard:
        for s in self.shards():
            if s.key == key:
                return s
        raise LedgerError(f"shard {key!r} is not in the ledger (known: {len(self.shards())} shards)")

    def keys(self) -> list[str]:
        return [s.key for s in self.shards()]

    def to_json(self) -> bytes:
        return json.dumps({"version": LEDGER_VERSION, "samples_per_shard": self.samples_per_shard,
                           "oom_shard_count": self.oom_shard_count, "files": self.files}, indent=2).encode()


@dataclass(frozen=True)
class Registration:
    new_keys: list[str]
    all_keys: list[str]
    changed_sources: list[str]  # registered earlier, since rewritten: reported, not re-sharded
    empty_sources: list[str]


def load_ledger(layout: Layout) -> Ledger | None:
    if not exists(layout.ledger):
        return None
    raw = json.loads(read_bytes(layout.ledger))
    return Ledger(raw["samples_per_shard"], raw["oom_shard_count"], raw["files"])


@contextlib.contextmanager
def _lock(layout: Layout):
    """Serialise ledger updates between processes on one machine (sensor, CLI)."""
    if not is_local(layout.root):
        yield
        return
    fs, root = url_to_fs(layout.root)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".ledger.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def register_sources(cfg: DatasetConfig, source_files: list[str] | None = None) -> Registration:
    """Give shard ids to source files not yet in the ledger. All new files are checked first:
    if one is bad, the ledger is left as it was and the error names the file."""
    layout = Layout(cfg.output_root)
    files = list_source_files(cfg.source) if source_files is None else source_files
    with _lock(layout):
        ledger = load_ledger(layout) or Ledger(cfg.samples_per_shard, cfg.oom_shard_count)
        for name in ("samples_per_shard", "oom_shard_count"):
            if getattr(ledger, name) != getattr(cfg, name):
                raise LedgerError(
                    f"config field '{name}' is {getattr(cfg, name)} but the ledger at {layout.ledger} was "
                    f"made with {getattr(ledger, name)}; shard ids never change, use a new output_root"
                )
        known = {f["source"]: f for f in ledger.files}
        changed, fresh = [], []
        for url in files:
            if url in known:
                fs, path = url_to_fs(url)
                if fingerprint(fs.info(path)) != known[url]["fingerprint"]:
                    changed.append(url)
                continue
            fresh.append(url)
        infos: list[SourceInfo] = [inspect_source(u, cfg) for u in fresh]  # raises before any write
        next_id, new_keys, empty = ledger.next_shard_id, [], []
        for info in infos:
            n = math.ceil(info.rows / cfg.samples_per_shard)
            if n == 0:
                empty.append(info.url)
            ledger.files.append({"source": info.url, "fingerprint": info.fingerprint, "rows": info.rows,
                                 "first_shard": next_id, "num_shards": n, "columns": list(info.columns)})
            new_keys += [shard_key(next_id + i, cfg.oom_shard_count) for i in range(n)]
            next_id += n
        if infos or load_ledger(layout) is None:
            write_bytes(layout.ledger, ledger.to_json())
    return Registration(new_keys, ledger.keys(), changed, empty)


__all__ = ["Ledger", "LedgerError", "Registration", "Shard", "SourceError", "load_ledger", "register_sources"]
