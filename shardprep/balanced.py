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

Tar bytes are deterministic: USTAR headers like webdataset 0.2's ``TarWriter`` (mode 0o444,
uname/gname ``bigdata``) but with ``mtime = 0`` and uid/gid 0, so re-running the same inputs gives
identical files.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from dataclasses import dataclass, field
from typing import IO, Iterator

from shardprep.keys import split_member_name
from shardprep.layout import Layout
from shardprep.storage import atomic_write, url_to_fs

STATE_NAME = "state.json"
INCOMPLETE_SUFFIX = ".INCOMPLETE"
STATE_VERSION = 1
TAR_USER = TAR_GROUP = "bigdata"  # webdataset TarWriter's defaults
TAR_MODE = 0o444
# webdataset / energon sample grouping: key = path up to the basename's first dot


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
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        raw = json.loads(f.read())
    if raw.get("version") != STATE_VERSION:
        raise ValueError(f"{url}: unsupported state version {raw.get('version')!r}")
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


def iter_tar_samples(fileobj: IO[bytes], name: str, *, sort: bool) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """Yield ``(key, [(member name, payload), ...])`` of a webdataset tar.

    ``sort=True`` yields samples in key order (two passes over a seekable file: headers, then the
    payloads); otherwise in file order, grouping consecutive members like webdataset does.
    """
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r:*")
    except tarfile.TarError as e:
        raise ValueError(f"{name}: not a readable tar ({e})") from e
    with tar:
        try:
            members = [m for m in tar.getmembers() if m.isreg()]
        except tarfile.TarError as e:
            raise ValueError(f"{name}: corrupt tar ({e})") from e
        groups: list[tuple[str, list[tarfile.TarInfo]]] = []
        index: dict[str, int] = {}
        for m in members:
            split = split_member_name(m.name)
            if split is None:
                continue  # no extension: webdataset and energon skip it too
            key = split[0]
            if groups and groups[-1][0] == key:
                groups[-1][1].append(m)
            elif key in index:
                raise ValueError(f"{name}: members of sample {key!r} are not contiguous (e.g. {m.name!r})")
            else:
                index[key] = len(groups)
                groups.append((key, [m]))
        if sort:
            groups.sort(key=lambda g: _sample_sort_key(g[0]))
        for key, ms in groups:
            parts = []
            for m in ms:
                f = tar.extractfile(m)
                if f is None:
                    raise ValueError(f"{name}: cannot read member {m.name!r}")
                parts.append((m.name, f.read()))
            yield key, parts


def _add_member(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mtime = 0  # deterministic bytes: a re-run writes identical tars
    info.mode = TAR_MODE
    info.uid = info.gid = 0
    info.uname, info.gname = TAR_USER, TAR_GROUP
    tar.addfile(info, io.BytesIO(payload))


def _exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def _remove(url: str) -> None:
    fs, path = url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


def _write_marker(url: str) -> None:
    with atomic_write(url) as f:
        f.write(b"")


class _TarOut:
    """One output tar being written through ``atomic_write`` (published on ``commit``)."""

    def __init__(self, url: str):
        self.url = url
        self.count = 0
        self.keys: list[str] = []
        self._cm = atomic_write(url)
        self._file = self._cm.__enter__()
        self._tar = tarfile.open(fileobj=self._file, mode="w|", format=tarfile.USTAR_FORMAT)

    def add(self, key: str, parts: list[tuple[str, bytes]]) -> None:
        for name, payload in parts:
            _add_member(self._tar, name, payload)
        self.count += 1
        self.keys.append(key)

    def commit(self) -> None:
        self._tar.close()  # end-of-archive blocks must be in the file before it is published
        self._cm.__exit__(None, None, None)

    def abort(self, exc: BaseException) -> None:
        try:
            self._tar.close()
        except Exception:  # noqa: BLE001 - the temp file is discarded anyway
            pass
        self._cm.__exit__(type(exc), exc, exc.__traceback__)


def _read_partial(url: str, keys: list[str]) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """The first ``len(keys)`` samples of the partial tar, checked against the state's keys.

    Only a prefix is taken: after a crash between writing tars and writing the state, the tar may
    already hold more samples than the state knows; those are re-read from their shards.
    """
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        raise ValueError(f"{url}: partial tar recorded in {STATE_NAME} is missing; delete the balanced "
                         "folder to rebuild it")
    with fs.open(path, "rb") as f:
        samples = iter_tar_samples(f, url, sort=False)
        for expected in keys:
            got = next(samples, None)
            if got is None or got[0] != expected:
                raise ValueError(f"{url}: partial tar does not start with the samples recorded in {STATE_NAME} "
                                 f"(expected key {expected!r}, found {None if got is None else got[0]!r}); "
                                 "delete the balanced folder to rebuild it")
            yield got


def _validate_shards(shards: list[str], consumed: list[str]) -> None:
    dup = sorted({s for s in shards if shards.count(s) > 1})
    if dup:
        raise ValueError(f"shards list names shard(s) {dup} more than once")
    if shards[:len(consumed)] != consumed:
        for i, s in enumerate(consumed):
            if i >= len(shards) or shards[i] != s:
                got = shards[i] if i < len(shards) else "<end of list>"
                raise ValueError(
                    f"balanced tars already consumed shards {consumed[:3]}...{consumed[-1:]} in that order; the "
                    f"new shards list must start with them, but position {i} is {got!r} instead of {s!r} "
                    "(only appending shards is incremental; delete the balanced folder to rebuild)")


def update_balanced_shards(layout: Layout, shards: list[str], chunk_size: int = 1000,
                           final: bool = False) -> BalancedReport:
    """Append the samples of the shards not consumed yet to the balanced tars.

    ``shards`` is the full ordered list (the previously consumed shards first, new ones appended).
    Only the last partial tar is rewritten; complete tars are left byte-identical.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shards = list(shards)
    raw = load_state(layout)
    if raw is None:
        state = _State(chunk_size=chunk_size)
    else:
        state = _State(chunk_size=raw["chunk_size"], consumed=raw["consumed"], counts=raw["counts"],
                       partial_keys=raw["partial_keys"], final=raw.get("final", False))
        if state.chunk_size != chunk_size:
            raise ValueError(f"{state_url(layout)}: balanced tars were built with chunk_size={state.chunk_size}, "
                             f"not {chunk_size}; complete tars are immutable, delete the balanced folder to re-chunk")
    _validate_shards(shards, state.consumed)
    new_shards = shards[len(state.consumed):]

    n_complete_before = len(state.counts) - (1 if state.partial_keys else 0)
    partial_index = n_complete_before if state.partial_keys else None
    tar_urls = [layout.balanced_tar(i) for i in range(len(state.counts))]

    present = [s for s in new_shards if _exists(layout.tar(s))]
    missing = [s for s in new_shards if s not in present]

    if not present:  # nothing to copy: at most the marker and the consumed list change
        changed = bool(new_shards)
        if partial_index is not None and final != state.final:
            # with final=True the short tar becomes indexable, with final=False it is hidden again
            marker = incomplete_marker(tar_urls[partial_index])
            if final:
                _remove(marker)
            else:
                _write_marker(marker)
            changed = True
        if changed:
            state.consumed = state.consumed + new_shards
            state.final = final
            _write_state(layout, state)
        return _report(layout, state, [], [], new_shards, 0, changed, missing=missing)

    def samples() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
        for shard in present:
            fs, path = url_to_fs(layout.tar(shard))
            with fs.open(path, "rb") as f:
                yield from iter_tar_samples(f, layout.tar(shard), sort=True)

    counts = state.counts[:n_complete_before]
    new_complete: list[str] = []
    rewritten: list[str] = []
    added = 0
    index = n_complete_before
    out: _TarOut | None = None
    source = samples()
    try:
        if partial_index is not None:
            out = _TarOut(layout.balanced_tar(partial_index))
            for key, parts in _read_partial(tar_urls[partial_index], state.partial_keys):
                out.add(key, parts)
        for key, parts in source:
            if out is None:
                out = _TarOut(layout.balanced_tar(index))
            out.add(key, parts)
            added += 1
            if out.count == chunk_size:
                out.commit()
                # the marker goes after the full tar is published: a reader never sees a short tar unmarked
                _remove(incomplete_marker(out.url))
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
                _remove(incomplete_marker(out.url))
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
    with atomic_write(state_url(layout)) as f:
        f.write(json.dumps(state.to_json(), indent=1).encode("utf-8"))


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
