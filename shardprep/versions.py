"""What each artifact's content depends on, as a version string, and the stamps that say which version a
finished output was made with.

An artifact's version is a hash of the config fields that change what it holds, a revision number of
the code that writes it, and the versions of the artifacts it is made from. Changing
``image_size`` thus makes ``image_shards`` and everything made from the images stale, while a
changed ``thread_count`` or ``batch_size`` (how fast, not what) makes nothing stale. The Dagster side
records the version as each asset's code version; a stamp file written after a shard's outputs
(``<root>/.shardprep/stamps/{artifact}/{shard}.json``) lets a run skip outputs that are complete and
current, even when the Dagster instance that recorded them is gone.
"""

from __future__ import annotations

import hashlib
import json
import time

from shardprep import state
from shardprep.artifacts import ARTIFACTS, enabled
from shardprep.config import DatasetConfig
from shardprep.layout import Layout
from shardprep.storage import exists, read_text, remove, write_bytes

ALL_SHARDS = "_all"  # the stamp "shard" of an unpartitioned artifact


def artifact_versions(cfg: DatasetConfig) -> dict[str, str]:
    """``{artifact: version}``: 16 hex digits each, stable across processes and releases."""
    values = cfg.to_dict()
    versions: dict[str, str] = {}

    def version(name: str) -> str:
        if name not in versions:
            record = ARTIFACTS[name]
            # a parent the config turns off (training_text without synthetic captions) is not read
            parents = tuple(p for p in record.version_parents if enabled(p, cfg) and (
                p not in record.reads_only_when
                or any(values[f] not in (None, False) for f in record.reads_only_when[p])))
            doc = {"code": record.revision, "fields": {f: values[f] for f in record.fields},
                   "from": {p: version(p) for p in parents}}
            digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode("utf-8")).hexdigest()
            versions[name] = digest[:16]
        return versions[name]

    for name in ARTIFACTS:
        version(name)
    return versions


def write_stamp(layout: Layout, artifact: str, version: str, shard: str = ALL_SHARDS,
                outputs: dict[str, int] | None = None) -> None:
    """Record that ``artifact``'s outputs of ``shard`` are complete at ``version`` (write it last);
    ``outputs``: ``{url: size}`` of the files written, for ``verify``."""
    before = read_stamp(layout, artifact, shard)
    if before is not None and before["version"] != version:
        # a stamp replaced at another version: if this process dies between the stamp and the journal,
        # the index must not keep claiming the old version (see state)
        state.record_removed(layout, artifact, shard)
    doc = {"artifact": artifact, "shard": shard, "version": version, "written_at": time.time(),
           "outputs": outputs or {}}
    write_bytes(layout.stamp(artifact, shard), json.dumps(doc).encode("utf-8"))
    state.record_done(layout, artifact, shard, version, doc["outputs"], doc["written_at"])  # after: see state


def read_stamp(layout: Layout, artifact: str, shard: str = ALL_SHARDS) -> dict | None:
    """The stamp of ``shard``'s outputs of ``artifact`` (``version``, ``outputs``), or None (none, or
    unreadable: then the outputs are not trusted)."""
    text = read_text(layout.stamp(artifact, shard))
    try:
        doc = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("version"), str) else None


def current_stamps(layout: Layout, artifact: str, version: str) -> dict[str, dict | None]:
    """``{shard: stamp}`` for every shard of the ledger ``artifact`` applies to (its media), in ledger
    order: the stamp when the shard's outputs are complete at ``version``, else None."""
    from shardprep.ledger import load_ledger

    ledger = load_ledger(layout)
    record = ARTIFACTS[artifact]
    out: dict[str, dict | None] = {}
    for shard in ledger.keys() if ledger else []:
        if record.applies(ledger.media(shard)):
            stamp = read_stamp(layout, artifact, shard)
            out[shard] = stamp if stamp and stamp["version"] == version else None
    return out


def stamped_version(layout: Layout, artifact: str, shard: str = ALL_SHARDS) -> str | None:
    """The version ``shard``'s outputs of ``artifact`` were completed at, or None."""
    doc = read_stamp(layout, artifact, shard)
    return doc["version"] if doc else None


def restamp_sizes(layout: Layout, artifact: str, shard: str, sizes: dict[str, int]) -> None:
    """Record new sizes of files of ``artifact`` that another artifact rewrote in place (image_scores
    joins its columns into clip_embeddings' metadata parquet), so ``verify`` does not take them for
    damaged; the version and completeness stay as they were. No stamp: nothing to update."""
    doc = read_stamp(layout, artifact, shard)
    if doc is None:
        return
    doc["outputs"] = {**doc.get("outputs", {}), **{u: s for u, s in sizes.items() if u in doc.get("outputs", {})}}
    write_bytes(layout.stamp(artifact, shard), json.dumps(doc).encode("utf-8"))
    state.record_done(layout, artifact, shard, doc["version"], doc["outputs"], doc.get("written_at") or 0.0)


def remove_stamp(layout: Layout, artifact: str, shard: str = ALL_SHARDS) -> bool:
    """Forget that the outputs are complete (they will be made again); True if there was a stamp."""
    if not exists(layout.stamp(artifact, shard)):
        return False
    state.record_removed(layout, artifact, shard)  # before: the index never claims more than the stamps
    return remove(layout.stamp(artifact, shard))
