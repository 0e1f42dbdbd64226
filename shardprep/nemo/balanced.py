"""NeMo ``reorganize_tar``, incremental: the image shards' samples re-chunked into tars of exactly
``chunk_size`` samples, kept in step with the shards when their samples change.

Input: the img2dataset-layout shards ``layout.tar(shard)`` (a shard without a tar had no successes and
adds nothing), each with an *identity* (``source_identities``: when its samples were written, and its
selection), and optionally the keys a curation selection keeps. Output under ``layout.balanced_dir``:

* ``{i:05d}.tar``: exactly ``chunk_size`` samples each; new shards fill them in (shard, key) order;
  members keep their names (``{key}.jpg``, ``{key}.json``, ``{key}.txt``).
* the last tar may be partial: it carries an empty sidecar ``{tar}.INCOMPLETE`` (as NeMo's
  reorganize_tar writes) so that wdinfo and energon indexes leave it out, until later shards fill
  it. ``final=True`` drops the sidecar so the short tar can be indexed; it is still the partial tar
  and is filled if more shards arrive later.
* ``.manifest/{i:05d}.json``: the tar's samples in order, ``[key, shard, content hash]`` each (the
  hash covers every member's name and bytes), and the tar's digest (over its keys and hashes).
* ``state.json`` (written last): the chunk size, each consumed shard's identity and the tars holding
  its samples, each tar's sample count and digest (what ``precached_encodings`` and ``verify`` compare).

A consumed shard whose identity changed (its samples were made again: ``shardprep reshard``, a
takedown) is compared sample by sample: a changed sample is replaced where it is, a sample gone leaves
a hole that the dataset's last sample fills (so every complete tar keeps exactly ``chunk_size``; the
partial tar shrinks, or the last complete tar becomes the partial one), a new sample is appended. Only
tars whose samples changed are rewritten. A consumed shard that is not ready any more (its outputs
were invalidated and not made again yet) loses its samples until it is: a replaced sample never stays.

Crash safety: ``.pending`` is written before the first tar changes and removed after ``state.json``;
an update that finds it (a crash in between) rebuilds every tar from the shards. Tar bytes are
deterministic (``TarWriter(deterministic=True)``: webdataset 0.2's headers with ``mtime = 0``), so a
rebuild gives the same bytes for the same samples, and ``precached_encodings`` re-encodes only tars
whose digest changed. Members are written as ``{key}.{ext}`` sorted by extension.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from shardprep import storage
from shardprep.errors import ShardprepError
from shardprep.layout import Layout
from shardprep.tars import INCOMPLETE_SUFFIX, TarWriter, header_samples, numbered_tars, read_payloads
from shardprep.training_text import train_text

STATE_NAME = "state.json"
STATE_VERSION = 2
PENDING_NAME = ".pending"
MANIFEST_DIR = ".manifest"


class BalancedError(ShardprepError, ValueError):
    """The balanced tars cannot be updated as asked (state and chunk size disagree, an input changed
    while it was read)."""


class Entry(NamedTuple):
    key: str
    shard: str
    hash: str | None  # None until written: a sample of a shard consumed in this update


@dataclass
class BalancedReport:
    chunk_size: int
    complete_tars: list[str]  # every complete tar, in order (what wdinfo/indexes may list)
    new_complete_tars: list[str]  # tars complete now that were not before, or whose samples changed
    partial_tar: str | None  # the last, short tar (None when the samples divide evenly)
    partial_count: int
    partial_marked_incomplete: bool  # False with final=True
    rewritten_tars: list[str]  # tars that existed before and were written again
    removed_tars: list[str]  # tars past the new end (samples went)
    new_shards: list[str]  # shards consumed by this call
    changed_shards: list[str]  # consumed before, samples compared again (identity changed or not ready)
    shards_without_tar: list[str]  # among new_shards: no tar (0 successes)
    samples_added: int
    samples_replaced: int
    samples_removed: int
    total_samples: int
    changed: bool
    rebuilt: str | None = None  # why every tar was written again (None: an incremental update)


# ---------------------------------------------------------------- state


def state_url(layout: Layout) -> str:
    return f"{layout.balanced_dir}/{STATE_NAME}"


def manifest_url(layout: Layout, index: int) -> str:
    return f"{layout.balanced_dir}/{MANIFEST_DIR}/{index:05d}.json"


def incomplete_marker(tar_url: str) -> str:
    return tar_url + INCOMPLETE_SUFFIX


def _load_state_at(url: str) -> dict | None:
    text = storage.read_text(url)
    return json.loads(text) if text is not None else None


def load_state(layout: Layout) -> dict | None:
    """The raw ``state.json`` of ``layout``'s balanced tars (any version), or None before the first update."""
    return _load_state_at(state_url(layout))


def tar_digests(layout: Layout) -> dict[int, str]:
    """``{tar index: digest}`` of the complete balanced tars (what precached encodings are made from)."""
    raw = load_state(layout)
    if not raw or raw.get("version") != STATE_VERSION:
        return {}
    chunk = raw["chunk_size"]
    return {i: t["digest"] for i, t in enumerate(raw["tars"]) if t["count"] == chunk}


def complete_tar_counts(balanced_dir: str) -> dict[str, int]:
    """``{tar name: sample count}`` of the tars a balanced folder's state records as complete
    (empty when the folder has no state of this version), so wdinfo need not read them."""
    raw = _load_state_at(f"{balanced_dir.rstrip('/')}/{STATE_NAME}")
    if not raw or raw.get("version") != STATE_VERSION:
        return {}
    chunk = raw["chunk_size"]
    return {posixpath.basename(Layout(".").balanced_tar(i)): t["count"]
            for i, t in enumerate(raw["tars"]) if t["count"] == chunk}


def source_identities(layout: Layout, versions: dict[str, str], selecting: bool,
                      training_text: bool = False) -> dict[str, str | None]:
    """``{image shard: identity of the samples the balanced tars take from it}`` in ledger order; None
    while a shard is not ready (its image outputs are not complete at the current version, or a
    selection is in force and has not selected the shard yet, or with ``training_text`` (synthetic
    captions take part) its training text is not written yet). The identity changes whenever the shard's
    samples are written again, its selection is redone or its training text is chosen again."""
    from shardprep.versions import current_stamps

    texts = current_stamps(layout, "training_text", versions["training_text"]) if training_text else {}

    selection = {}
    if selecting:
        text = storage.read_text(layout.selection_state)
        selection = json.loads(text).get("shards", {}) if text else {}
    out: dict[str, str | None] = {}
    for shard, stamp in current_stamps(layout, "image_shards", versions["image_shards"]).items():
        if stamp is None:
            out[shard] = None
            continue
        ident = f"images@{stamp.get('written_at')}"
        if selecting and stamp.get("outputs", {}).get(layout.tar(shard)):  # a shard without a tar needs none
            chosen = selection.get(shard)
            ident = f"{ident};selection@{chosen['inputs']}" if chosen else None
        if training_text and ident is not None:
            text = texts.get(shard)
            ident = f"{ident};text@{text.get('written_at')}" if text else None
        out[shard] = ident
    return out


def sample_hash(members: dict[str, bytes]) -> str:
    """Content hash of one sample: every member's extension and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for ext in sorted(members):
        data = members[ext]
        h.update(f"{ext}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _tar_digest(entries: list[Entry]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for e in entries:
        h.update(f"{e.key}\0{e.hash}\n".encode())
    return h.hexdigest()


def _members(sample: dict) -> dict[str, bytes]:
    return {ext: data for ext, data in sample.items() if not ext.startswith("__")}


def _sample_sort_key(key: str) -> tuple[int, str]:
    # img2dataset keys are zero-padded digits of one width; length first keeps odd widths numeric
    return (len(key), key)


class _Samples:
    """Samples of tars read by key, each tar's headers read once per update; with ``training_text`` each
    sample's ``.txt`` is the caption it trains with (``shardprep.training_text``)."""

    def __init__(self, training_text: bool = False) -> None:
        self._headers: dict[str, dict[str, dict]] = {}
        self.training_text = training_text

    def headers(self, url: str) -> dict[str, dict]:
        """``{key: {ext: MemberHeader}}`` of the tar at ``url`` in tar order ({} when it is missing)."""
        if url not in self._headers:
            samples = header_samples(url)[0] if storage.exists(url) else []
            self._headers[url] = {s["__key__"]: s for s in samples}
        return self._headers[url]

    def read(self, url: str, keys: list[str]) -> dict[str, dict[str, bytes]]:
        """``{key: members}`` of ``keys`` from the tar at ``url``; BalancedError if one is missing."""
        headers = self.headers(url)
        missing = [k for k in keys if k not in headers]
        if missing:
            raise BalancedError(f"{url}: samples {missing[:3]} are not there any more")
        samples = read_payloads(url, [headers[k] for k in keys])
        if self.training_text:
            for members in samples.values():
                _train_txt(members)
        return samples


def _train_txt(members: dict[str, bytes]) -> None:
    """The sample's ``.txt`` replaced by the caption its json says it trains with (none: kept)."""
    try:
        meta = json.loads(members["json"]) if "json" in members else {}
    except ValueError:
        return  # not ours to judge: the sample goes in as it is
    original = members["txt"].decode("utf-8", errors="replace") if "txt" in members else None
    text = train_text(meta if isinstance(meta, dict) else {}, original, True)
    if text is not None:
        members["txt"] = text.encode("utf-8")


# ---------------------------------------------------------------- the update


@dataclass
class _Plan:
    """The balanced tars after the update, and where each new sample comes from."""

    chunk: int
    complete: list[list[Entry] | None]  # None: unchanged and not read (a complete tar no sample of which changed)
    tail: list[Entry]  # the samples after the complete tars (the partial tar's, then new ones)
    old: dict[int, list[Entry]] = field(default_factory=dict)  # old manifests read, by tar index
    old_counts: list[int] = field(default_factory=list)
    fresh_from: dict[str, str] = field(default_factory=dict)  # key -> url of the shard tar it is read from
    replaced: int = 0
    removed: int = 0
    added: int = 0


def update_balanced_shards(layout: Layout, sources: dict[str, str | None] | list[str], chunk_size: int = 1000,
                           final: bool = False,
                           selected: Callable[[str], set[str] | None] | None = None,
                           training_text: bool = False) -> BalancedReport:
    """Bring the balanced tars in step with ``sources``: ``{shard: identity}`` in the order new shards are
    consumed (a list: every identity the same), None for a shard not ready (not consumed yet, or its
    samples withdrawn until it is). ``selected(shard)``: the keys of the shard to use, None for all.
    ``training_text``: each sample's ``.txt`` is its json's ``train_caption`` (synthetic captions take part)."""
    if chunk_size < 1:
        raise BalancedError(f"chunk_size must be >= 1, got {chunk_size}")
    sources = dict.fromkeys(sources, "") if isinstance(sources, list) else dict(sources)
    raw = load_state(layout)
    rebuilt = None
    if raw is not None and raw.get("version") == STATE_VERSION and raw["chunk_size"] != chunk_size:
        raise BalancedError(f"{state_url(layout)}: balanced tars were built with chunk_size={raw['chunk_size']}, "
                            f"not {chunk_size}; delete the balanced folder to re-chunk")
    if storage.exists(f"{layout.balanced_dir}/{PENDING_NAME}"):
        raw, rebuilt = None, "an earlier update was interrupted"
    elif raw is not None and raw.get("version") != STATE_VERSION:
        raw, rebuilt = None, f"state version {raw.get('version')} (now {STATE_VERSION})"
    try:
        return _update(layout, raw, sources, chunk_size, final, selected, _Samples(training_text), rebuilt)
    except (ShardprepError, ValueError, KeyError, FileNotFoundError) as e:
        if raw is None:
            raise
        # the tars disagree with the state (changed behind its back): every tar is written again
        return _update(layout, None, sources, chunk_size, final, selected, _Samples(training_text),
                       f"{type(e).__name__}: {e}")


def _update(layout: Layout, raw: dict | None, sources: dict[str, str | None], chunk: int, final: bool,
            selected, reader: _Samples, rebuilt: str | None) -> BalancedReport:
    consumed: dict[str, dict] = dict(raw["shards"]) if raw else {}
    old_tars: list[dict] = list(raw["tars"]) if raw else []
    old_final = bool(raw.get("final")) if raw else False

    def current(shard: str) -> list[str]:
        """The keys of ``shard`` the balanced tars should hold now, in key order."""
        keys = list(reader.headers(layout.tar(shard)))
        keep = selected(shard) if selected is not None else None
        return sorted((k for k in keys if keep is None or k in keep), key=_sample_sort_key)

    n_complete = sum(1 for t in old_tars if t["count"] == chunk)
    plan = _Plan(chunk, [None] * n_complete, [], old_counts=[t["count"] for t in old_tars])
    if len(old_tars) > n_complete:  # the partial tar: its samples start the tail
        plan.tail = list(_manifest(layout, plan, n_complete))
    changed = [s for s, entry in consumed.items() if sources.get(s) != entry["source"]]
    for shard in changed:
        _diff_shard(layout, plan, shard, consumed[shard], current(shard) if sources.get(shard) is not None else [],
                    reader)
    new = [s for s, ident in sources.items() if ident is not None and s not in consumed]
    without_tar = []
    for shard in new:
        keys = current(shard)
        if not keys:
            without_tar += [] if storage.exists(layout.tar(shard)) else [shard]
        plan.tail += [Entry(k, shard, None) for k in keys]
        plan.fresh_from.update(dict.fromkeys(keys, layout.tar(shard)))
        plan.added += len(keys)
    _compact(layout, plan)
    tars = plan.complete + ([plan.tail] if plan.tail else [])
    dirty = [i for i, entries in enumerate(tars)
             if entries is not None and (i not in plan.old or [(e.key, e.hash) for e in entries]
                                         != [(e.key, e.hash) for e in plan.old[i]])]
    if raw is None:
        dirty = list(range(len(tars)))  # nothing on disk is trusted
    for shard in changed + new:
        if sources.get(shard) is None:
            consumed.pop(shard)  # withdrawn until it is ready again
        else:
            consumed[shard] = {"source": sources[shard], "tars": consumed.get(shard, {}).get("tars", [])}
    if raw is not None and not dirty and not changed and not new and len(tars) == len(old_tars) \
            and final == old_final:
        return _report(layout, chunk, old_tars, final, [], [], [], [], [], [], plan, changed=False)

    pending = f"{layout.balanced_dir}/{PENDING_NAME}"
    storage.write_bytes(pending, json.dumps({"reason": "update in progress"}).encode())
    written: dict[int, list[Entry]] = {}
    old_home = {e.key: i for i, old in plan.old.items() for e in old}  # the old tar of every sample read
    for i in dirty:  # in index order: a tar's samples come from itself, later tars or shard tars
        is_partial = i == len(tars) - 1 and len(tars[i]) < chunk
        written[i] = _write_tar(layout, plan, i, tars[i], old_home, is_partial=is_partial, final=final, reader=reader)
    on_disk = len(old_tars) if raw is not None else max(numbered_tars(layout.balanced_dir), default=-1) + 1
    removed_tars = _remove_past_end(layout, len(tars), on_disk)
    if tars and tars[-1] is not None and len(tars[-1]) < chunk and len(tars) - 1 not in written:
        _set_marker(layout.balanced_tar(len(tars) - 1), incomplete=not final)
    new_state_tars = []
    for i in range(len(tars)):
        if i in written:
            new_state_tars.append({"count": len(written[i]), "digest": _tar_digest(written[i])})
        else:
            new_state_tars.append(old_tars[i])
    # which tars hold each shard's samples: from every manifest that changed, the rest as they were
    holders: dict[str, set[int]] = {s: set(e.get("tars", [])) for s, e in consumed.items()}
    for i in set(written) | set(range(len(tars), len(old_tars))):
        for entry in plan.old.get(i, []):
            holders.get(entry.shard, set()).discard(i)
    for i, entries in written.items():
        for entry in entries:
            holders.setdefault(entry.shard, set()).add(i)
    for shard, entry in consumed.items():
        entry["tars"] = sorted(holders.get(shard, set()))
    storage.write_bytes(state_url(layout), json.dumps({
        "version": STATE_VERSION, "chunk_size": chunk, "final": final, "shards": consumed,
        "tars": new_state_tars}, indent=0).encode("utf-8"))
    storage.remove(pending)
    rewritten = [layout.balanced_tar(i) for i in written if i < len(old_tars)]
    became_complete = [layout.balanced_tar(i) for i in written if len(written[i]) == chunk]
    return _report(layout, chunk, new_state_tars, final, became_complete, rewritten, removed_tars, new,
                   changed, without_tar, plan, changed=True, rebuilt=rebuilt)


def _manifest(layout: Layout, plan: _Plan, index: int) -> list[Entry]:
    """Tar ``index``'s samples as its manifest records them (read once)."""
    if index not in plan.old:
        text = storage.read_text(manifest_url(layout, index))
        if text is None:
            raise BalancedError(f"{manifest_url(layout, index)}: missing")
        doc = json.loads(text)
        entries = [Entry(*e) for e in doc["samples"]]
        if len(entries) != plan.old_counts[index] or doc.get("digest") != _tar_digest(entries):
            raise BalancedError(f"{manifest_url(layout, index)}: does not match {STATE_NAME}")
        plan.old[index] = entries
    return plan.old[index]


def _diff_shard(layout: Layout, plan: _Plan, shard: str, consumed: dict, keys: list[str], reader: _Samples) -> None:
    """Replace, remove and append ``shard``'s samples so the plan holds exactly ``keys`` as they are now."""
    wanted = set(keys)
    url = layout.tar(shard)
    now = {k: sample_hash(m) for k, m in reader.read(url, keys).items()} if keys else {}
    placed: set[str] = set()
    holding = [_load_complete(layout, plan, i) for i in consumed.get("tars", []) if i < len(plan.complete)]
    for entries in [*holding, plan.tail]:
        for pos in range(len(entries) - 1, -1, -1):
            e = entries[pos]
            if e.shard != shard:
                continue
            if e.key not in wanted:
                del entries[pos]
                plan.removed += 1
            else:
                placed.add(e.key)
                if e.hash != now[e.key]:
                    entries[pos] = Entry(e.key, shard, now[e.key])
                    plan.fresh_from[e.key] = url
                    plan.replaced += 1
    for key in keys:
        if key not in placed:
            plan.tail.append(Entry(key, shard, now[key]))
            plan.fresh_from[key] = url
            plan.added += 1


def _load_complete(layout: Layout, plan: _Plan, index: int) -> list[Entry]:
    if plan.complete[index] is None:
        plan.complete[index] = list(_manifest(layout, plan, index))
    return plan.complete[index]


def _compact(layout: Layout, plan: _Plan) -> None:
    """Fill the holes of complete tars with the dataset's last samples, then cut the tail into tars."""
    i = 0
    while i < len(plan.complete):
        entries = plan.complete[i]
        while entries is not None and len(entries) < plan.chunk:
            if not plan.tail:
                if i == len(plan.complete) - 1:
                    break
                plan.tail = _load_complete(layout, plan, len(plan.complete) - 1)
                plan.complete.pop()  # the last complete tar dissolves into the tail
                continue
            entries.append(plan.tail.pop())
        if entries is not None and len(entries) < plan.chunk:  # the last complete tar: it is the tail now
            plan.tail = plan.complete.pop() + plan.tail
            break
        i += 1
    while len(plan.tail) >= plan.chunk:
        plan.complete.append(plan.tail[:plan.chunk])
        plan.tail = plan.tail[plan.chunk:]


def _write_tar(layout: Layout, plan: _Plan, index: int, entries: list[Entry], old_home: dict[str, int], *,
               is_partial: bool, final: bool, reader: _Samples) -> list[Entry]:
    """Write tar ``index`` with ``entries`` (samples read from the old tars or the shard tars, checked
    against their recorded hashes), then its manifest; returns the entries with every hash filled."""
    by_url: dict[str, list[str]] = {}
    for e in entries:
        url = plan.fresh_from.get(e.key) or layout.balanced_tar(old_home[e.key])
        by_url.setdefault(url, []).append(e.key)
    members: dict[str, dict[str, bytes]] = {}
    for url, keys in by_url.items():
        members.update(reader.read(url, keys))
    url = layout.balanced_tar(index)
    written = []
    out = TarWriter(url, deterministic=True)
    try:
        for e in entries:
            digest = sample_hash(members[e.key])
            if e.hash is not None and digest != e.hash:
                raise BalancedError(f"sample {e.key} of shard {e.shard} changed while the balanced tars were updated")
            out.add(e.key, members[e.key])
            written.append(Entry(e.key, e.shard, digest))
        if is_partial:  # before the short tar is published, so no index ever lists it as complete
            _set_marker(url, incomplete=not final)
        out.commit()
    except BaseException as exc:
        out.abort(exc)
        raise
    if not is_partial:  # after the full tar is published: a reader never sees a short tar unmarked
        _set_marker(url, incomplete=False)
    storage.write_bytes(manifest_url(layout, index), json.dumps(
        {"digest": _tar_digest(written), "samples": [list(e) for e in written]}).encode("utf-8"))
    return written


def _set_marker(tar_url: str, incomplete: bool) -> None:
    if incomplete:
        storage.write_bytes(incomplete_marker(tar_url), b"")
    else:
        storage.remove(incomplete_marker(tar_url))


def _remove_past_end(layout: Layout, count: int, old_count: int) -> list[str]:
    """Tars (and their markers and manifests) past the new last one: their samples went."""
    gone = []
    for i in range(count, old_count):
        url = layout.balanced_tar(i)
        storage.remove(incomplete_marker(url))
        storage.remove(url)
        storage.remove(manifest_url(layout, i))
        gone.append(url)
    return gone


def _report(layout: Layout, chunk: int, tars: list[dict], final: bool, became_complete: list[str],
            rewritten: list[str], removed: list[str], new: list[str], changed_shards: list[str],
            without_tar: list[str], plan: _Plan, changed: bool, rebuilt: str | None = None) -> BalancedReport:
    complete = [layout.balanced_tar(i) for i, t in enumerate(tars) if t["count"] == chunk]
    partial = layout.balanced_tar(len(tars) - 1) if tars and tars[-1]["count"] < chunk else None
    return BalancedReport(
        chunk_size=chunk, complete_tars=complete, new_complete_tars=became_complete, partial_tar=partial,
        partial_count=tars[-1]["count"] if partial else 0, partial_marked_incomplete=partial is not None and not final,
        rewritten_tars=rewritten, removed_tars=removed, new_shards=new, changed_shards=changed_shards,
        shards_without_tar=without_tar, samples_added=plan.added, samples_replaced=plan.replaced,
        samples_removed=plan.removed, total_samples=sum(t["count"] for t in tars), changed=changed, rebuilt=rebuilt)
