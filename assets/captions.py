"""captions: a synthetic caption of every image from a vision-language model (``captioner``), and of every
video clip from a strip of its frames, kept beside the sample's original caption."""

import io

import dagster as dg

from shardprep.curation.captions import write_captions
from shardprep.curation.video_captions import unsupported_reason
from shardprep.ledger import shard_media
from shardprep.models.captioner import load_captioner
from shardprep.storage import exists, read_parquet
from shardprep.tars import read_samples_by_key
from shardprep.video.strips import VIDEO_EXTS, frame_strip
from shardprep_dagster.assets.scores import histogram_markdown
from shardprep_dagster.assets.shard_runs import (
    SHARD_AUTOMATION,
    ShardRunConfig,
    from_record,
    gpu_device_when_needed,
    materialize_shards,
)
from shardprep_dagster.resources.dataset import DatasetResource

SHEET_IMAGES = 12  # thumbnails in the asset's contact sheet
LENGTH_BINS = 10


def length_histograms(rows: list[dict]) -> dict[str, str]:
    """Markdown histograms of the captions' lengths in characters, original and synthetic, over the same
    bins (so the two compare)."""
    import numpy as np

    lengths = {name: [len(r[col]) for r in rows if r[col] is not None]
               for name, col in (("original", "original_caption"), ("synthetic", "caption"))}
    every = [n for values in lengths.values() for n in values]
    if not every:
        return {}
    edges = np.histogram_bin_edges(every, bins=LENGTH_BINS, range=(0, max(every) or 1)).tolist()
    out = {}
    for name, values in lengths.items():
        if values:
            counts = np.histogram(values, bins=edges)[0].tolist()
            out[f"{name}_caption_length_histogram"] = histogram_markdown(counts, edges).replace(
                "| score |", "| characters |", 1)
    return out


def _clip_samples(tar_url: str, shown: dict) -> list[tuple[str, bytes, tuple]]:
    """(key, PNG of the clip's middle frame, captions) of the clips named in ``shown``."""
    found, out = read_samples_by_key(tar_url, set(shown)), []
    for k, captions in shown.items():
        members = found.get(k, {})
        data = next((members[e] for e in VIDEO_EXTS if e in members), None)
        if data is None:
            continue
        try:
            buf = io.BytesIO()
            frame_strip(data, 1)[0].save(buf, "PNG")
            out.append((k, buf.getvalue(), captions))
        except Exception:  # noqa: BLE001 - a preview leaves out a clip it cannot decode
            continue
    return out


def sheet_metadata(layout, key: str, rows: list[dict], n: int = SHEET_IMAGES, media: str = "image") -> dict:
    """The shard's first ``n`` captioned images (a video shard: clips, by their middle frame) as an inline
    contact sheet, each with its synthetic and its original caption under it."""
    from shardprep.report.contact_sheet import ContactSheetError, inline_image, render_sheet, samples_of

    shown = {r["key"]: (f"VLM: {r['caption']}", f"src: {r['original_caption'] or ''}")
             for r in rows if r["caption"] is not None}
    shown = dict(list(shown.items())[:n])
    try:
        if media == "video":
            samples = _clip_samples(layout.video_tar(key), shown) if shown else []
        else:
            samples = samples_of(layout.tar(key), shown)
        if not samples:
            return {}
        uri, _ = inline_image(render_sheet(samples, thumb=128, lines=4))  # two lines per caption
        return {"captions_sheet": dg.MetadataValue.md(f"![captions of shard {key}]({uri})")}
    except (ContactSheetError, OSError) as e:
        return {"captions_sheet": dg.MetadataValue.text(f"(no contact sheet: {type(e).__name__}: {e})")}


def captions_metadata(layout, cfg, key: str, report, media: str, device_name: str, status: str = "written") -> dict:
    """The materialization metadata of a shard's captions, from ``write_captions``' report and the file it
    wrote (also ``assets.pixels``, for captions made from the clip step's decode)."""
    meta: dict = {"status": status, "media": media, "samples": report.samples, "captioned": report.captioned,
                  "skipped": len(report.skipped), "seconds": round(report.seconds, 3),
                  "path": dg.MetadataValue.path(layout.captions(key)), "dagster/row_count": report.samples,
                  "device": device_name, "model": cfg.captioner or "", "prompt": cfg.caption_prompt or "(none)"}
    if report.skipped:
        meta["skipped_samples"] = dg.MetadataValue.json(report.skipped[:20])
    rows = read_parquet(layout.captions(key)).to_pylist()
    meta.update({k: dg.MetadataValue.md(v) for k, v in length_histograms(rows).items()})
    meta.update(sheet_metadata(layout, key, rows, media=media))
    return meta


@dg.asset(
    **from_record("captions"),
    kinds={"parquet"},
    automation_condition=SHARD_AUTOMATION,
)
def captions(context: dg.AssetExecutionContext, config: ShardRunConfig, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/captions/{shard}.parquet``: a row per sample of the shard's tar, in tar order: ``key``,
    ``caption`` (the ``captioner`` model's, greedy, at most ``caption_max_new_tokens`` tokens, from
    ``caption_prompt`` when set), ``original_caption`` (the sample's .txt), ``model``, ``prompt`` and
    ``skip_reason`` (an image that cannot be decoded: no caption, the row kept). A video shard: a row per
    clip of its video tar, captioned from ``caption_video_frames`` frames by a chat VLM (a one-image
    model such as BLIP leaves every clip uncaptioned, its skip_reason says why). In the graph only when
    ``captioner`` is set."""
    cfg, layout = dataset.config, dataset.layout
    described = {"model": cfg.captioner or "", "prompt": cfg.caption_prompt or "(none)"}

    # the model is loaded (and a device leased) at the first shard that has images to caption
    with gpu_device_when_needed(context, dataset) as device:
        def caption(key: str) -> dict:
            media = shard_media(layout, [key])[key]
            if not exists(layout.video_tar(key) if media == "video" else layout.tar(key)):
                write_captions(key, layout, None, media=media)  # removes a stale file
                return {"status": f"no samples (shard has no {'video ' if media == 'video' else ''}tar)",
                        "samples": 0, **described}
            captioner = load_captioner(cfg.captioner, device().torch_device)
            report = write_captions(key, layout, captioner, batch_size=cfg.caption_batch_size,
                                    prompt=cfg.caption_prompt, max_new_tokens=cfg.caption_max_new_tokens,
                                    threads=cfg.decode_threads, media=media, video_frames=cfg.caption_video_frames)
            status = "written"
            if media == "video" and not captioner.multi_image:
                status = f"written, video captions unsupported ({unsupported_reason(captioner)})"
            return captions_metadata(layout, cfg, key, report, media, device().name, status)

        return materialize_shards(context, dataset, "captions", caption, rebuild=config.rebuild,
                                  describe=lambda key: described)
