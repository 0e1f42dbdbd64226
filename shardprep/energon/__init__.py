"""Megatron-Energon index of a webdataset folder, as ``energon prepare`` writes it, but incremental.

Modules: ``format`` (file names, documents, ``EnergonIndexError``), ``scan`` (a tar's rows from its
headers, ``.tar.idx``), ``splits`` (the split rule), ``sqlite_index`` (``index.sqlite``), ``update``
(``update_energon_index``, the only writer).

Under ``dataset_dir`` (see reference formats.md §7.1):

* ``{tar}.idx`` beside each tar: native-endian uint64 offsets of each sample's first header, plus the
  end offset of the last sample (``count + 1`` values), energon's ``TarIndexWriter`` format.
* ``.nv-meta/.info.json`` (energon 7: ``energon_version`` + ``shard_counts``) and ``.info.yaml``
  (``shard_counts`` only: energon <= 5.x, NeMo's pin 5.2, reads just this file and parses strictly).
* ``.nv-meta/split.yaml``: ``split_parts: {train: [...], val: [...], test: [...]}``, ``exclude: []``.
* ``.nv-meta/dataset.yaml``: ``CaptioningSample`` + ``field_map`` ("captioning") or
  ``CrudeWebdataset`` ("crude", cooked by a task encoder).
* ``.nv-meta/index.sqlite`` with energon 7's schema (``samples``, ``sample_parts`` and their indexes)
  and ``.nv-meta/index.uuid`` (a new uuid4 whenever the sqlite changes).
* ``.nv-meta/shardprep_index.json``: our bookkeeping (size + mtime, count and split of each indexed
  tar, the split rule, the uuid and sqlite size written), so an update scans only new or changed tars.

Tar scanning is energon's (``flavors/webdataset/prepare.py``): regular members only, names matching
``__*__`` skipped, key = path up to the basename's first dot (``000..pth`` is key ``000``, part
``.pth``), consecutive members with one key form a sample. Energon aborts on a key present in two
tars (or twice in one tar) and on a tar without samples; here both raise (``EnergonIndexError``, or
``TarReadError`` for a key twice in one tar) naming the tar(s) and key before anything is written.

Tar order (= energon's ``tar_file_id``): already indexed tars keep their position, new tars are
appended in sorted order, so existing sqlite rows and ``.tar.idx`` files stay valid and untouched.
A listed tar whose size or mtime changed is rescanned in place; a tar no longer listed loses its rows
(later tars move up). If the sqlite is not the one we wrote last (a crash mid-update, or an
``energon prepare`` since: checked via ``index.uuid`` and ``PRAGMA user_version``), every tar is
rescanned; ``.tar.idx`` files whose bytes come out the same are not rewritten.

Split rule (stable under updates). With ``split_patterns`` ({split: [regex, ...]}, ``re.match`` on
the tar path, like ``energon prepare --split-parts``) a tar goes to every split whose pattern matches.
With ``split_ratio`` (train, val, test; normalised) a tar keeps the split it was given before; a new
tar ``t`` goes by ``u = sha256(t)`` read as a fraction in [0, 1): train if ``u < r_train``, val if
``u < r_train + r_val``, else test. Then every split with a ratio > 0 that is still empty takes one
tar (a new one if possible; the one whose ``u`` is nearest to the split's interval) from the largest
split, as long as that split keeps at least one; so with a val ratio > 0 and >= 2 tars, val is never
empty. Changing the ratio or the patterns re-splits every tar.
"""

from shardprep.energon.format import (
    DEFAULT_FIELD_MAP,
    ENERGON_FORMAT_VERSION,
    META_DIR,
    SAMPLE_TYPES,
    SPLIT_NAMES,
    EnergonIndexError,
)
from shardprep.energon.scan import TarScan, read_tar_idx, scan_tar
from shardprep.energon.splits import assign_splits, collapse_names
from shardprep.energon.update import IndexReport, update_energon_index
from shardprep.tars import list_tars as find_tars

__all__ = ["DEFAULT_FIELD_MAP", "ENERGON_FORMAT_VERSION", "META_DIR", "SAMPLE_TYPES", "SPLIT_NAMES",
           "EnergonIndexError", "IndexReport", "TarScan", "assign_splits", "collapse_names", "find_tars",
           "read_tar_idx", "scan_tar", "update_energon_index"]
