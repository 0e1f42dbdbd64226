"""Finished outputs, read again: is each file still there, whole, and what it should hold?

One function per artifact returns ``Findings``: the problems found (each a message naming the file) and
the numbers read on the way. ``deep=False`` is cheap: file sizes, parquet footers, ``.npy`` headers,
tar headers to the end of the archive (a truncated tar fails there), sample keys against the parquet.
``deep=True`` also reads the data: embedding values are finite, each embedding row belongs to a tar
sample, reordered rows sit at their key's index. ``shardprep verify`` and the dataset report run the
cheap form; the blocking asset checks (``shardprep.checks``) the deep one -- the same code.
"""

from __future__ import annotations

import json
import pickle
import sqlite3
import tempfile
from dataclasses import dataclass, field

import numpy as np

from shardprep import storage
from shardprep.artifacts import ARTIFACTS
from shardprep.config import DatasetConfig
from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep.storage import parquet_rows
from shardprep.tars import header_samples, sample_keys
from shardprep.versions import ALL_SHARDS, read_stamp


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)  # problems of outputs whole but out of step with their inputs

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, url: str, message: str, stale: bool = False) -> None:
        self.problems.append(f"{url}: {message}")
        if stale:
            self.stale.add(self.problems[-1])


@dataclass(frozen=True)
class Problem:
    """A broken output: which artifact and shard (``versions.ALL_SHARDS`` for unpartitioned ones);
    ``stale``: whole, but made from per-shard outputs that were made again since."""

    artifact: str
    shard: str
    message: str
    stale: bool = False

    def __str__(self) -> str:
        return f"{self.artifact} {self.shard}: {self.message}"


# ---------------------------------------------------------------- reading files cheaply


def file_sizes(urls: list[str]) -> dict[str, int]:
    """``{url: size}`` of the files among ``urls`` that exist (what a stamp records)."""
    out = {}
    for url in urls:
        fs, path = storage.url_to_fs(url)
        try:
            out[url] = int(fs.info(path)["size"])
        except FileNotFoundError:
            continue
    return out


def npy_header(url: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an ``.npy`` file from its header; ValueError if the data is cut short."""
    with storage.open_read(url) as f:
        major, _ = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        start = f.tell()
    size = storage.stat(url)[0]
    want = start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != want:
        raise ValueError(f"{size} bytes, its header promises {want} (shape {shape}, {dtype})")
    return shape, dtype


def _read(findings: Findings, url: str, reader, what: str):
    """``reader(url)``, or None with a problem naming the file (missing or unreadable)."""
    try:
        return reader(url)
    except FileNotFoundError:
        findings.fail(url, f"missing ({what})")
    except Exception as e:  # noqa: BLE001 - any unreadable file is a finding, never a crash
        findings.fail(url, f"unreadable {what}: {type(e).__name__}: {e}")
    return None


# ---------------------------------------------------------------- per-shard artifacts


def recorded_sizes(findings: Findings, recorded: dict[str, int]) -> None:
    """The files a stamp recorded are there, at the size they were written with."""
    sizes = file_sizes(list(recorded))
    for url, size in recorded.items():
        if url not in sizes:
            findings.fail(url, "missing (recorded when the shard was finished)")
        elif sizes[url] != size:
            findings.fail(url, f"{sizes[url]} bytes, {size} when the shard was finished (truncated or rewritten)")


def verify_source_parquet(layout: Layout, shard: str, rows: int | None = None) -> Findings:
    f = Findings()
    url = layout.source_parquet(shard)
    n = _read(f, url, parquet_rows, "parquet")
    if n is not None and rows is not None and n != rows:
        f.fail(url, f"{n} rows, the ledger gives the shard {rows}")
    return f


def verify_image_shard(layout: Layout, shard: str, rows: int | None = None, read_tar: bool = True) -> Findings:
    """``{shard}.parquet`` (a row per input row), ``_stats.json`` and the tar holding exactly the
    parquet's successful samples (no tar when there are none), the tar read to its end
    (``read_tar=False``: only that it is there when it should be)."""
    return _verify_webdataset_shard(layout.tar(shard), layout.shard_parquet(shard), layout.shard_stats(shard),
                                    rows, read_tar, clips=False)


def verify_video_shard(layout: Layout, shard: str, rows: int | None = None, read_tar: bool = True) -> Findings:
    """As ``verify_image_shard``, for video2dataset's layout: a parquet row per sample written (a clip
    each, ``{key}_{clip}``) and per failed input row, so every input row has at least one."""
    return _verify_webdataset_shard(layout.video_tar(shard), layout.video_parquet(shard), layout.video_stats(shard),
                                    rows, read_tar, clips=True)


def _verify_webdataset_shard(tar: str, parquet: str, stats_url: str, rows: int | None, read_tar: bool,
                             clips: bool) -> Findings:
    f = Findings()
    stats = _read(f, stats_url, lambda u: json.loads(storage.read_bytes(u)), "stats json")
    table = _read(f, parquet, lambda u: storage.read_parquet(u, ["key", "status"]), "parquet")
    if table is None:
        return f
    cols = table.to_pydict()
    # clips: a row's samples are keyed {row key}_{clip}; the stats count input rows
    row_keys = {k.split("_", 1)[0] for k in cols["key"]} if clips else cols["key"]
    if rows is not None and len(row_keys) != rows:
        f.fail(parquet, f"{len(row_keys)} {'input rows' if clips else 'rows'}, the ledger gives the shard {rows}")
    expected = sorted(k for k, s in zip(cols["key"], cols["status"]) if s == "success")
    successes = len({k.split("_", 1)[0] for k in expected}) if clips else len(expected)
    if isinstance(stats, dict) and stats.get("successes") != successes:
        f.fail(stats_url, f"says {stats.get('successes')} successes, the parquet {successes}")
    if not read_tar:
        if bool(expected) != storage.exists(tar):
            f.fail(tar, "missing" if expected else "exists, but the parquet has no success")
        return f
    keys = (_read(f, tar, sample_keys, "tar") or []) if expected or storage.exists(tar) else []
    f.facts.update(tar_samples=len(keys), parquet_successes=len(expected))
    if f.problems:
        return f
    if sorted(keys) != expected:
        missing, extra = sorted(set(expected) - set(keys)), sorted(set(keys) - set(expected))
        f.fail(tar, f"{len(keys)} samples, the parquet has {len(expected)} successes "
                    f"(missing {missing[:5]}, unexpected {extra[:5]})")
    elif len(set(keys)) != len(keys):
        f.fail(tar, "a sample key appears twice")
    return f


def verify_clip_embeddings(layout: Layout, shard: str, enable_text: bool = True, deep: bool = False) -> Findings:
    """One embedding row per metadata row (float16 ``[N, D]``, files whole); deep: the embedded keys are
    the tar's samples, one row each, and every value is finite."""
    f = Findings()
    has_samples = storage.exists(layout.tar(shard))
    urls = {"img": layout.img_emb(shard)} | ({"text": layout.text_emb(shard)} if enable_text else {})
    if not has_samples:
        for url in urls.values():
            if storage.exists(url):
                f.fail(url, "exists, but the shard has no tar (no sample)")
        return f
    n = _read(f, layout.emb_metadata(shard), parquet_rows, "metadata parquet")
    shapes = {name: _read(f, url, npy_header, "npy") for name, url in urls.items()}
    for name, found in shapes.items():
        if found is None:
            continue
        shape, dtype = found
        if len(shape) != 2 or dtype != np.float16 or (n is not None and shape[0] != n):
            f.fail(urls[name], f"shape {shape} {dtype}, expected ({n}, D) float16 (one row per metadata row)")
    f.facts.update(metadata_rows=n)
    if f.problems or not deep:
        return f
    samples = sample_keys(layout.tar(shard))
    meta_keys = storage.read_parquet(layout.emb_metadata(shard), ["image_path"])["image_path"].to_pylist()
    f.facts.update(samples=len(samples))
    if sorted(meta_keys) != sorted(samples):
        f.fail(layout.emb_metadata(shard), f"embedded keys differ from the tar's ({len(set(samples) - set(meta_keys))} "
                                           f"samples without an embedding, {len(set(meta_keys) - set(samples))} "
                                           "embeddings of no sample)")
    for name, url in urls.items():
        bad = int((~np.isfinite(storage.read_npy(url, mmap=True))).any(axis=1).sum())
        f.facts[f"{name}_nonfinite_rows"] = bad
        if bad:
            f.fail(url, f"{bad} rows with NaN/Inf")
    return f


def verify_image_scores(layout: Layout, shard: str, scored: bool) -> Findings:
    """With a score head configured (``scored``): one score row per embedded sample; without: no file."""
    f = Findings()
    url = layout.scores(shard)
    if not scored or not storage.exists(layout.img_emb(shard)):
        if storage.exists(url):
            f.fail(url, "exists, but " + ("no score head is configured" if not scored else "the shard has no embeddings"))
        return f
    n = _read(f, url, parquet_rows, "scores parquet")
    m = _read(f, layout.emb_metadata(shard), parquet_rows, "metadata parquet")
    if n is not None and m is not None and n != m:
        f.fail(url, f"{n} rows, the embeddings' metadata has {m}")
    f.facts.update(scored_samples=n)
    return f


def verify_captions(layout: Layout, shard: str, read_tar: bool = True) -> Findings:
    """A shard with a tar (an image tar, or a video shard's video tar): its captions parquet, readable, one
    row per tar sample (``read_tar=False``: only that it is readable); without one: no file."""
    f = Findings()
    url = layout.captions(shard)
    tar = layout.tar(shard)
    if not storage.exists(tar):
        tar = layout.video_tar(shard)  # a shard is of one media: at most one of the two is there
    if not storage.exists(tar):
        if storage.exists(url):
            f.fail(url, "exists, but the shard has no tar (no sample)")
        return f
    n = _read(f, url, parquet_rows, "captions parquet")
    f.facts.update(captioned_rows=n)
    if n is None or not read_tar:
        return f
    keys = _read(f, tar, sample_keys, "tar")
    if keys is not None and n != len(keys):
        f.fail(url, f"{n} rows, the shard's tar has {len(keys)} samples")
    return f


def verify_training_text(layout: Layout, shard: str, read_tar: bool = True) -> Findings:
    """A shard with a tar: its training_text parquet, readable; ``read_tar``: a row per tar sample, in tar
    order, each naming the ``train_caption`` the sample's json holds; without a tar: no file."""
    import json

    from shardprep.tars import iter_samples

    f = Findings()
    url = layout.training_text(shard)
    if not storage.exists(layout.tar(shard)):
        if storage.exists(url):
            f.fail(url, "exists, but the shard has no tar (no sample)")
        return f
    rows = _read(f, url, lambda u: storage.read_parquet(u, ["key", "train_caption"]).to_pylist(), "training_text parquet")
    f.facts.update(training_text_rows=None if rows is None else len(rows))
    if storage.exists(layout.emb_metadata(shard)):  # the DALLE2 prior's text, row for row with the images
        embedded = _read(f, layout.emb_metadata(shard), parquet_rows, "metadata parquet")
        prior = _read(f, layout.train_text_metadata(shard), parquet_rows, "prior text metadata")
        if None not in (embedded, prior) and embedded != prior:
            f.fail(layout.train_text_metadata(shard), f"{prior} rows, the image embeddings have {embedded}", stale=True)
        if storage.exists(layout.train_text_emb(shard)):
            header = _read(f, layout.train_text_emb(shard), npy_header, "npy")
            if header is not None and embedded is not None and header[0][0] != embedded:
                f.fail(layout.train_text_emb(shard), f"{header[0][0]} rows, the image embeddings have {embedded}",
                       stale=True)
    if rows is None or not read_tar:
        return f
    chosen = _read(f, layout.tar(shard), lambda u: [
        (s["__key__"], json.loads(s["json"]).get("train_caption")) for s in iter_samples(u) if "json" in s], "tar")
    if chosen is not None and chosen != [(r["key"], r["train_caption"]) for r in rows]:
        f.fail(url, f"does not match the train_caption of the {len(chosen)} json members of {layout.tar(shard)}",
               stale=True)
    return f


def verify_reordered_embeddings(layout: Layout, shard: str, rows: int | None = None, index_width: int = 0,
                                deep: bool = False) -> Findings:
    """``[rows, D]`` files like their clip-retrieval source; deep: row i is the embedding of the sample
    whose key ends in i, zeros elsewhere."""
    f = Findings()
    pairs = [(layout.img_emb(shard), layout.reordered_img(shard)), (layout.text_emb(shard), layout.reordered_text(shard))]
    for src_url, out_url in pairs:
        if not storage.exists(src_url):
            continue  # no source to compare with (a broken source is clip_embeddings' finding)
        src = _read(f, src_url, npy_header, "npy")
        out = _read(f, out_url, npy_header, "npy")
        if src is None or out is None:
            continue
        want = ((rows if rows is not None else out[0][0]), src[0][1])
        if out[0] != want or out[1] != src[1]:
            f.fail(out_url, f"shape {out[0]} {out[1]}, expected {want} {src[1]}")
        elif deep:
            _check_placement(f, layout, shard, src_url, out_url, index_width)
    return f


def _check_placement(f: Findings, layout: Layout, shard: str, src_url: str, out_url: str, index_width: int) -> None:
    src, out = storage.read_npy(src_url), storage.read_npy(out_url)
    keys = storage.read_parquet(layout.emb_metadata(shard), ["image_path"])["image_path"].to_pylist()
    idx = np.array([index_of_key(k, index_width) for k in keys], dtype=np.int64)
    misplaced = int((out[idx] != src).any(axis=1).sum())
    holes = np.setdiff1d(np.arange(out.shape[0]), idx)
    nonzero = int(out[holes].any(axis=1).sum())
    # summed over the image and text files: either one being wrong fails the check
    f.facts.update(rows=int(out.shape[0]), samples=len(keys),
                   misplaced_rows=f.facts.get("misplaced_rows", 0) + misplaced,
                   nonzero_hole_rows=f.facts.get("nonzero_hole_rows", 0) + nonzero)
    if misplaced or nonzero:
        f.fail(out_url, f"{misplaced} rows not at their key's index, {nonzero} non-zero rows for failed samples")


def verify_diffusion_samples(layout: Layout, shard: str) -> Findings:
    """The diffusion tar (when there is one) reads to its end, each sample with .pth, .pickle and .json."""
    f = Findings()
    url = layout.diffusion_tar(shard)
    if not storage.exists(url):
        return f
    try:
        samples, _ = header_samples(url)
    except Exception as e:  # noqa: BLE001 - an unreadable tar is a finding
        f.fail(url, f"unreadable tar: {type(e).__name__}: {e}")
        return f
    incomplete = [s["__key__"] for s in samples if not {".pth", ".pickle", ".json"} <= set(s)]
    if incomplete:
        f.fail(url, f"{len(incomplete)} samples lack .pth/.pickle/.json (e.g. {incomplete[:3]})")
    f.facts.update(samples=len(samples))
    return f


# ---------------------------------------------------------------- unpartitioned artifacts
#
# Besides being whole, a global artifact must agree with the per-shard outputs it was made from: each
# records what it consumed (the balanced state each shard's identity and each tar's digest, precache the
# digest of the balanced tar it encoded, energon each tar's size and time, dedup and the selection each
# shard's input identity), so a shard made again since (reshard, takedown) is found by comparing those
# records with the current stamps, without reading a sample. Such findings are marked ``stale``: the
# next run's incremental update repairs them.


def verify_balanced_shards(layout: Layout, cfg: DatasetConfig | None = None) -> Findings:
    """Every tar the balanced state records reads to its end with the recorded sample count, no update
    was left half done, and (with ``cfg``) every consumed shard's samples are as the shard holds them now."""
    from shardprep.nemo import balanced

    f = Findings()
    state = _read(f, balanced.state_url(layout), lambda u: balanced.load_state(layout), "balanced state")
    if not state:
        return f
    if state.get("version") != balanced.STATE_VERSION:
        f.fail(balanced.state_url(layout), f"state version {state.get('version')}, the next update rewrites it",
               stale=True)
        return f
    if storage.exists(f"{layout.balanced_dir}/{balanced.PENDING_NAME}"):
        f.fail(layout.balanced_dir, "an update was interrupted; the next one writes every tar again", stale=True)
    for i, tar in enumerate(state["tars"]):
        url = layout.balanced_tar(i)
        keys = _read(f, url, sample_keys, "tar")
        if keys is not None and len(keys) != tar["count"]:
            f.fail(url, f"{len(keys)} samples, the balanced state records {tar['count']}")
    f.facts.update(tars=len(state["tars"]))
    if cfg is None:
        return f
    from shardprep.curation.selection import active_rules
    from shardprep.versions import artifact_versions

    now = balanced.source_identities(layout, artifact_versions(cfg), bool(active_rules(cfg)), cfg.synthetic_text)
    for shard, entry in state["shards"].items():
        if now.get(shard) != entry["source"]:
            tars = ", ".join(f"{i:05d}.tar" for i in entry.get("tars", [])) or "no tar"
            f.fail(layout.balanced_dir, f"{tars} hold(s) samples of shard {shard} as they were before it was "
                   "made again", stale=True)
    return f


def verify_wdinfo(layout: Layout, folder: str, wdinfo_url: str, complete: list[str] | None = None) -> Findings:
    """``wdinfo.pkl`` loads and lists tars that exist; with ``complete``, exactly those tars."""
    f = Findings()
    info = _read(f, wdinfo_url, lambda u: pickle.loads(storage.read_bytes(u)), "wdinfo pickle")
    if isinstance(info, dict):
        listed = list(info.get("tar_files", []))
        for name in listed:
            if not storage.exists(f"{folder}/{name}"):
                f.fail(wdinfo_url, f"lists {name}, which does not exist")
        if complete is not None and not f.problems and sorted(listed) != sorted(complete):
            extra, missing = sorted(set(listed) - set(complete)), sorted(set(complete) - set(listed))
            f.fail(wdinfo_url, f"lists {len(listed)} tars, {len(complete)} are complete (not listed: {missing[:5]}, "
                   f"not complete: {extra[:5]})", stale=True)
    return f


def verify_precached_encodings(layout: Layout, chunk_size: int) -> Findings:
    """Every precached tar reads to its end with ``chunk_size`` samples; each complete balanced tar has an
    encoding made from its current samples, and no other encoding is left; its wdinfo loads."""
    from shardprep.nemo.precache import plan_precache

    f = Findings()
    if not storage.exists(layout.precached_dir):
        return f
    fs, root = storage.url_to_fs(layout.precached_dir)
    for path in sorted(p for p in fs.glob(f"{root}/*.tar")):
        url = f"{layout.precached_dir}/{path.rsplit('/', 1)[-1]}"
        keys = _read(f, url, sample_keys, "tar")
        if keys is not None and len(keys) != chunk_size:
            f.fail(url, f"{len(keys)} samples, expected {chunk_size}")
    plan = plan_precache(layout)
    for i in plan.todo:
        what = "was encoded before its samples changed" if i in plan.recorded else "has no encoding"
        f.fail(layout.precached_tar(i), f"balanced/{i:05d}.tar {what}", stale=True)
    for i in plan.gone:
        f.fail(layout.precached_tar(i), f"encodes balanced/{i:05d}.tar, which is not complete any more", stale=True)
    if storage.exists(layout.precached_wdinfo):
        found = verify_wdinfo(layout, layout.precached_dir, layout.precached_wdinfo)
        f.problems += found.problems
    return f


def verify_energon_index(dataset_dir: str) -> Findings:
    """The ``.nv-meta`` files are there, ``index.sqlite`` opens and counts what ``.info.json`` says,
    every indexed tar has its ``.tar.idx``, whole (one offset per sample, and the end), was not written
    again since it was indexed, and every complete tar of the folder is indexed."""
    from shardprep.energon import find_tars
    from shardprep.energon import format as fmt

    f = Findings()
    meta = f"{dataset_dir}/{fmt.META_DIR}"
    if not storage.exists(meta):
        return f
    for name in (fmt.INFO_JSON, fmt.INFO_YAML, fmt.SPLIT_YAML, fmt.DATASET_YAML, fmt.INDEX_SQLITE, fmt.INDEX_UUID):
        if not storage.exists(f"{meta}/{name}"):
            f.fail(f"{meta}/{name}", "missing")
    info = _read(f, f"{meta}/{fmt.INFO_JSON}", lambda u: json.loads(storage.read_bytes(u)), ".info.json")
    if f.problems or not isinstance(info, dict):
        return f
    counts = info.get("shard_counts", {})
    for tar, count in counts.items():
        idx = f"{dataset_dir}/{tar}.idx"
        if not storage.exists(idx):
            f.fail(idx, "missing (energon reads samples through it)")
        elif (size := storage.stat(idx)[0]) != 8 * (count + 1):
            f.fail(idx, f"{size} bytes, {count} samples need {8 * (count + 1)}")
    with tempfile.NamedTemporaryFile(suffix=".sqlite") as local:
        try:
            storage.fetch_file(f"{meta}/{fmt.INDEX_SQLITE}", local.name)
            with sqlite3.connect(local.name) as db:
                n = db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
            if n != sum(counts.values()):
                f.fail(f"{meta}/{fmt.INDEX_SQLITE}", f"{n} samples, .info.json counts {sum(counts.values())}")
        except (OSError, sqlite3.Error) as e:
            f.fail(f"{meta}/{fmt.INDEX_SQLITE}", f"unreadable sqlite: {type(e).__name__}: {e}")
    state = _read(f, f"{meta}/{fmt.STATE_JSON}", lambda u: json.loads(storage.read_bytes(u)), "index state")
    if isinstance(state, dict):
        for entry in state.get("tars", []):
            url = f"{dataset_dir}/{entry['name']}"
            try:
                if tuple(storage.stat(url)) != (entry["size"], entry["mtime"]):
                    f.fail(url, "changed since it was indexed (energon would read it at stale offsets)",
                           stale=True)
            except FileNotFoundError:
                f.fail(url, "indexed, but missing", stale=True)
        indexed = {e["name"] for e in state.get("tars", [])}
        unindexed = [t for t in find_tars(dataset_dir) if t not in indexed]
        if unindexed:
            f.fail(meta, f"{len(unindexed)} complete tar(s) not indexed: {unindexed[:5]}", stale=True)
    return f


def verify_selection(layout: Layout, cfg: DatasetConfig | None = None) -> Findings:
    """The selection state names its shards; each has its selection file, whole; (with ``cfg``) each
    was selected from its shard's current samples, scores and keep mask."""
    f = Findings()
    if not storage.exists(layout.selection_state):
        return f  # no rule: no selection
    state = _read(f, layout.selection_state, lambda u: json.loads(storage.read_bytes(u)), "selection state")
    if not isinstance(state, dict):
        return f
    for shard, entry in state.get("shards", {}).items():
        n = _read(f, layout.selection(shard), parquet_rows, "selection parquet")
        if n is not None and isinstance(entry, dict) and n != entry.get("kept", 0) + sum(entry.get("dropped", {}).values()):
            f.fail(layout.selection(shard), f"{n} rows, the selection state counts another number")
    if cfg is not None:
        from shardprep.curation.selection import active_rules, selection_inputs
        from shardprep.versions import artifact_versions

        now = selection_inputs(layout, artifact_versions(cfg), active_rules(cfg))
        for shard, entry in state.get("shards", {}).items():
            if isinstance(entry, dict) and now.get(shard) not in (None, entry.get("inputs")):
                f.fail(layout.selection(shard), "selected from samples, scores or a keep mask made again since",
                       stale=True)
    return f


def verify_duplicates(layout: Layout, cfg: DatasetConfig | None = None) -> Findings:
    """The dedup state names its shards; each has its keep mask, and the index and SQLite file are there;
    (with ``cfg``) each shard's embeddings are the ones it was de-duplicated with."""
    f = Findings()
    state = _read(f, layout.dedup_state, lambda u: json.loads(storage.read_bytes(u)), "dedup state")
    if not isinstance(state, dict):
        return f
    for url in (layout.dedup_index, layout.dedup_db, layout.dedup_table):
        if not storage.exists(url):
            f.fail(url, "missing")
    for shard in state.get("shards", {}):
        _read(f, layout.dedup_shard(shard), parquet_rows, "keep mask parquet")
    if cfg is not None:
        from shardprep.curation.dedup import embedded_shards
        from shardprep.versions import artifact_versions

        now = embedded_shards(layout, artifact_versions(cfg)["clip_embeddings"])
        changed = sorted(s for s, ident in state.get("shards", {}).items() if now.get(s) != ident)
        if changed:
            f.fail(layout.dedup_state, f"de-duplicated the embeddings of shard(s) {changed[:5]} as they were before "
                   "they were made again", stale=True)
    f.facts.update(dedup_shards=len(state.get("shards", {})))
    return f


def _missing(url: str) -> Findings:
    f = Findings()
    f.fail(url, "missing")
    return f


# ---------------------------------------------------------------- each artifact, as its record names it


@dataclass(frozen=True)
class Target:
    """What one check reads: an artifact's outputs for one shard (``ALL_SHARDS``: a global artifact's)."""

    layout: Layout
    cfg: DatasetConfig
    shard: str = ALL_SHARDS
    rows: int | None = None  # the shard's rows, as the ledger gives them
    read_tars: bool = True  # False: no tar is read (the dataset report over thousands of shards)


def check_source_parquet(t: Target) -> Findings:
    return verify_source_parquet(t.layout, t.shard, t.rows)


def check_image_shards(t: Target) -> Findings:
    return verify_image_shard(t.layout, t.shard, t.rows, read_tar=t.read_tars)


def check_video_shards(t: Target) -> Findings:
    return verify_video_shard(t.layout, t.shard, t.rows, read_tar=t.read_tars)


def check_clip_embeddings(t: Target) -> Findings:
    return verify_clip_embeddings(t.layout, t.shard, t.cfg.text_embeddings)


def check_reordered_embeddings(t: Target) -> Findings:
    return verify_reordered_embeddings(t.layout, t.shard, t.rows)


def check_image_scores(t: Target) -> Findings:
    return verify_image_scores(t.layout, t.shard, scored=bool(t.cfg.aesthetic_model or t.cfg.nsfw_model
                                                                        or t.cfg.watermark_model))


def check_captions(t: Target) -> Findings:
    return verify_captions(t.layout, t.shard, read_tar=t.read_tars)


def check_training_text(t: Target) -> Findings:
    return verify_training_text(t.layout, t.shard, read_tar=t.read_tars)


def check_diffusion_samples(t: Target) -> Findings:
    return verify_diffusion_samples(t.layout, t.shard) if t.read_tars else Findings()


def check_duplicates(t: Target) -> Findings:
    return verify_duplicates(t.layout, t.cfg) if t.cfg.dedup else Findings()


def check_sample_selection(t: Target) -> Findings:
    return verify_selection(t.layout, t.cfg)


def check_balanced_shards(t: Target) -> Findings:
    return verify_balanced_shards(t.layout, t.cfg)


def check_wdinfo(t: Target) -> Findings:
    from shardprep.nemo.balanced import complete_tar_counts

    return verify_wdinfo(t.layout, t.layout.balanced_dir, t.layout.balanced_wdinfo,
                         complete=sorted(complete_tar_counts(t.layout.balanced_dir)))


def check_precached_encodings(t: Target) -> Findings:
    return verify_precached_encodings(t.layout, t.cfg.tar_chunk_size)


def check_image_energon_index(t: Target) -> Findings:
    return verify_energon_index(t.layout.images_dir)


def check_diffusion_energon_index(t: Target) -> Findings:
    return verify_energon_index(t.layout.diffusion_dir)


def check_takedowns(t: Target) -> Findings:
    """Every registered list and audit record readable, and no sample an audit record names removed is in
    its shard's tar again (a header read of those tars only)."""
    from shardprep.takedown.lists import audit_records, registered

    f = Findings()
    try:
        registered(t.layout)
        records = audit_records(t.layout)
    except (OSError, ValueError) as e:
        f.fail(t.layout.takedowns_dir, f"unreadable: {type(e).__name__}: {e}")
        return f
    removed: dict[tuple[str, str], set[str]] = {}
    for record in records:
        for r in record.get("removed", []):
            removed.setdefault((r["shard"], r.get("media", "image")), set()).add(r["key"])
    for (shard, media), keys in removed.items():
        tar = t.layout.tar(shard) if media == "image" else t.layout.video_tar(shard)
        if not storage.exists(tar):
            continue
        back = sorted(k for k in sample_keys(tar) if k in keys or k.rpartition("_")[0] in keys)
        if back:
            f.fail(tar, f"holds {len(back)} taken-down sample(s) again: {back[:5]}")
    return f


def check_dataset_report(t: Target) -> Findings:
    return Findings() if storage.exists(t.layout.report_html) else _missing(t.layout.report_html)


def verify_shard(layout: Layout, cfg: DatasetConfig, artifact: str, shard: str, rows: int | None = None,
                 read_tars: bool = True, media: str = "image") -> Findings:
    """The cheap checks of ``artifact``'s outputs for ``shard``: the files its stamp recorded are all
    there at their recorded size, then the check its record names (``read_tars=False``: no tar is read,
    for the dataset report over thousands of shards). A shard of a ``media`` the artifact does not
    apply to has nothing to check."""
    f = Findings()
    if not ARTIFACTS[artifact].applies(media):
        return f
    stamp = read_stamp(layout, artifact, shard)
    if stamp:
        recorded_sizes(f, stamp.get("outputs", {}))
        if f.problems:
            return f
    found = _check(artifact, Target(layout, cfg, shard, rows, read_tars))
    found.problems = f.problems + found.problems
    return found


def verify_global(layout: Layout, cfg: DatasetConfig, artifact: str) -> Findings:
    """The cheap checks of an unpartitioned artifact's outputs, and whether they are in step with the
    per-shard outputs they were made from."""
    return _check(artifact, Target(layout, cfg))


def _check(artifact: str, target: Target) -> Findings:
    return globals()[ARTIFACTS[artifact].verify](target)
