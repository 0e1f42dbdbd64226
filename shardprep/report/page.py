"""The dataset report: one self-contained HTML page (``<root>/report/index.html``) with what the shards
hold: success rate per shard, failures by reason, original image sizes, caption lengths, CLIP
embedding norms, and a summary table; curation (score histograms, top and bottom images by aesthetic
score, duplicates side by side, samples kept per rule: ``curation_report``); for video shards,
videos, clips and clip durations.

Counts (samples, successes, failures by reason) are exact: they come from every shard's
``_stats.json``. The distributions read at most ``rows_per_shard`` evenly spaced rows of each shard's
parquet and embeddings, so a report over thousands of shards stays cheap; the page says how many rows
each plot is drawn from.
"""

from __future__ import annotations

import html
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from shardprep.artifacts import ARTIFACTS
from shardprep.config import DatasetConfig
from shardprep.layout import Layout
from shardprep.ledger import load_ledger, shard_media
from shardprep.report.curation import CurationData, collect_curation, curation_section
from shardprep.report.html import empty, figure, fmt, hist, png, row, spaced
from shardprep.storage import atomic_write, read_npy, url_to_fs
from shardprep.takedown.lists import REMOVED
from shardprep.verify import verify_shard
from shardprep.versions import stamped_version
from shardprep.video.summary import clip_jsons

ROWS_PER_SHARD = 2000
PARQUET_COLUMNS = ("status", "original_width", "original_height", "caption")


@dataclass
class ShardFigures:
    shard: str
    processed: bool = False  # image_shards wrote its stats (the shard is complete)
    count: int = 0
    successes: int = 0
    failed_to_download: int = 0
    failed_to_resize: int = 0
    seconds: float = 0.0
    tar_bytes: int = 0
    embeddings: int | None = None  # rows of img_emb (None: not embedded yet)
    retry_rounds: int = 0  # `shardprep retry` rounds that changed the shard
    removed: int = 0  # samples removed for a takedown

    @property
    def success_rate(self) -> float:
        return self.successes / self.count if self.count else 0.0


@dataclass
class VideoShardFigures:
    shard: str
    processed: bool = False  # video_shards wrote its stats
    count: int = 0  # input rows (videos)
    successes: int = 0
    failed_to_download: int = 0
    failed_to_subsample: int = 0
    clips: int = 0
    clip_seconds: float = 0.0
    frames: int = 0
    seconds: float = 0.0
    tar_bytes: int = 0


@dataclass
class ReportData:
    root: str
    shards: list[ShardFigures]
    failures_by_reason: Counter
    original_widths: np.ndarray
    original_heights: np.ndarray
    caption_lengths: np.ndarray
    embedding_norms: np.ndarray
    embedding_dim: int | None = None
    parquet_rows_read: int = 0
    rows_per_shard: int = ROWS_PER_SHARD
    problems: list[str] = field(default_factory=list)  # unreadable files, named
    videos: list[VideoShardFigures] = field(default_factory=list)  # the video shards (``shards``: image ones)
    clip_durations: np.ndarray = field(default_factory=lambda: np.zeros(0))
    curation: CurationData = field(default_factory=CurationData)  # scores, duplicates, selection
    # per takedown list: version, source, entries, samples removed, last applied (shardprep.takedown)
    takedowns: list[dict] = field(default_factory=list)

    @property
    def video_totals(self) -> dict:
        done = [v for v in self.videos if v.processed]
        count, seconds = sum(v.count for v in done), sum(v.seconds for v in done)
        clips = sum(v.clips for v in done)
        d = self.clip_durations
        return {
            "video_shards": len(self.videos),
            "video_shards_processed": len(done),
            "videos": count,
            "video_successes": sum(v.successes for v in done),
            "failed_to_download": sum(v.failed_to_download for v in done),
            "failed_to_subsample": sum(v.failed_to_subsample for v in done),
            "clips": clips,
            "clip_seconds": round(sum(v.clip_seconds for v in done), 3),
            "clip_seconds_min": round(float(d.min()), 3) if d.size else 0.0,
            "clip_seconds_max": round(float(d.max()), 3) if d.size else 0.0,
            "frames": sum(v.frames for v in done),
            "tar_bytes": sum(v.tar_bytes for v in done),
            "clips_per_second": round(clips / seconds, 2) if seconds else 0.0,
        }

    @property
    def totals(self) -> dict:
        done = [s for s in self.shards if s.processed]
        count = sum(s.count for s in done)
        successes = sum(s.successes for s in done)
        seconds = sum(s.seconds for s in done)
        return {
            "shards": len(self.shards),
            "shards_processed": len(done),
            "shards_embedded": sum(1 for s in self.shards if s.embeddings is not None),
            "samples": count,
            "successes": successes,
            "failed_to_download": sum(s.failed_to_download for s in done),
            "failed_to_resize": sum(s.failed_to_resize for s in done),
            "success_rate": round(successes / count, 4) if count else 0.0,
            "embeddings": sum(s.embeddings or 0 for s in self.shards),
            "embedding_dim": self.embedding_dim,
            "tar_bytes": sum(s.tar_bytes for s in done),
            "download_seconds": round(seconds, 3),
            "images_per_second": round(count / seconds, 1) if seconds else 0.0,
        }


def collect(layout: Layout, shards: list[str] | None = None, rows_per_shard: int = ROWS_PER_SHARD,
            cfg: DatasetConfig | None = None) -> ReportData:
    """Read what every shard has written so far. ``shards`` defaults to the ledger's; a shard whose
    outputs are missing is counted as not processed, a shard whose files cannot be read is named in
    ``problems`` (the report still comes out). With ``cfg``, every finished output of a shard is also
    checked as ``shardprep verify`` checks it (no tar read: recorded sizes, footers, headers)."""
    if shards is None:
        ledger = load_ledger(layout)
        shards = ledger.keys() if ledger is not None else []
    media = shard_media(layout, shards)
    figures, reasons, problems = [], Counter(), []
    videos, durations = [], []
    widths, heights, captions, norms = [], [], [], []
    dim, rows_read = None, 0
    for key in shards:
        if media[key] == "video":
            videos.append(_video_figures(layout, key, reasons, durations, problems))
            if cfg is not None:
                problems += _broken_outputs(layout, cfg, key, "video")
            continue
        fig = ShardFigures(key)
        figures.append(fig)
        fs, stats_path = url_to_fs(layout.shard_stats(key))
        if fs.exists(stats_path):
            try:
                with fs.open(stats_path, "rb") as f:
                    stats = json.loads(f.read())
                fig.processed = True
                fig.count, fig.successes = int(stats["count"]), int(stats["successes"])
                fig.failed_to_download = int(stats.get("failed_to_download", 0))
                fig.failed_to_resize = int(stats.get("failed_to_resize", 0))
                fig.seconds = float(stats.get("duration") or 0.0)
                fig.retry_rounds = int(stats.get("retry_round", 0))
                fig.removed = int(stats.get("status_dict", {}).get(REMOVED, 0))
                reasons.update({k: int(v) for k, v in stats.get("status_dict", {}).items() if k != "success"})
            except (OSError, ValueError, KeyError, TypeError) as e:
                problems.append(f"shard {key}: {layout.shard_stats(key)}: {type(e).__name__}: {e}")
                fig.processed = False
        if fig.processed:
            tar_fs, tar_path = url_to_fs(layout.tar(key))
            fig.tar_bytes = tar_fs.size(tar_path) if tar_fs.exists(tar_path) else 0
            try:
                pq_fs, pq_path = url_to_fs(layout.shard_parquet(key))
                with pq_fs.open(pq_path, "rb") as f:
                    pf = pq.ParquetFile(f)
                    cols = [c for c in PARQUET_COLUMNS if c in pf.schema_arrow.names]
                    table = pf.read(columns=cols)
                rows = table.take(spaced(table.num_rows, rows_per_shard))
                rows_read += rows.num_rows
                ok = np.asarray(rows.column("status").to_pylist()) == "success"
                if "original_width" in cols:
                    widths.append(np.asarray(rows.column("original_width").to_pandas(), dtype=float)[ok])
                    heights.append(np.asarray(rows.column("original_height").to_pandas(), dtype=float)[ok])
                if "caption" in cols:
                    captions.append(np.array([len(c) if c is not None else 0
                                              for c in rows.column("caption").to_pylist()]))
            except (OSError, ValueError, KeyError) as e:
                problems.append(f"shard {key}: {layout.shard_parquet(key)}: {type(e).__name__}: {e}")
        emb_fs, emb_path = url_to_fs(layout.img_emb(key))
        if emb_fs.exists(emb_path):
            try:
                emb = read_npy(layout.img_emb(key), mmap=True)  # locally only the sampled rows are read
                fig.embeddings, dim = int(emb.shape[0]), int(emb.shape[1])
                sample = np.asarray(emb[spaced(emb.shape[0], rows_per_shard)], dtype=np.float32)
                norms.append(np.linalg.norm(sample, axis=1))
            except (OSError, ValueError, IndexError) as e:
                problems.append(f"shard {key}: {layout.img_emb(key)}: {type(e).__name__}: {e}")

        if cfg is not None:
            problems += _broken_outputs(layout, cfg, key)

    def cat(parts: list) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0)

    widths_a, heights_a = cat(widths), cat(heights)
    keep = ~(np.isnan(widths_a) | np.isnan(heights_a)) if widths_a.size else np.zeros(0, dtype=bool)
    try:
        curation = collect_curation(layout, [f.shard for f in figures], rows_per_shard)
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"curation outputs: {type(e).__name__}: {e}")
        curation = CurationData()
    try:
        takedowns = takedown_summary(layout)
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"takedown records: {type(e).__name__}: {e}")
        takedowns = []
    return ReportData(layout.root, figures, reasons, widths_a[keep], heights_a[keep], cat(captions), cat(norms),
                      dim, rows_read, rows_per_shard, problems, videos, np.asarray(durations, dtype=float), curation,
                      takedowns)


def takedown_summary(layout: Layout) -> list[dict]:
    """Per registered takedown list: its version, source, entries, the samples its applications removed
    and when it was last applied (from the audit records)."""
    from shardprep.takedown.lists import audit_records, registered

    removed: Counter = Counter()
    applied: dict[str, float] = {}
    for record in audit_records(layout):
        for r in record.get("removed", []):
            removed[r["list"]] += 1
            applied[r["list"]] = max(applied.get(r["list"], 0.0), float(record.get("applied_at", 0.0)))
    return [{"version": lst.version, "source": lst.source, "entries": len(lst.entries),
             "removed": removed[lst.version], "registered_at": lst.registered_at,
             "last_applied": applied.get(lst.version)} for lst in registered(layout)]


def _video_figures(layout: Layout, key: str, reasons: Counter, durations: list[float],
                   problems: list[str]) -> VideoShardFigures:
    """A video shard's counts from its ``_stats.json``, its clips' durations from the tar's json members."""
    fig = VideoShardFigures(key)
    fs, stats_path = url_to_fs(layout.video_stats(key))
    if not fs.exists(stats_path):
        return fig
    try:
        with fs.open(stats_path, "rb") as f:
            stats = json.loads(f.read())
        fig.count, fig.successes = int(stats["count"]), int(stats["successes"])
        fig.failed_to_download = int(stats.get("failed_to_download", 0))
        fig.failed_to_subsample = int(stats.get("failed_to_subsample", 0))
        fig.seconds = float(stats.get("duration") or 0.0)
        shard_reasons = {k: int(v) for k, v in stats.get("status_dict", {}).items() if k != "success"}
        tar_fs, tar_path = url_to_fs(layout.video_tar(key))
        if tar_fs.exists(tar_path):
            fig.tar_bytes = tar_fs.size(tar_path)
            clips = clip_jsons(layout.video_tar(key))
            fig.clips = len(clips)
            fig.frames = sum(int(c.get("num_frames") or 0) for c in clips)
            shard_durations = [float(c.get("duration") or 0.0) for c in clips]
            fig.clip_seconds = sum(shard_durations)
            durations += shard_durations
        reasons.update(shard_reasons)
        fig.processed = True
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"shard {key}: {layout.video_stats(key)} or its tar: {type(e).__name__}: {e}")
    return fig


def _broken_outputs(layout: Layout, cfg: DatasetConfig, shard: str, media: str = "image") -> list[str]:
    out = []
    for artifact in (a.name for a in ARTIFACTS.values() if a.reported):
        if stamped_version(layout, artifact, shard) is not None:  # finished: its outputs must be whole
            found = verify_shard(layout, cfg, artifact, shard, read_tars=False, media=media)
            out += [f"shard {shard}: {artifact}: {p}" for p in found.problems]
    return out


# -- plots: matplotlib's object API (no pyplot: no global state, safe in any thread) --------------------------

def plot_success_rate(data: ReportData) -> str:
    fig, ax = figure()
    done = [s for s in data.shards if s.processed]
    if done:
        x = np.arange(len(done))
        rates = [s.success_rate * 100 for s in done]
        if len(done) <= 200:
            ax.bar(x, rates, color="#4c72b0")
        else:
            ax.plot(x, rates, ".", markersize=2, color="#4c72b0")
        step = max(1, len(done) // 20)
        ax.set_xticks(x[::step], [s.shard for s in done][::step], rotation=60, fontsize=7)
        ax.set_ylim(0, 100)
        ax.set_ylabel("success rate (%)")
        ax.set_xlabel("shard")
    else:
        empty(ax, "processed shards")
    ax.set_title("Success rate per shard")
    return png(fig)


def plot_failures(data: ReportData, top: int = 15) -> str:
    items = data.failures_by_reason.most_common(top)
    fig, ax = figure(height=max(2.0, 0.35 * len(items) + 1))
    if items:
        labels = [r if len(r) <= 60 else r[:57] + "..." for r, _ in items][::-1]
        ax.barh(np.arange(len(items)), [n for _, n in items][::-1], color="#c44e52")
        ax.set_yticks(np.arange(len(items)), labels, fontsize=7)
        ax.set_xlabel("samples")
    else:
        empty(ax, "failures")
    more = len(data.failures_by_reason) - len(items)
    ax.set_title("Failures by reason" + (f" (top {top}; {more} more reasons)" if more > 0 else ""))
    return png(fig)


def plot_image_sizes(data: ReportData) -> str:
    fig, ax = figure()
    w, h = data.original_widths, data.original_heights
    if w.size:
        hi = max(float(w.max()), float(h.max()), 1.0)
        bins = np.linspace(0, hi, 41)
        ax.hist(w, bins=bins, histtype="step", linewidth=1.5, label="width")
        ax.hist(h, bins=bins, histtype="step", linewidth=1.5, label="height")
        ax.legend()
        ax.set_xlabel("pixels (original, before resize)")
        ax.set_ylabel("images")
    else:
        empty(ax, "downloaded images")
    ax.set_title(f"Original image size ({w.size} images)")
    return png(fig)


# -- the page ---------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
figure{display:inline-block;margin:0.5em;vertical-align:top}figcaption{font-size:0.85em;color:#555}
.problems{color:#a00}
figure.thumb{margin:0.2em}figure.thumb figcaption{font-size:0.7em}
"""


def render_html(data: ReportData, generated_at: float | None = None) -> str:
    totals = data.totals
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(generated_at or time.time()))
    plots = [
        ("success_rate", "Success rate per shard", plot_success_rate(data)),
        ("failures", "Failures by reason", plot_failures(data)),
        ("image_sizes", "Original image width and height", plot_image_sizes(data)),
        ("caption_lengths", "Caption length",
         hist(data.caption_lengths, "Caption length", "characters", "captions")),
        ("embedding_norms", "CLIP image embedding L2 norm",
         hist(data.embedding_norms, "Image embedding norm", "L2 norm", "embeddings")),
    ]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>shardprep dataset report: {html.escape(data.root)}</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>Dataset report</h1>",
        f"<p>Output root <code>{html.escape(data.root)}</code>, generated {html.escape(stamp)}.</p>",
        "<h2>Summary</h2>", '<table id="summary">', row(["", "value"], header=True),
        *[row([k.replace("_", " "), f"{v:.2%}" if k == "success_rate" else fmt(v)]) for k, v in totals.items()],
        "</table>",
        f"<p>Distributions are drawn from {data.parquet_rows_read:,} parquet rows "
        f"(at most {data.rows_per_shard:,} evenly spaced rows per shard); counts are exact.</p>",
    ]
    if data.problems:
        parts += ['<h2 class="problems">Broken or unreadable files</h2><ul class="problems">',
                  *[f"<li>{html.escape(p)}</li>" for p in data.problems], "</ul>"]
    parts.append("<h2>Plots</h2>")
    for pid, caption, image in plots:
        parts.append(f'<figure id="{pid}"><img src="data:image/png;base64,{image}" alt="{html.escape(caption)}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts += ["<h2>Failures by reason</h2>", '<table id="failures">', row(["reason", "samples"], header=True),
              *[row([r, fmt(n)]) for r, n in data.failures_by_reason.most_common()], "</table>"]
    parts += ["<h2>Shards</h2>", '<table id="shards">',
              row(["shard", "samples", "successes", "success rate", "failed to download", "failed to resize",
                    "removed (takedown)", "retry rounds", "embeddings", "tar bytes"], header=True)]
    for s in data.shards:
        if s.processed:
            parts.append(row([s.shard, fmt(s.count), fmt(s.successes), f"{s.success_rate:.2%}",
                               fmt(s.failed_to_download), fmt(s.failed_to_resize), fmt(s.removed),
                               fmt(s.retry_rounds), fmt(s.embeddings), fmt(s.tar_bytes)]))
        else:
            parts.append(row([s.shard, "not processed", "", "", "", "", "", "", fmt(s.embeddings), ""]))
    parts.append("</table>")
    if data.takedowns:
        parts += ["<h2>Takedowns</h2>", '<table id="takedowns">',
                  row(["list version", "source", "entries", "samples removed", "registered", "last applied"],
                      header=True),
                  *[row([t["version"], t["source"], fmt(t["entries"]), fmt(t["removed"]), _when(t["registered_at"]),
                         _when(t["last_applied"])]) for t in data.takedowns], "</table>",
                  "<p>Audit records (keys, URLs, reasons, list versions): "
                  "<code>.shardprep/takedowns/audit/</code> under the output root.</p>"]
    parts += curation_section(data.curation)
    if data.videos:
        parts += _video_section(data)
    parts.append("</body></html>")
    return "\n".join(parts)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else ""


def _video_section(data: ReportData) -> list[str]:
    png = hist(data.clip_durations, "Clip duration", "seconds", "clips", bins=30)
    parts = ["<h2>Videos</h2>", '<table id="video_summary">', row(["", "value"], header=True),
             *[row([k.replace("_", " "), fmt(v)]) for k, v in data.video_totals.items()], "</table>",
             f'<figure id="clip_durations"><img src="data:image/png;base64,{png}" alt="Clip duration">'
             "<figcaption>Clip duration (every clip)</figcaption></figure>",
             '<table id="video_shards">',
             row(["shard", "videos", "successes", "failed to download", "failed to subsample", "clips",
                   "clip seconds", "frames", "tar bytes"], header=True)]
    for v in data.videos:
        if v.processed:
            parts.append(row([v.shard, fmt(v.count), fmt(v.successes), fmt(v.failed_to_download),
                               fmt(v.failed_to_subsample), fmt(v.clips), fmt(round(v.clip_seconds, 3)),
                               fmt(v.frames), fmt(v.tar_bytes)]))
        else:
            parts.append(row([v.shard, "not processed", "", "", "", "", "", "", ""]))
    return [*parts, "</table>"]


def write_report(layout: Layout, shards: list[str] | None = None,
                 rows_per_shard: int = ROWS_PER_SHARD, cfg: DatasetConfig | None = None) -> ReportData:
    """Collect every shard's figures and write ``layout.report_html`` (atomically); returns the data."""
    data = collect(layout, shards, rows_per_shard, cfg)
    page = render_html(data)
    with atomic_write(layout.report_html) as f:
        f.write(page.encode("utf-8"))
    return data
