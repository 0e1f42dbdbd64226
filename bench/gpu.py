"""CLIP embedding throughput on a GPU, end to end from tars, for ViT-B/32- and ViT-L/14-sized models
with random weights (``bench.models``): images/s and model FLOP utilisation (MFU).

Run by ``bench/run.py`` when CUDA is available (``--only gpu``), as the driver side ``clip-gpu``.
End to end = ``write_clip_embeddings`` over the tars (read, decode on every CPU core, copy uint8
to the GPU, normalise there, bf16 autocast forward of both towers, write the npy/parquet files).
Model only = the image tower on a resident batch (the ceiling the end-to-end figure is read
against). MFU = images/s x FLOPs per image / the GPU's dense bf16 peak.

Preparing (decode, resize, crop, tokenise) runs in worker processes (``shardprep.prepare_pool``, the
default with a GPU) or in threads: setting ``prepare`` picks the end-to-end mode(s), and ``prepare_only``
(images/s of ``write_clip_embeddings`` with the model's encode calls replaced by zeros: the same tars,
the same preparing, copies and files, no model) is measured for both modes side by side.
"""

from __future__ import annotations

import copy
import io
import json
import os
import tarfile
import time

# dense bf16 tensor-core peaks (no sparsity), FLOP/s
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _peak(name: str) -> float | None:
    return next((v for k, v in PEAKS.items() if k in name), None)


def make_tars(root: str, n_samples: int, per_tar: int, n_unique: int = 256) -> list[str]:
    """img2dataset-like tars of 256 px photo-like JPEGs under ``root/images``; returns shard names."""
    from shardprep.keys import compute_key, oom_sample_per_shard
    from tests.fixtures.synthetic import render_image

    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    pool = []
    for i in range(n_unique):
        buf = io.BytesIO()
        render_image(i, 256, 256).save(buf, "JPEG", quality=95)
        pool.append(buf.getvalue())
    oom = oom_sample_per_shard(per_tar)
    shards = []
    for s in range(-(-n_samples // per_tar)):
        name = f"{s:05d}"
        shards.append(name)
        with tarfile.open(os.path.join(root, "images", f"{name}.tar"), "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(min(per_tar, n_samples - s * per_tar)):
                key = compute_key(i, s, oom, 5)
                for ext, data in (("jpg", pool[(s * per_tar + i) % n_unique]), ("json", b'{"status": "success"}'),
                                  ("txt", f"a photo of thing {i} in shard {s}".encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return shards


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def model_only(encoder, batch: int, steps: int = 20) -> float:
    """Images/s of the image tower alone on a resident random batch (bf16 autocast as all_clip)."""
    import torch

    h, w = encoder.image_spec.crop
    x = torch.randn(batch, 3, h, w, device=encoder.device)
    with torch.inference_mode():
        for _ in range(3):
            encoder.model.encode_image(x)
        _sync(encoder.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            encoder.model.encode_image(x)
        _sync(encoder.device)
    return batch * steps / (time.perf_counter() - t0)


MODELS = (("ViT-B/32", "VIT_B_32", 512), ("ViT-L/14", "VIT_L_14", 256))
PREPARE_MODES = ("threads", "processes")


def prepare_processes(mode: str) -> int:
    """``write_clip_embeddings``' ``prepare_processes`` for a mode: processes as the GPU default sizes them
    (given explicitly, so a CPU smoke test runs the process path too), or 0 for threads."""
    from shardprep.prepare_pool import default_processes

    if mode not in PREPARE_MODES:
        raise ValueError(f"prepare must be one of {PREPARE_MODES} (or a list of them), got {mode!r}")
    return default_processes() if mode == "processes" else 0


def without_model(encoder):
    """``encoder`` with its encode calls answering zeros: ``write_clip_embeddings`` then does all but the model."""
    import torch

    def zeros(n: int):
        return torch.zeros((n, encoder.dim), dtype=torch.float16)

    shim = copy.copy(encoder)
    shim.encode_step = lambda images, tokens=None: (zeros(len(images)), None if tokens is None else zeros(len(tokens)))
    return shim


def over_shards(shards: list[str], layout, encoder, batch: int, processes: int, device: str) -> dict:
    """One warm-up shard (kernels; the worker pool's start, once per process), then every shard timed."""
    from shardprep.embeddings import write_clip_embeddings

    t = time.perf_counter()
    write_clip_embeddings(shards[0], layout, encoder, batch_size=batch, prepare_processes=processes)
    _sync(device)
    warm_s = time.perf_counter() - t
    t = time.perf_counter()
    n = sum(write_clip_embeddings(sh, layout, encoder, batch_size=batch, prepare_processes=processes).samples
            for sh in shards)
    _sync(device)
    seconds = time.perf_counter() - t
    return {"images_per_s": n / seconds, "images": n, "seconds": seconds, "warmup_seconds": warm_s,
            "processes": processes}


def _write_json(path: str | None, out: dict) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, path)


def run_gpu(s: dict) -> dict:
    """``s``: ``work`` (folder), ``samples``, ``per_tar``; optional (for bench/gpu_device.sh and a CPU smoke
    test): ``device`` ("cuda"), ``models`` (labels of ``MODELS``), ``geometry`` (a ``models`` name that
    replaces every model's geometry), ``batch`` (replaces every model's batch), ``model_steps`` (20),
    ``prepare`` ("processes", "threads" or a list of both: the end-to-end mode(s); the first one fills
    ``end_to_end_images_per_s``), ``prepare_only`` (true: images/s of the preparing alone, both modes,
    with the first model's preprocess and tokenizer), ``out`` (a JSON file rewritten after each step) and
    ``keep_going`` (a model that fails is recorded under ``errors`` and the next one runs, instead of
    raising)."""
    import models as bench_models
    import torch
    import transformers
    from models import build_random_clip, text_flops, vision_flops

    from shardprep.embeddings import thread_split
    from shardprep.layout import Layout
    from shardprep.models.clip import load_clip_encoder

    device = s.get("device", "cuda")
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    peak = _peak(name)
    root = s["work"]
    t = time.perf_counter()
    shards = make_tars(root, s["samples"], s["per_tar"])
    layout = Layout(root)
    out = {"device": name, "peak_flops": peak, "cpu_cores": os.cpu_count(), "samples": s["samples"], "models": {},
           "per_tar": s["per_tar"], "decode_threads": thread_split(device)[0], "torch": torch.__version__,
           "transformers": transformers.__version__, "make_tars_seconds": time.perf_counter() - t,
           "prepare_processes": prepare_processes("processes")}
    modes = s.get("prepare", "processes")
    modes = [modes] if isinstance(modes, str) else list(modes)
    for mode in modes:
        prepare_processes(mode)  # a bad mode fails before any model is built
    want_prepare_only = s.get("prepare_only", True)
    _write_json(s.get("out"), out)
    wanted = s.get("models") or [label for label, _, _ in MODELS]
    for label, geometry_name, batch in MODELS:
        if label not in wanted:
            continue
        geometry = getattr(bench_models, s.get("geometry") or geometry_name)
        batch = s.get("batch") or batch
        try:
            t = time.perf_counter()
            model_dir = build_random_clip(os.path.join(root, label.replace("/", "-")), geometry)
            build_s = time.perf_counter() - t
            t = time.perf_counter()
            encoder = load_clip_encoder(f"hf_clip:{model_dir}", device=device)
            load_s = time.perf_counter() - t
            if want_prepare_only and "prepare_only" not in out:  # the same for every model of one input size
                out["prepare_only"] = {}
                for mode in PREPARE_MODES:
                    r = over_shards(shards, layout, without_model(encoder), batch, prepare_processes(mode), device)
                    out["prepare_only"][mode] = r
                    print(f"prepare only, {mode}: {r['images_per_s']:.0f} images/s", flush=True)
                _write_json(s.get("out"), out)
            by_mode = {}
            for mode in modes:
                by_mode[mode] = over_shards(shards, layout, encoder, batch, prepare_processes(mode), device)
                print(f"{label} end to end, {mode}: {by_mode[mode]['images_per_s']:.0f} images/s", flush=True)
            first = by_mode[modes[0]]
            e2e, n, seconds, warm_s = first["images_per_s"], first["images"], first["seconds"], first["warmup_seconds"]
            alone = model_only(encoder, batch, s.get("model_steps", 20))
            fv, ft = vision_flops(geometry), text_flops(geometry)
            out["models"][label] = {
                "batch": batch, "end_to_end_images_per_s": e2e, "model_only_images_per_s": alone,
                "gflop_image": fv / 1e9, "gflop_text": ft / 1e9,
                "mfu_end_to_end": (e2e * (fv + ft) / peak) if peak else None,
                "mfu_model_only": (alone * fv / peak) if peak else None,
                "fast_preprocess": encoder.fast_preprocess, "images": n, "end_to_end_seconds": seconds,
                "build_seconds": build_s, "load_seconds": load_s, "warmup_seconds": warm_s,
                "prepare": modes[0], "end_to_end_by_prepare": by_mode,
            }
            if device.startswith("cuda"):
                out["models"][label]["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del encoder
        except Exception as e:
            if not s.get("keep_going"):
                raise
            import traceback

            traceback.print_exc()
            out.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        _write_json(s.get("out"), out)
        print(f"{label}: {json.dumps(out['models'].get(label) or out['errors'][label])}", flush=True)
    return out


if __name__ == "__main__":  # python bench/gpu.py --json SETTINGS (bench/ and the repo root on PYTHONPATH)
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True, help="run_gpu's settings as JSON")
    print(json.dumps(run_gpu(json.loads(p.parse_args().json))))
