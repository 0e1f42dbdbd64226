"""The progress bar of `shardprep run`, moved as shards finish rather than as runs do: it follows the
state index's journal (``shardprep.state``), where each (asset, shard) step records its outcome the moment
it has one, so a run of a 100-shard block moves the bar a hundred times. While it follows, it folds
what it has read into the index's tables now and then, so a long run never leaves a huge journal."""

from __future__ import annotations

import time

from shardprep import state
from shardprep.artifacts import ARTIFACTS
from shardprep.layout import Layout
from shardprep.ledger import load_ledger

FOLD_SECONDS = 30.0


class ShardProgress:
    """Which shards of the plan still wait for an outcome of some asset, and the bar to move."""

    def __init__(self, plan, partitions: list[str], bar) -> None:
        self.layout, self.bar = Layout(plan.cfg.output_root), bar
        self.since, self.seen = time.time_ns(), set()
        self._folded = time.monotonic()
        ledger = load_ledger(self.layout)
        self.waiting: dict[str, set[str]] = {}  # shard -> assets without an outcome yet
        self.shards_of: dict[str, list[str]] = {}
        for p in partitions:
            names = {k.path[-1] for k in plan.assets_to_do(p)}
            self.shards_of[p] = ledger.partition_shards(p) if ledger else [p]
            for shard in self.shards_of[p]:
                media = ledger.media(shard) if ledger else "image"
                self.waiting[shard] = {n for n in names if ARTIFACTS[n].applies(media)}
        self.total = len(self.waiting)
        self.counted: set[str] = set()

    def poll(self, settled_partitions: set[str] = frozenset()) -> None:
        """Read what the journal gained; a partition Dagster reports settled (done, failed, or skipped
        after an upstream failure) counts all its shards."""
        entries, files = state.read_new(self.layout, self.seen, self.since)
        self.seen.update(files)
        for e in entries:
            if e["k"] in ("done", "failed") and e["s"] in self.waiting:
                self.waiting[e["s"]].discard(e["a"])
        for p in settled_partitions:
            for shard in self.shards_of.get(p, ()):
                self.waiting.get(shard, set()).clear()
        newly = [s for s, left in self.waiting.items() if not left and s not in self.counted]
        self.counted.update(newly)
        if newly:
            self.bar.update(len(newly))
        if self.seen and time.monotonic() - self._folded > FOLD_SECONDS:
            state.fold(self.layout, sorted(self.seen))  # only what was read: nothing is missed
            self.seen.clear()
            self._folded = time.monotonic()
