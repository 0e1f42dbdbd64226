"""Synthetic-caption throughput on a GPU: BLIP-base- and BLIP-large-sized captioners with random weights
(no hub is reachable; the architecture, sizes, processor and generation are the published models'), saved
in the Hugging Face format and loaded the way the ``captions`` asset loads them (``load_captioner``:
bfloat16 on a GPU), captioning the images of webdataset tars end to end (``caption_tar``: read, decode
in threads one batch ahead, processor, greedy ``generate``). Random weights rarely emit the end token, so
every caption runs to ``max_new_tokens``: the figures are for captions of that length (an upper bound on
the work a trained model does per image).

    python bench/gpu_captions.py --out /tmp/captions.json [--device cuda] [--samples 2048] [--sizes base,large]

Reported per size: end-to-end images/s over the tar (after a warm-up tar), and model-only images/s
(``generate`` on a resident batch), so the decode/preprocess share is visible.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {  # BLIP's published configs (Salesforce/blip-image-captioning-base / -large)
    "base": {"vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
             "text": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)},
    "large": {"vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
              "text": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)},
}
VOCAB = 30524  # bert-base-uncased + [DEC], [ENC]


def build_blip(out: str, size: str) -> str:
    """A random-weight BLIP captioner of ``size`` saved to ``out`` (384 px images, a BERT-sized vocabulary)."""
    from tests.fixtures.tiny_blip import build_blip as build

    return build(out, [f"w{i}" for i in range(VOCAB - 7)], image_size=384, patch_size=16, projection_dim=512,
                 vision=SIZES[size]["vision"], text=SIZES[size]["text"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/gpu_captions_work")
    p.add_argument("--device", default="cuda")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--sizes", default="base,large")
    p.add_argument("--pass-images", type=int, default=0,
                   help="also time the one decode pass against three decodes on this many images (needs 'large')")
    a = p.parse_args(argv)

    import torch

    from bench.gpu import make_tars
    from shardprep.curation.captions import caption_tar
    from shardprep.models.captioner import load_captioner

    shards = make_tars(a.work, a.samples + a.batch * 2, a.samples)  # shard 00000: measured; 00001: warm-up
    tars = [os.path.join(a.work, "images", f"{s}.tar") for s in shards]
    results: dict = {"device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else a.device,
                     "samples": a.samples, "batch": a.batch, "max_new_tokens": a.tokens, "sizes": {}}
    for size in a.sizes.split(","):
        started = time.perf_counter()
        folder = build_blip(os.path.join(a.work, f"blip-{size}"), size)
        built = time.perf_counter() - started
        captioner = load_captioner(folder, a.device)
        params = sum(p.numel() for p in captioner.model.parameters())
        caption_tar(tars[-1], captioner, batch_size=a.batch, max_new_tokens=a.tokens)  # warm-up (kernels, allocator)

        def sync() -> None:
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()

        sync()
        t0 = time.perf_counter()
        rows = caption_tar(tars[0], captioner, batch_size=a.batch, max_new_tokens=a.tokens)
        sync()
        end_to_end = len(rows) / (time.perf_counter() - t0)
        lengths = [len(r["caption"].split()) for r in rows if r["caption"]]
        # model only: the same batch of decoded images captioned again and again (no reading or decoding)
        from PIL import Image

        from shardprep.tars import iter_samples

        images = [Image.open(io.BytesIO(s["jpg"])).convert("RGB")
                  for _, s in zip(range(a.batch), iter_samples(tars[0]))]
        inputs = captioner.processor(images=images, return_tensors="pt").to(a.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(captioner.model.dtype)
        reps = 3
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(reps):
                captioner.model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=a.tokens)
        sync()
        model_only = reps * len(images) / (time.perf_counter() - t0)
        results["sizes"][size] = {"params": params, "dtype": str(captioner.model.dtype),
                                  "images_per_second_end_to_end": round(end_to_end, 1),
                                  "images_per_second_model_only": round(model_only, 1),
                                  "mean_words_per_caption": round(sum(lengths) / max(len(lengths), 1), 1),
                                  "captioned": len(lengths), "build_seconds": round(built, 1)}
        print(json.dumps({size: results["sizes"][size]}), flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
        del captioner
        if size != "large" or not a.pass_images:  # the pass reuses the large one
            from shardprep.models import captioner as captioner_module

            captioner_module._CACHE.clear()
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if a.pass_images:
        results["pass"] = one_pass(a)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


def one_pass(a) -> dict:
    """Images/s of today's three steps (CLIP, watermark, captions, each decoding the shard) against the one
    decode pass, on real-size random models: CLIP ViT-L/14, LAION's EfficientNet-B3 detector, BLIP-large;
    photo-like images at original size (``bench/pixels.py``'s data)."""
    import torch

    from bench.models import VIT_L_14, build_random_clip
    from bench.pixels import agreement, end_to_end, make_tar
    from bench.source import make_site
    from shardprep.config import config_from_dict
    from shardprep.models.captioner import load_captioner
    from shardprep.models.clip import load_clip_encoder
    from shardprep.models.watermark import build_detector, load_watermark_model

    site_dir = os.path.join(a.work, "site")
    site = make_site(site_dir, 200, seed=0, workers=os.cpu_count() or 2)
    roots = [os.path.join(a.work, "pass", side) for side in ("separate", "shared", "warm-separate", "warm-shared")]
    for root, n in zip(roots, (a.pass_images, a.pass_images, 64, 64)):
        make_tar(root, site_dir, site, n)
    cfg = config_from_dict({"source": "/unused/*.parquet", "output_root": roots[0], "caption_batch_size": a.batch})
    encoder = load_clip_encoder(f"hf_clip:{build_random_clip(os.path.join(a.work, 'clip-l14'), VIT_L_14)}", a.device)
    torch.manual_seed(0)
    weights = os.path.join(a.work, "watermark_model_v1.pt")
    torch.save(build_detector().state_dict(), weights)
    detector = load_watermark_model(weights, a.device)
    captioner = load_captioner(os.path.join(a.work, "blip-large"), a.device)
    end_to_end(roots[2], roots[3], encoder, detector, captioner, cfg, shared_first=False)  # warm-up
    out = {"images": a.pass_images, "runs": []}
    for shared_first in (False, True):
        r = end_to_end(roots[0], roots[1], encoder, detector, captioner, cfg, shared_first)
        run = {k: round(v, 2) for k, v in r.items() if isinstance(v, float)}
        run["decodes"] = r["decodes"]
        run.update(agreement(roots[0], roots[1], r))
        out["runs"].append(run)
        print(json.dumps({"pass": run}), flush=True)
    best = {k: min(run[k] for run in out["runs"]) for k in ("separate", "shared")}
    out["images_per_second"] = {k: round(a.pass_images / v, 1) for k, v in best.items()}
    return out


if __name__ == "__main__":
    main()
