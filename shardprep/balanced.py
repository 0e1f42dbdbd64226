"""NeMo ``reorganize_tar``, incremental: re-chunk image shards into tars of exactly ``chunk_size`` samples.

Input: the img2dataset-layout shards ``layout.tar(shard)`` in shard order (a shard without a tar had
no successes and adds nothing). Output under ``layout.balanced_dir``:

* ``{i:05d}.tar``: exactly ``chunk_size`` samples each, filled in (shard, key) order; members keep
  their names (``{key}.jpg``, ``{key}.json``, ``{key}.txt``). A complete tar is never rewritten.
* the last tar may be partial: it carries an empty sidecar ``{tar}.INCOMPLETE`` (as NeMo's
  reorganize_tar writes) so that wdinfo and energon indexes leave it out, until later shards fill
  it. ``final=True`` drops the sidecar so the short tar can be indexed; it is still the partial tar
  and is rewritten (filled) if more shards arrive later.
* ``state.json``: the shards consumed, the sample count of each tar and the partial tar's keys, so an
  update reads only the new shards (and the partial tar).

Tar bytes are deterministic (``TarWriter(deterministic=True)``: webdataset 0.2's headers with
``mtime = 0``), so re-running the same inputs gives identical files. Members are written as
``{key}.{ext}`` sorted by extension, webdataset's reading of them (extensions lower-cased).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Iterator

from shardprep import storage
from shardprep.errors import ShardprepError
from shardprep.layout import Layout
from shardprep.tars import INCOMPLETE_SUFFIX, TarWriter, header_samples, iter_samples

STATE_NAME = "state.json"
STATE_VERSION = 1


class BalancedError(ShardprepError, ValueError):
    """The balanced tars cannot be updated as asked (state, shard list or chunk size disagree)."""


@dataclass
class BalancedReport:
    chunk_size: int
    complete_tars: list[str]  # every complete tar, in order (what wdinfo/indexes may list)
    new_complete_tars: list[str]  # tars that became complete in this call (incl. a filled partial)
    partial_tar: str | None  # the last, short tar (None when the samples divide evenly)
    partial_count: int
    partial_marked_incomplete: bool  # False with final=True
    rewritten_tars: list[str]  # existing tars this call replaced (only ever the old partial one)
    new_shards: list[str]  # shards consumed by this call
    shards_without_tar: list[str]  # among new_shards: no tar (0 successes)
    samples_added: int
    total_samples: int
    changed: bool


@dataclass
class _State:
    chunk_size: int
    consumed: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # samples per tar, tar i = balanced_tar(i)
    partial_keys: list[str] = field(default_factory=list)  # keys of the last tar while it is short
    final: bool = False

    def to_json(self) -> dict:
        return {"version": STATE_VERSION, "chunk_size": self.chunk_size, "consumed": self.consumed,
                "counts": self.counts, "partial_keys": self.partial_keys, "final": self.final}


def state_url(layout: Layout) -> str:
    return f"{layout.balanced_dir}/{STATE_NAME}"


def incomplete_marker(tar_url: str) -> str:
    return tar_url + INCOMPLETE_SUFFIX


def _load_state_at(url: str) -> dict | None:
    text = storage.read_text(url)
    if text is None:
        return None
    raw = json.loads(text)
    if raw.get("version") != STATE_VERSION:
        raise BalancedError(f"{url}: unsupported state version {raw.get('version')!r}")
    return raw


def load_state(layout: Layout) -> dict | None:
    """The raw ``state.json`` of ``layout``'s balanced tars, or None before the first update."""
    return _load_state_at(state_url(layout))


def complete_tar_counts(balanced_dir: str) -> dict[str, int]:
    """``{tar name: sample count}`` of the tars a balanced folder's state records as complete
    (empty when the folder has no state); complete tars never change, so wdinfo can trust it."""
    raw = _load_state_at(f"{balanced_dir.rstrip('/')}/{STATE_NAME}")
    if raw is None:
        return {}
    counts = raw["counts"]
    n_complete = len(counts) - (1 if raw["partial_keys"] else 0)
    return {posixpath.basename(Layout(".").balanced_tar(i)): counts[i] for i in range(n_complete)}


def _sample_sort_key(key: str) -> tuple[int, str]:
    # img2dataset keys are zero-padded digits of one width; length first keeps odd widths numeric
    return (len(key), key)


def _members(sample: dict) -> dict[str, bytes]:
    return {ext: data for ext, data in sample.items() if ext not in ("__key__", "__url__")}


def _samples_in_key_order(url: str) -> Iterator[dict]:
    """Samples of an image shard in key order: streamed when the tar is in key order already (as
    ``write_image_shard`` writes it; a headers-only pass checks), else sorted in memory."""
    keys = [s["__key__"] for s in header_samples(url)[0]]
    if keys == sorted(keys, key=_sample_sort_key):
        yield from iter_samples(url)
    else:
        yield from sorted(iter_samples(url), key=lambda s: _sample_sort_key(s["__key__"]))


def _write_marker(url: str) -> None:
    storage.write_bytes(url, b"")


def _read_partial(url: str, keys: list[str]) -> Iterator[dict]:
    """The first ``len(keys)`` samples of the partial tar, checked against the state's keys.

    Only a prefix is taken: after a crash between writing tars and writing the state, the tar may
    already hold more samples than the state knows; those are re-read from their shards.
    """
    if not storage.exists(url):
        raise BalancedError(f"{url}: partial tar recorded in {STATE_NAME} is missing; delete the balanced "
                            "folder to rebuild it")
    samples = iter_samples(url)
    try:
        for expected in keys:
            got = next(samples, None)
            found = None if got is None else got["__key__"]
            if found != expected:
                raise BalancedError(f"{url}: partial tar does not start with the samples recorded in {STATE_NAME} "
                                    f"(expected key {expected!r}, found {found!r}); "
                                    "delete the balanced folder to rebuild it")
            yield got
    finally:
        samples.close()


def _validate_shards(shards: list[str], consumed: list[str]) -> None:
    dup = sorted({s for s in shards if shards.count(s) > 1})
    if dup:
        raise BalancedError(f"shards list names shard(s) {dup} more than once")
    if shards[:len(consumed)] != consumed:
        for i, s in enumerate(consumed):
            if i >= len(shards) or shards[i] != s:
                got = shards[i] if i < len(shards) else "<end of list>"
                raise BalancedError(
                    f"balanced tars already consumed shards {consumed[:3]}...{consumed[-1:]} in that order; the "
                    f"new shards list must start with them, but position {i} is {got!r} instead of {s!r} "
                    "(only appending shards is incremental; delete the balanced folder to rebuild)")


def update_balanced_shards(layout: Layout, shards: list[str], chunk_size: int = 1000,
                           final: bool = False, selected=None) -> BalancedReport:
    """Append the samples of the shards not consumed yet to the balanced tars.

    ``shards`` is the full ordered list (the previously consumed shards first, new ones appended).
    ``selected(shard)``: the keys of the shard to use (``shardprep.selection``), None for all.
    Only the last partial tar is rewritten; complete tars are left byte-identical.
    """
    if chunk_size < 1:
        raise BalancedError(f"chunk_size must be >= 1, got {chunk_size}")
    shards = list(shards)
    raw = load_state(layout)
    if raw is None:
        state = _State(chunk_size=chunk_size)
    else:
        state = _State(chunk_size=raw["chunk_size"], consumed=raw["consumed"], counts=raw["counts"],
                       partial_keys=raw["partial_keys"], final=raw.get("final", False))
        if state.chunk_size != chunk_size:
            raise BalancedError(f"{state_url(layout)}: balanced tars were built with chunk_size={state.chunk_size}, "
                             f"not {chunk_size}; complete tars are immutable, delete the balanced folder to re-chunk")
    _validate_shards(shards, state.consumed)
    new_shards = shards[len(state.consumed):]

    n_complete_before = len(state.counts) - (1 if state.partial_keys else 0)
    partial_index = n_complete_before if state.partial_keys else None
    tar_urls = [layout.balanced_tar(i) for i in range(len(state.counts))]

    present = [s for s in new_shards if storage.exists(layout.tar(s))]
    missing = [s for s in new_shards if s not in present]

    if not present:  # nothing to copy: at most the marker and the consumed list change
        changed = bool(new_shards)
        if partial_index is not None and final != state.final:
            # with final=True the short tar becomes indexable, with final=False it is hidden again
            marker = incomplete_marker(tar_urls[partial_index])
            if final:
                storage.remove(marker)
            else:
                _write_marker(marker)
            changed = True
        if changed:
            state.consumed = state.consumed + new_shards
            state.final = final
            _write_state(layout, state)
        return _report(layout, state, [], [], new_shards, 0, changed, missing=missing)

    def samples() -> Iterator[dict]:
        for shard in present:
            keys = selected(shard) if selected is not None else None
            for sample in _samples_in_key_order(layout.tar(shard)):
                if keys is None or sample["__key__"] in keys:
                    yield sample

    counts = state.counts[:n_complete_before]
    new_complete: list[str] = []
    rewritten: list[str] = []
    added = 0
    index = n_complete_before
    out: TarWriter | None = None
    source = samples()
    try:
        if partial_index is not None:
            out = TarWriter(layout.balanced_tar(partial_index), deterministic=True)
            for sample in _read_partial(tar_urls[partial_index], state.partial_keys):
                out.add(sample["__key__"], _members(sample))
        for sample in source:
            if out is None:
                out = TarWriter(layout.balanced_tar(index), deterministic=True)
            out.add(sample["__key__"], _members(sample))
            added += 1
            if out.count == chunk_size:
                out.commit()
                # the marker goes after the full tar is published: a reader never sees a short tar unmarked
                storage.remove(incomplete_marker(out.url))
                if index == partial_index:
                    rewritten.append(out.url)
                new_complete.append(out.url)
                counts.append(chunk_size)
                index += 1
                out = None
        partial_keys: list[str] = []
        if out is not None:
            # the marker goes before the short tar is published, so no index ever lists it as complete
            if final:
                storage.remove(incomplete_marker(out.url))
            else:
                _write_marker(incomplete_marker(out.url))
            out.commit()
            if index == partial_index:
                rewritten.append(out.url)
            counts.append(out.count)
            partial_keys = out.keys
            out = None
    except BaseException as e:
        if out is not None:
            out.abort(e)
        raise
    finally:
        source.close()

    state.consumed = state.consumed + new_shards
    state.counts = counts
    state.partial_keys = partial_keys
    state.final = final
    _write_state(layout, state)
    return _report(layout, state, new_complete, rewritten, new_shards, added, True, missing=missing)


def _write_state(layout: Layout, state: _State) -> None:
    storage.write_bytes(state_url(layout), json.dumps(state.to_json(), indent=1).encode("utf-8"))


def _report(layout: Layout, state: _State, new_complete: list[str],
            rewritten: list[str], new_shards: list[str], added: int, changed: bool,
            missing: list[str] | None = None) -> BalancedReport:
    n_complete = len(state.counts) - (1 if state.partial_keys else 0)
    partial = layout.balanced_tar(n_complete) if state.partial_keys else None
    return BalancedReport(
        chunk_size=state.chunk_size,
        complete_tars=[layout.balanced_tar(i) for i in range(n_complete)],
        new_complete_tars=new_complete,
        partial_tar=partial,
        partial_count=len(state.partial_keys),
        partial_marked_incomplete=partial is not None and not state.final,
        rewritten_tars=rewritten,
        new_shards=new_shards,
        shards_without_tar=missing or [],
        samples_added=added,
        total_samples=sum(state.counts),
        changed=changed,
    )
