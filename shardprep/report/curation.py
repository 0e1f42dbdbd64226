"""The dataset report's curation section: score histograms, the highest and lowest scored images by
aesthetic score, duplicates side by side with the sample kept for them, and samples kept and dropped
per rule (``selection/summary.json``).

Scores are read from at most ``rows_per_shard`` evenly spaced rows of each shard's scores parquet (so
the top and bottom images are those of the rows read; the page says how many); thumbnails are read from
the image tars: their headers, then only the shown samples.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field

import numpy as np

from shardprep import storage
from shardprep.layout import Layout
from shardprep.report.html import fmt, hist, row, spaced

THUMBS = 8  # images per row of the top / bottom sheets
DUPLICATE_PAIRS = 8


@dataclass
class CurationData:
    aesthetic: np.ndarray = field(default_factory=lambda: np.zeros(0))
    nsfw: np.ndarray = field(default_factory=lambda: np.zeros(0))
    watermark: np.ndarray = field(default_factory=lambda: np.zeros(0))  # pwatermark
    top: list[tuple[str, float]] = field(default_factory=list)  # (key, aesthetic score), best first
    bottom: list[tuple[str, float]] = field(default_factory=list)  # worst first
    pairs: list[dict] = field(default_factory=list)  # duplicates.parquet rows
    duplicates: int = 0
    selection: dict | None = None  # selection/summary.json
    top_watermark: list[tuple[str, float]] = field(default_factory=list)  # (key, pwatermark), highest first
    # synthetic captions (captions): lengths in characters of the rows read, and a few samples with both
    original_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    synthetic_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    captioned: list[tuple[str, str, str]] = field(default_factory=list)  # (key, synthetic, original)
    thumbs: dict[str, str] = field(default_factory=dict)  # key -> base64 JPEG

    @property
    def empty(self) -> bool:
        return not (self.aesthetic.size or self.nsfw.size or self.watermark.size or self.duplicates or self.selection
                    or self.synthetic_lengths.size)


def collect_curation(layout: Layout, shards: list[str], rows_per_shard: int) -> CurationData:
    """What image_scores, duplicates and sample_selection wrote for ``shards`` (image shards)."""

    data = CurationData()
    keys, aesthetic, nsfw, watermark, watermark_keys = [], [], [], [], []
    lengths: dict[str, list[int]] = {"synthetic": [], "original": []}
    for shard in shards:
        _read_captions(layout, shard, rows_per_shard, data, lengths)
        url = layout.scores(shard)
        if not storage.exists(url):
            continue
        t = storage.read_parquet(url)
        t = t.take(spaced(t.num_rows, rows_per_shard))
        if "aesthetic_score" in t.column_names:
            keys += t.column("key").to_pylist()
            aesthetic.append(t.column("aesthetic_score").to_numpy(zero_copy_only=False))
        if "nsfw_score" in t.column_names:
            nsfw.append(t.column("nsfw_score").to_numpy(zero_copy_only=False))
        if "pwatermark" in t.column_names:
            watermark_keys += t.column("key").to_pylist()
            watermark.append(t.column("pwatermark").to_numpy(zero_copy_only=False))
    data.synthetic_lengths = np.array(lengths["synthetic"], dtype=np.float64)
    data.original_lengths = np.array(lengths["original"], dtype=np.float64)
    if aesthetic:
        data.aesthetic = np.concatenate(aesthetic).astype(np.float64)
        order = [i for i in np.argsort(data.aesthetic) if np.isfinite(data.aesthetic[i])]
        data.top = [(keys[i], float(data.aesthetic[i])) for i in order[::-1][:THUMBS]]
        data.bottom = [(keys[i], float(data.aesthetic[i])) for i in order[:THUMBS]]
    if nsfw:
        data.nsfw = np.concatenate(nsfw).astype(np.float64)
    if watermark:
        data.watermark = np.concatenate(watermark).astype(np.float64)
        order = [i for i in np.argsort(data.watermark)[::-1] if np.isfinite(data.watermark[i])]
        data.top_watermark = [(watermark_keys[i], float(data.watermark[i])) for i in order[:THUMBS]]
    if storage.exists(layout.dedup_table):
        t = storage.read_parquet(layout.dedup_table)
        data.duplicates = t.num_rows
        data.pairs = t.slice(0, DUPLICATE_PAIRS).to_pylist()
    text = storage.read_text(layout.selection_summary)
    data.selection = json.loads(text) if text else None
    wanted = ({k for k, _ in data.top + data.bottom + data.top_watermark} | {k for k, _, _ in data.captioned}
              | {p[c] for p in data.pairs for c in ("key", "kept_key")})
    data.thumbs = _thumbnails(layout, wanted, shards)
    return data


def _read_captions(layout: Layout, shard: str, rows_per_shard: int, data: CurationData,
                   lengths: dict[str, list[int]]) -> None:
    """The shard's synthetic captions (``captions``): the lengths of the rows read added to ``lengths``,
    the first few for the sheet to ``data``."""
    url = layout.captions(shard)
    if not storage.exists(url):
        return
    t = storage.read_parquet(url, ["key", "caption", "original_caption"])
    t = t.take(spaced(t.num_rows, rows_per_shard))
    rows = t.to_pylist()
    lengths["synthetic"] += [len(r["caption"]) for r in rows if r["caption"] is not None]
    lengths["original"] += [len(r["original_caption"]) for r in rows if r["original_caption"] is not None]
    for r in rows:
        if len(data.captioned) >= THUMBS:
            break
        if r["caption"] is not None:
            data.captioned.append((r["key"], r["caption"], r["original_caption"] or ""))


def _thumbnails(layout: Layout, keys: set[str], shards: list[str], size: int = 96) -> dict[str, str]:
    """Base64 JPEG thumbnails of ``keys``, read from their shards' tars (a key starts with its shard id)."""
    from PIL import Image

    from shardprep.report.contact_sheet import image_of
    from shardprep.tars import read_samples_by_key

    by_shard: dict[str, set[str]] = {}
    for key in keys:
        shard = next((s for s in shards if key.startswith(s)), None)
        if shard is not None:
            by_shard.setdefault(shard, set()).add(key)
    out = {}
    for shard, wanted in by_shard.items():
        if not storage.exists(layout.tar(shard)):
            continue
        for key, sample in read_samples_by_key(layout.tar(shard), wanted).items():
            try:
                with Image.open(io.BytesIO(image_of(sample))) as im:
                    im = im.convert("RGB")
                    im.thumbnail((size, size))
                    buf = io.BytesIO()
                    im.save(buf, "JPEG", quality=85)
                out[key] = base64.b64encode(buf.getvalue()).decode("ascii")
            except Exception:  # noqa: BLE001 - a thumbnail that cannot be made is left out
                continue
    return out


def _thumb(data: CurationData, key: str, caption: str) -> str:
    img = (f'<img src="data:image/jpeg;base64,{data.thumbs[key]}" alt="{html.escape(key)}">'
           if key in data.thumbs else "<div>(no image)</div>")
    return f'<figure class="thumb">{img}<figcaption>{html.escape(caption)}</figcaption></figure>'


def curation_section(data: CurationData) -> list[str]:
    """HTML of the section."""
    if data.empty:
        return []
    parts = ["<h2>Curation</h2>"]
    for pid, values, title, xlabel in (("aesthetic_scores", data.aesthetic, "Aesthetic score", "score (1-10 scale)"),
                                       ("nsfw_scores", data.nsfw, "NSFW score", "probability unsafe"),
                                       ("watermark_scores", data.watermark, "Watermark score (pwatermark)",
                                        "probability watermarked")):
        if values.size:
            png = hist(values[np.isfinite(values)], title, xlabel, "scores")
            parts.append(f'<figure id="{pid}"><img src="data:image/png;base64,{png}" alt="{title}">'
                         f"<figcaption>{title} ({values.size:,} samples read)</figcaption></figure>")
    for pid, title, items in (("top_aesthetic", "Highest aesthetic scores", data.top),
                              ("bottom_aesthetic", "Lowest aesthetic scores", data.bottom),
                              ("top_watermark", "Highest watermark scores (pwatermark)", data.top_watermark)):
        if items:
            parts += [f"<h3>{title}</h3>", f'<div id="{pid}">',
                      *[_thumb(data, k, f"{k}: {s:.3f}") for k, s in items], "</div>"]
    if data.synthetic_lengths.size:
        parts.append("<h3>Synthetic captions</h3>")
        top = max(data.synthetic_lengths.max(), data.original_lengths.max() if data.original_lengths.size else 0)
        for pid, values, title in (("synthetic_caption_lengths", data.synthetic_lengths, "Synthetic caption length"),
                                   ("original_caption_lengths", data.original_lengths, "Original caption length")):
            if values.size:  # the same bins for both, so they compare
                png = hist(values, title, "characters", "captions", value_range=(0.0, float(top) or 1.0))
                parts.append(f'<figure id="{pid}"><img src="data:image/png;base64,{png}" alt="{title}">'
                             f"<figcaption>{title} ({values.size:,} captions read)</figcaption></figure>")
        parts += ['<div id="captions">', *[_thumb(data, k, f"VLM: {syn} | src: {orig}") for k, syn, orig in data.captioned],
                  "</div>"]
    if data.duplicates:
        parts += [f"<h3>Duplicates ({data.duplicates:,}; the first {len(data.pairs)})</h3>", '<table id="duplicates">',
                  row(["dropped", "kept", "reason", "similarity"], header=True)]
        for p in data.pairs:
            parts.append(f"<tr><td>{_thumb(data, p['key'], p['key'])}</td><td>{_thumb(data, p['kept_key'], p['kept_key'])}"
                         f"</td><td>{html.escape(str(p['reason']))}</td><td>{p['similarity']:.4f}</td></tr>")
        parts.append("</table>")
    if data.selection:
        s = data.selection
        total = s["kept"] + s["dropped"]
        parts += [f"<h3>Selection: {s['kept']:,} of {total:,} samples kept</h3>", '<table id="selection">',
                  row(["rule", "value", "samples failing it", "dropped by it first"], header=True),
                  *[row([r, v, fmt(s["failing_by_rule"].get(r, 0)), fmt(s["dropped_by_rule"].get(r, 0))])
                    for r, v in s["rules"].items() if r != "dedup_threshold"], "</table>"]
    return parts
