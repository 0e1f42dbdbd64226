"""The caption each sample trains with, when synthetic captions take part (config ``train_caption``).

``train_caption``:

* ``original``: the source's caption (the tar's ``.txt``), as img2dataset wrote it; nothing here runs;
* ``synthetic``: the captioner's caption (``captions/{shard}.parquet``), the original where the captioner
  has none (its image could not be decoded);
* ``both``: half the samples each, SD3's recipe of 50% original and 50% synthetic captions; which half is
  a function of the sample's key alone (``takes_synthetic``), so every run, machine and output agrees.

``write_training_text`` puts the choice where every training output reads it: each sample's ``.json`` in
the image tar gains ``synthetic_caption`` (next to the source's ``caption``), ``train_caption`` and
``train_caption_source``, the other members copied byte for byte (the ``.txt`` stays the original). The
NeMo diffusion samples (T5 states), the balanced tars (their ``.txt``) and the image energon dataset (its
``CaptioningSample.caption``, through a sample loader) read ``train_caption`` from there
(``train_text``). ``training_text/{shard}.parquet`` lists the choice per sample (key, train_caption,
source, caption, synthetic_caption) for people and for ``verify``.

For DALLE2-pytorch's prior loader, ``write_prior_text`` writes clip-retrieval's layout over the same rows
as the image embeddings (``embeddings/img_emb/img_emb_{shard}.npy``): ``training_text/metadata/
metadata_{shard}.parquet`` (``image_path``, ``caption`` = the training caption, ``caption_source``) for
``get_reader(text_conditioned=True, meta_url=...)``, and ``training_text/text_emb/text_emb_{shard}.npy``
(float16, L2-normalised CLIP text embeddings of it, as clip-retrieval makes them) for
``get_reader(text_conditioned=False, txt_url=...)``.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass

from shardprep.curation.captions import read_captions
from shardprep.keys import split_member_name
from shardprep.layout import Layout
from shardprep.sample_json import dumps_indented
from shardprep.storage import exists, remove, write_parquet
from shardprep.tars import rewrite_members

MODES = ("original", "synthetic", "both")
JSON_FIELDS = ("synthetic_caption", "train_caption", "train_caption_source")
COLUMNS = ("key", "train_caption", "source", "caption", "synthetic_caption")


def takes_synthetic(key: str, mode: str) -> bool:
    """Whether sample ``key`` trains with its synthetic caption under ``mode`` (when it has one)."""
    if mode == "both":
        return zlib.crc32(key.encode("utf-8")) % 2 == 1  # a fixed half, by key alone
    return mode == "synthetic"


def choose(key: str, original: str | None, synthetic: str | None, mode: str) -> tuple[str | None, str]:
    """``(text, source)``: the caption sample ``key`` trains with and where it comes from ("original" or
    "synthetic"); a sample without a synthetic caption keeps its original one."""
    if mode not in MODES:
        raise ValueError(f"train_caption must be one of {MODES}, got {mode!r}")
    if synthetic is not None and takes_synthetic(key, mode):
        return synthetic, "synthetic"
    return original, "original"


def train_text(meta: dict, original: str | None, synthetic_text: bool) -> str | None:
    """The caption a training output writes for a sample whose json is ``meta`` and ``.txt`` ``original``:
    the json's ``train_caption`` when synthetic captions take part (``cfg.synthetic_text``; a json written
    before ``training_text`` ran has none: its original), else the original."""
    if synthetic_text:
        chosen = meta.get("train_caption")
        if isinstance(chosen, str):
            return chosen
    return original


@dataclass
class TrainingTextReport:
    shard: str
    samples: int = 0  # samples listed (one per json member of the tar)
    synthetic: int = 0  # of which train with the synthetic caption
    without_synthetic: int = 0  # no synthetic caption (no captions row, or the captioner skipped it)
    jsons_rewritten: int = 0
    seconds: float = 0.0


def write_training_text(shard: str, layout: Layout, mode: str) -> TrainingTextReport:
    """Write ``mode``'s choice into the json members of ``layout.tar(shard)`` and list it in
    ``layout.training_text(shard)`` (module docstring). A shard without a tar gets no file (a stale one
    goes). The caller holds the image shard's lock: the tar is rewritten in place."""
    if mode not in MODES:
        raise ValueError(f"train_caption must be one of {MODES}, got {mode!r}")
    start = time.perf_counter()
    report = TrainingTextReport(shard=shard)
    tar, out = layout.tar(shard), layout.training_text(shard)
    if not exists(tar):
        remove(out)
        report.seconds = time.perf_counter() - start
        return report
    captions = read_captions(layout, shard)
    rows: list[dict] = []

    def rewrite(name: str, payload: bytes) -> bytes | None:
        key = (split_member_name(name) or (name, ""))[0]
        try:
            meta = json.loads(payload)
        except ValueError as e:
            raise ValueError(f"shard {shard}: {tar}: member {name} is not valid JSON ({e})") from None
        original = meta.get("caption") if isinstance(meta.get("caption"), str) else None
        row = captions.get(key, {})
        if original is None:
            original = row.get("original_caption")
        synthetic = row.get("caption")
        text, source = choose(key, original, synthetic, mode)
        rows.append({"key": key, "train_caption": text, "source": source, "caption": original,
                     "synthetic_caption": synthetic})
        new = {**{k: v for k, v in meta.items() if k not in JSON_FIELDS}, "synthetic_caption": synthetic,
               "train_caption": text, "train_caption_source": source}
        if new == meta and list(new) == list(meta):
            return None  # already so: the member is copied as it is
        return dumps_indented(new).encode("utf-8")

    report.jsons_rewritten = rewrite_members(tar, rewrite, lambda name: name.endswith(".json"))
    import pyarrow as pa

    string = pa.string()
    write_parquet(out, pa.table({c: pa.array([r[c] for r in rows], string) for c in COLUMNS}))
    report.samples = len(rows)
    report.synthetic = sum(r["source"] == "synthetic" for r in rows)
    report.without_synthetic = sum(r["synthetic_caption"] is None for r in rows)
    report.seconds = time.perf_counter() - start
    return report


def write_prior_text(shard: str, layout: Layout, encoder=None) -> int:
    """The DALLE2 prior's text of ``shard`` (module docstring), row for row with its image embeddings'
    metadata; ``encoder``: a ``models.clip.ClipEncoder`` for the text embeddings (None: no embeddings, a
    stale file goes). Returns the rows written (0: the shard has no embeddings, no file)."""
    import pyarrow as pa

    from shardprep.storage import read_parquet, write_npy

    meta_url, emb_url = layout.train_text_metadata(shard), layout.train_text_emb(shard)
    if not exists(layout.emb_metadata(shard)):
        remove(meta_url)
        remove(emb_url)
        return 0
    keys = read_parquet(layout.emb_metadata(shard), ["image_path"]).column("image_path").to_pylist()
    chosen = {r["key"]: r for r in read_parquet(layout.training_text(shard)).to_pylist()}
    missing = [k for k in keys if k not in chosen]
    if missing:
        raise ValueError(f"shard {shard}: {layout.emb_metadata(shard)} lists samples {missing[:3]} that "
                         f"{layout.training_text(shard)} does not (the embeddings are of another tar)")
    texts = [chosen[k]["train_caption"] for k in keys]
    if encoder is not None:
        # clip-retrieval embeds only samples with a caption; here every embedded sample has one (its
        # original at least), so the rows stay those of the image embeddings
        write_npy(emb_url, encoder.encode_texts([t or "" for t in texts]))
    else:
        remove(emb_url)
    string = pa.string()
    write_parquet(meta_url, pa.table({"image_path": pa.array(keys, string), "caption": pa.array(texts, string),
                                      "caption_source": pa.array([chosen[k]["source"] for k in keys], string)}))
    return len(keys)
