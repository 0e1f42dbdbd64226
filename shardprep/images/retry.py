"""`shardprep retry`'s core: download again only the failed rows of a finished image shard whose
failure may go away by itself (``shardprep.failures``), and merge the new successes into the shard.

The rows are fetched by ``write_image_shard`` itself, into a scratch folder, from the shard's rows with
every other row's URL left out (``None``: refused as an invalid URL without a request): the same
download, politeness, robots.txt, resize and sample-json code as a first run, and the keys stay the
rows' own (a key is its row's position in the shard). Only then is the shard rewritten: tar = old
successes + new ones in key order, parquet rows of the retried rows replaced, stats recounted with a
``retry_round``. The downstream per-shard artifacts of a shard that gained samples lose their stamps
(``on_invalidate`` also forgets their Dagster partitions: the CLI's side), and the image_shards stamp
is written again last (new file sizes; a crash before it leaves the shard to be made again by
`shardprep run`).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from shardprep.artifacts import ARTIFACTS, PER_SHARD
from shardprep.config import DatasetConfig
from shardprep.failures import TRANSIENT, TRANSIENT_STATUSES, classify
from shardprep.images.shards import input_columns, write_image_shard
from shardprep.layout import Layout
from shardprep.storage import atomic_write, exists, read_bytes, read_parquet, remove
from shardprep.takedown.lists import takedown_set
from shardprep.tars import TarWriter, iter_samples, sample_keys
from shardprep.verify import file_sizes
from shardprep.versions import artifact_versions, read_stamp, remove_stamp, write_stamp

ARTIFACT = "image_shards"
FAILED = ("failed_to_download", "failed_to_resize")
# reason classes a user may name (``--reasons``), besides "transient" (all of them) and a transient
# HTTP status such as 503; each selects among transient reasons only: a permanent one is never retried
CLASSES = ("timeout", "429", "5xx", "connection", "robots")
_STATUS = re.compile(r"HTTP(?: Error)? (\d{3})\b")  # "HTTP Error 503: ...", "rate limited (HTTP 429, ...)"
_CONNECTION = re.compile(r"^<urlopen error |^connection broken: ")


@dataclass
class RetryReport:
    shard: str
    retried: int = 0  # rows downloaded again
    recovered: int = 0  # of those, now successes
    still_failed: int = 0
    retry_round: int = 0  # retries that changed this shard so far (0: never)
    skipped: str | None = None  # why nothing was tried (not finished, outdated)
    invalidated: list[str] = field(default_factory=list)  # downstream artifacts that must be made again

    def summary(self) -> str:
        if self.skipped is not None:
            return f"shard {self.shard}: skipped, {self.skipped}"
        if not self.retried:
            return f"shard {self.shard}: no row to retry"
        return (f"shard {self.shard}: {self.retried} row(s) retried, {self.recovered} now successful, "
                f"{self.still_failed} still failed (retry round {self.retry_round})")


def parse_reasons(spec: str | None) -> set[str] | str:
    """``--reasons``: ``transient`` (default), or classes such as ``timeout,429,5xx,connection,robots``
    or transient HTTP statuses (``503``). Raises ValueError naming what is not one."""
    if spec is None or spec.strip() == TRANSIENT:
        return TRANSIENT
    classes = {p.strip().lower() for p in spec.split(",") if p.strip()}
    allowed = set(CLASSES) | {str(s) for s in TRANSIENT_STATUSES} | {TRANSIENT}
    bad = sorted(classes - allowed)
    if bad or not classes:
        raise ValueError(f"--reasons: not a transient reason class: {', '.join(bad) or repr(spec)} "
                         f"(write transient, or some of {', '.join(CLASSES)} or an HTTP status of "
                         f"{', '.join(map(str, sorted(TRANSIENT_STATUSES)))})")
    return TRANSIENT if TRANSIENT in classes else classes


def reason_matches(reason: str | None, reasons: set[str] | str) -> bool:
    """Whether a row failing for ``reason`` is retried under ``reasons``: transient, and of a class named."""
    if not reason or classify(reason) != TRANSIENT:
        return False
    if reasons == TRANSIENT:
        return True
    status = _STATUS.search(reason)
    code = int(status.group(1)) if status else None
    return ((code is not None and (str(code) in reasons or ("5xx" in reasons and 500 <= code < 600)))
            or ("timeout" in reasons and "timed out" in reason.lower())
            or ("robots" in reasons and reason.startswith("robots.txt"))
            or ("connection" in reasons and code is None and "timed out" not in reason.lower()
                and _CONNECTION.search(reason) is not None))


def downstream_shard_artifacts(artifact: str = ARTIFACT) -> list[str]:
    """The per-shard artifacts made from ``artifact``, directly or not, in dependency order."""
    found: set[str] = {artifact}
    for name in PER_SHARD:  # dependency order: a parent is met before its children
        if set(ARTIFACTS[name].parents) & found:
            found.add(name)
    return [n for n in PER_SHARD if n in found and n != artifact]


def retry_shard(layout: Layout, cfg: DatasetConfig, shard: str, reasons: set[str] | str = TRANSIENT,
                on_invalidate: Callable[[list[str], str], None] | None = None) -> RetryReport:
    """Retry shard ``shard``'s failed rows whose reason matches ``reasons`` (``reason_matches``) and merge
    the new successes in. ``on_invalidate(artifacts, shard)`` is called, before the shard is rewritten,
    with the downstream per-shard artifacts whose stamps were just removed (when it gained samples)."""
    report = RetryReport(shard)
    version = artifact_versions(cfg)[ARTIFACT]
    stamp = read_stamp(layout, ARTIFACT, shard)
    if stamp is None:
        report.skipped = "not finished (no image_shards stamp): `shardprep run` makes it"
        return report
    if stamp["version"] != version:
        report.skipped = "made with another config (outdated): `shardprep run` makes it again"
        return report
    parquet_url = layout.shard_parquet(shard)
    old = read_parquet(parquet_url)
    status, errors = old.column("status").to_pylist(), old.column("error_message").to_pylist()
    rows = [i for i, (s, e) in enumerate(zip(status, errors)) if s in FAILED and reason_matches(e, reasons)]
    stats = json.loads(read_bytes(layout.shard_stats(shard)))
    report.retry_round = int(stats.get("retry_round", 0))
    if not rows:
        return report  # nothing touched

    # the shard's input rows under their source names, every URL but the retried rows' left out
    chosen = set(rows)
    inputs = {src: old.column(out) for src, out in input_columns(cfg)}
    urls = old.column("url").to_pylist()
    inputs[cfg.url_col] = pa.array([u if i in chosen else None for i, u in enumerate(urls)],
                                   type=old.schema.field("url").type)
    with tempfile.TemporaryDirectory(prefix="shardprep-retry-") as scratch_root:
        scratch = Layout(scratch_root)
        # the output root's takedowns, not the scratch folder's: a listed row is never fetched again
        write_image_shard(pa.table(inputs), int(shard), cfg, scratch,
                          takedowns=takedown_set(layout, cfg.takedown_lists))
        fresh = read_parquet(scratch.shard_parquet(shard))
        new_status = fresh.column("status").to_pylist()
        report.retried = len(rows)
        report.recovered = sum(new_status[i] == "success" for i in rows)
        report.still_failed = report.retried - report.recovered
        report.retry_round += 1

        merged = _merge_rows(old, fresh, rows)
        gained = {old.column("key")[i].as_py() for i in rows if new_status[i] == "success"}
        held = set(sample_keys(layout.tar(shard))) & gained if gained and exists(layout.tar(shard)) else set()
        if held:  # the parquet said failed, the tar has it: a damaged shard, for `verify`, not merged into
            raise ValueError(f"shard {shard}: {layout.tar(shard)} already holds sample(s) {sorted(held)[:5]} "
                             "that its parquet marks as failed; run `shardprep verify`")
        if report.recovered:
            # before any file changes: nothing made from the old samples is claimed complete any more
            report.invalidated = downstream_shard_artifacts()
            for name in report.invalidated:
                remove_stamp(layout, name, shard)
            if on_invalidate is not None:
                on_invalidate(report.invalidated, shard)
        # not complete until the new stamp: a crash part way leaves the shard to `shardprep run`
        remove_stamp(layout, ARTIFACT, shard)
        remove(layout.shard_stats(shard))
        if report.recovered:
            _merge_tar(layout.tar(shard), scratch.tar(shard), shard)
        with atomic_write(parquet_url) as f:
            pq.write_table(merged, f)
    counts = Counter(merged.column("status").to_pylist())
    reasons_now = Counter(e if e is not None else "success" for e in merged.column("error_message").to_pylist())
    stats.update(count=merged.num_rows, successes=counts["success"],
                 failed_to_download=counts["failed_to_download"], failed_to_resize=counts["failed_to_resize"],
                 status_dict=dict(reasons_now), retry_round=report.retry_round, retried_at=time.time())
    with atomic_write(layout.shard_stats(shard)) as f:
        f.write(json.dumps(stats, indent=4).encode("utf-8"))
    write_stamp(layout, ARTIFACT, version, shard, file_sizes(layout.shard_outputs(ARTIFACT, shard)))
    return report


def _merge_rows(old: pa.Table, fresh: pa.Table, rows: list[int]) -> pa.Table:
    """``old`` with rows ``rows`` taken from ``fresh`` (the same rows, keys and schema)."""
    if fresh.column("key").to_pylist() != old.column("key").to_pylist():
        raise ValueError(f"retry: the re-downloaded rows' keys differ from {old.num_rows} rows of the shard's parquet")
    chosen = set(rows)
    cols = {}
    for name in old.column_names:
        before, after = old.column(name).to_pylist(), fresh.column(name).to_pylist()
        cols[name] = [after[i] if i in chosen else v for i, v in enumerate(before)]
    return pa.Table.from_pydict(cols, schema=old.schema)


def _merge_tar(url: str, new_url: str, shard: str) -> None:
    """Write the tar at ``url`` again: its samples and those of ``new_url``, in key order."""
    fresh = {s["__key__"]: s for s in iter_samples(new_url)}
    pending = sorted(fresh)
    with TarWriter(url) as tar:
        for sample in (iter_samples(url) if exists(url) else ()):
            key = sample["__key__"]
            if key in fresh:
                raise ValueError(f"shard {shard}: sample {key} is in {url} already and was downloaded again")
            while pending and pending[0] < key:
                tar.add(pending[0], _members(fresh[pending.pop(0)]))
            tar.add(key, _members(sample))
        for key in pending:
            tar.add(key, _members(fresh[key]))


def _members(sample: dict) -> dict[str, bytes]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}
