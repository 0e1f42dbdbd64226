"""One side of one benchmark pair per invocation (run by ``bench/measure.run_side`` in a fresh process).

    python bench/drivers.py <side> --json '{...settings...}'

Prints a JSON line with what it did (counts), which the harness checks so that a fast but wrong
run cannot pass. Each side imports only what its own tool needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from measure import tree_cpu_seconds


def _fresh(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)


# --------------------------------------------------------------------------------------------
# download + resize + write


def _ours_shard(args) -> dict:
    parquet, offset, length, shard_id, cfg_dict = args
    from shardprep.config import config_from_dict
    from shardprep.images.shards import write_image_shard
    from shardprep.layout import Layout
    from shardprep.sources import read_rows

    cfg = config_from_dict(cfg_dict)
    table = read_rows(parquet, offset, offset + length)  # the shard's rows, as source_parquet reads them
    r = write_image_shard(table, shard_id, cfg, Layout(cfg.output_root))
    return {"successes": r.successes, "failed_to_download": r.failed_to_download,
            "failed_to_resize": r.failed_to_resize}


class _TarProgress:
    """Samples, every ``every`` seconds, the bytes of every tar being written under ``folder``
    (``*.tar``, and shardprep's ``.*.tar.tmp*`` before it is published) and the CPU seconds of this
    process tree (user + system, live descendants included), for the steady-state rate: the work
    between 10% and 90% of the final tar bytes, start-up and the last shard's tail left out. Both
    sides write their tars as the samples come (webdataset's TarWriter, ours in stream mode)."""

    def __init__(self, folder: str, every: float = 0.25):
        import threading

        self.folder, self.every = folder, every
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tar_bytes(self) -> int:
        total = 0
        for folder, _dirs, names in os.walk(self.folder):  # ours: under images/
            for name in names:
                if ".tar" in name and not name.endswith(".idx"):
                    try:
                        total += os.stat(os.path.join(folder, name)).st_size
                    except OSError:  # published or removed meanwhile
                        pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self._tar_bytes(), tree_cpu_seconds()))
            self._stop.wait(self.every)

    def __enter__(self) -> "_TarProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), self._tar_bytes(), tree_cpu_seconds()))

    def steady(self, lo: float = 0.1, hi: float = 0.9) -> dict:
        """{fraction, seconds, cpu_seconds} of the window from ``lo`` to ``hi`` of the final bytes
        (CPU of processes that ended inside the window is missed: a lower bound, see bench/run.py)."""
        final = max((b for _, b, _ in self.samples), default=0)
        if final <= 0:
            return {}
        a = next(x for x in self.samples if x[1] >= lo * final)
        b = next(x for x in self.samples if x[1] >= hi * final)
        if b[0] <= a[0]:
            return {}
        return {"fraction": (b[1] - a[1]) / final, "seconds": b[0] - a[0], "cpu_seconds": b[2] - a[2]}


def images_ours(s: dict) -> dict:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import pyarrow.parquet as pq

    _fresh(s["out"])
    n = pq.read_metadata(s["parquet"]).num_rows
    spp = s["samples_per_shard"]
    cfg = {"source": s["parquet"], "output_root": s["out"], "url_col": "url", "caption_col": "caption",
           "save_additional_columns": ["source_id"], "samples_per_shard": spp, "image_size": s["image_size"],
           "resize_mode": s["resize_mode"], "encode_quality": s["encode_quality"], "thread_count": s["threads"],
           "timeout": s["timeout"], "allow_private_addresses": True, **s.get("extra_cfg", {})}
    jobs = [(s["parquet"], off, min(spp, n - off), k, cfg) for k, off in enumerate(range(0, n, spp))]
    # fork: the parent has imported nothing heavy and runs no threads yet
    t0 = time.perf_counter()
    with _TarProgress(s["out"]) as progress:
        with ProcessPoolExecutor(s["processes"], mp_context=mp.get_context("fork")) as pool:
            reports = list(pool.map(_ours_shard, jobs))
    out = {k: sum(r[k] for r in reports) for k in reports[0]}
    out["work_seconds"] = time.perf_counter() - t0
    out["steady"] = progress.steady()
    return out


def images_img2dataset(s: dict) -> dict:
    import glob

    import img2dataset
    import pyarrow.parquet as pq

    _fresh(s["out"])
    t0 = time.perf_counter()
    with _TarProgress(s["out"]) as progress:
        img2dataset.download(
            url_list=s["parquet"], input_format="parquet", url_col="url", caption_col="caption",
            save_additional_columns=["source_id"], output_format="webdataset", output_folder=s["out"],
            processes_count=s["processes"], thread_count=s["threads"], image_size=s["image_size"],
            resize_mode=s["resize_mode"], encode_quality=s["encode_quality"],
            number_sample_per_shard=s["samples_per_shard"], timeout=int(s["timeout"]), retries=0,
            distributor="multiprocessing", enable_wandb=False)
    work = time.perf_counter() - t0
    rows = [r for p in sorted(glob.glob(os.path.join(s["out"], "*.parquet")))
            for r in pq.read_table(p, columns=["status"]).column("status").to_pylist()]
    return {"successes": rows.count("success"), "failed_to_download": rows.count("failed_to_download"),
            "failed_to_resize": rows.count("failed_to_resize"), "work_seconds": work, "steady": progress.steady()}


# --------------------------------------------------------------------------------------------
# CLIP embeddings of webdataset tars


def clip_ours(s: dict) -> dict:
    from shardprep.embeddings import write_clip_embeddings
    from shardprep.layout import Layout
    from shardprep.models.clip import load_clip_encoder

    layout = Layout(s["root"])  # tars in <root>/images, outputs in <root>/embeddings
    shutil.rmtree(layout.embeddings_dir, ignore_errors=True)
    encoder = load_clip_encoder(s["model"], device=s.get("device", "cpu"))
    if s.get("exact"):
        encoder = encoder.exact()
    t0, c0 = time.perf_counter(), tree_cpu_seconds()  # imports and the model load are done: the work starts here
    samples = 0
    for shard in s["shards"]:
        samples += write_clip_embeddings(shard, layout, encoder, batch_size=s["batch_size"]).samples
    return {"samples": samples, "work_seconds": time.perf_counter() - t0, "work_cpu_seconds": tree_cpu_seconds() - c0}


def clip_clip_retrieval(s: dict) -> dict:
    import numpy as np
    from all_clip import load_clip
    from clip_retrieval.clip_inference.main import main as clip_inference

    _fresh(s["out"])
    first, last = s["shards"][0], s["shards"][-1]
    # the model load clip-retrieval's mapper and worker do, with their exact arguments, so that
    # all_clip's cache serves them and the timed part below is the inference itself
    load_clip(clip_model=s["model"], use_jit=False, warmup_batch_size=s["batch_size"], clip_cache_path=None)
    t0, c0 = time.perf_counter(), tree_cpu_seconds()
    clip_inference(input_dataset=f"{s['root']}/images/{{{first}..{last}}}.tar", output_folder=s["out"],
                   input_format="webdataset", clip_model=s["model"], num_prepro_workers=s["workers"],
                   batch_size=s["batch_size"], enable_metadata=True, use_jit=False, enable_wandb=False,
                   **s.get("extra", {}))
    work, work_cpu = time.perf_counter() - t0, tree_cpu_seconds() - c0
    img = os.path.join(s["out"], "img_emb")
    samples = sum(np.load(os.path.join(img, f), mmap_mode="r").shape[0] for f in os.listdir(img))
    return {"samples": samples, "work_seconds": work, "work_cpu_seconds": work_cpu}


# --------------------------------------------------------------------------------------------
# DALLE2 decoder dataloader (tars + reordered embeddings)


def _dalle2_decoder_module():
    """DALLE2-pytorch's decoder_loader.py loaded by file path (its package __init__ pulls in the
    whole model stack), as tests/test_dataloaders.py does."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("dalle2_pytorch")
    if spec is None:
        raise RuntimeError("dalle2-pytorch is not installed (make setup installs it with --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / "dataloaders" / "decoder_loader.py"
    module_spec = importlib.util.spec_from_file_location("dalle2_decoder_loader", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _loader_epoch(make_loader, s: dict) -> dict:
    import warnings

    import torchvision.transforms as T

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    # DALLE2's default decoder preprocessing (train_configs.DecoderDataConfig.preprocessing)
    loader = make_loader(s["tars"], s["workers"], s["batch_size"], img_embeddings_url=s["img_emb"],
                         text_embeddings_url=s["text_emb"], index_width=s["index_width"], shuffle_shards=False,
                         img_preproc=T.ToTensor(), extra_keys=["txt"])
    samples, unique = 0, set()
    t0, c0 = time.perf_counter(), tree_cpu_seconds()  # an epoch: worker start-up, reading, decoding, collation
    for img, emb, txt in loader:
        samples += img.shape[0]
        unique.update(txt)
        if emb["img"].shape[0] != img.shape[0] or emb["text"].shape[0] != img.shape[0] or len(txt) != img.shape[0]:
            raise RuntimeError("batch parts disagree in length")
    # the epoch's end stopped and joined the workers (not persistent): their CPU is in RUSAGE_CHILDREN
    return {"samples": samples, "unique_samples": len(unique), "work_seconds": time.perf_counter() - t0,
            "work_cpu_seconds": tree_cpu_seconds() - c0}


def loader_ours(s: dict) -> dict:
    from shardprep.dataloaders import create_image_embedding_dataloader

    return _loader_epoch(create_image_embedding_dataloader, s)


def loader_dalle2(s: dict) -> dict:
    return _loader_epoch(_dalle2_decoder_module().create_image_embedding_dataloader, s)


# --------------------------------------------------------------------------------------------
# Megatron-Energon index (.nv-meta + .tar.idx)


def _linked_dataset(src: str, dst: str, names: list[str]) -> None:
    _fresh(dst)
    for name in names:  # hard links: the same tar bytes and mtimes, no copy
        os.link(os.path.join(src, name), os.path.join(dst, name))


def index_ours(s: dict) -> dict:
    from shardprep.energon import update_energon_index

    _linked_dataset(s["src"], s["dir"], s["tars"])
    t0, c0 = time.perf_counter(), tree_cpu_seconds()
    report = update_energon_index(s["dir"], sample_type="captioning", field_map={"image": "jpg", "caption": "txt"},
                                  split_ratio=(1, 0, 0))
    full = time.perf_counter() - t0
    out = {"samples": report.total_samples, "work_seconds": full, "work_cpu_seconds": tree_cpu_seconds() - c0}
    if s.get("incremental"):
        new = s["incremental"]
        os.link(os.path.join(s["src"], new), os.path.join(s["dir"], new))
        t0 = time.perf_counter()
        inc = update_energon_index(s["dir"], sample_type="captioning", field_map={"image": "jpg", "caption": "txt"},
                                   split_ratio=(1, 0, 0))
        out.update(incremental_seconds=time.perf_counter() - t0, incremental_scanned=inc.scanned_tars,
                   samples_after=inc.total_samples)
    return out


def index_energon(s: dict) -> dict:
    import subprocess

    _linked_dataset(s["src"], s["dir"], s["tars"])
    energon = os.path.join(os.path.dirname(sys.executable), "energon")
    t0, c0 = time.perf_counter(), tree_cpu_seconds()
    subprocess.run([energon, "prepare", s["dir"], "--non-interactive", "--split-ratio", "1,0,0",
                    "--sample-type", "CaptioningSample", "--field-map", '{"image": "jpg", "caption": "txt"}',
                    "--num-workers", str(s["workers"]), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    work = time.perf_counter() - t0  # includes the energon CLI's own start-up
    work_cpu = tree_cpu_seconds() - c0
    with open(os.path.join(s["dir"], ".nv-meta", ".info.json")) as f:
        counts = json.load(f)["shard_counts"]
    return {"samples": sum(counts.values()), "work_seconds": work, "work_cpu_seconds": work_cpu}


# --------------------------------------------------------------------------------------------
# end to end: URL parquet -> tars -> CLIP embeddings -> reordered embeddings -> energon index


def chain_ours(s: dict) -> dict:
    """`shardprep run` with its defaults on a fresh instance (it starts its own queue daemon)."""
    import chain
    from measure import run_monitored

    _fresh(s["dir"])
    out = os.path.join(s["dir"], "out")
    config = chain.write_config(s, os.path.join(s["dir"], "shardprep.yaml"), out)
    home = chain.fresh_home(os.path.join(s["dir"], "dagster_home"))
    # SHARDPREP_CONFIG: the code location the daemon loads serves this config, not whatever
    # demo/work holds; s["env"]: settings under test (shards per run, slots)
    env = {**os.environ, "DAGSTER_HOME": home, "SHARDPREP_CONFIG": config, **s.get("env", {})}
    cmd = [sys.executable, "-m", "shardprep_dagster.orchestration.cli", "run", "--config", config, "--no-progress",
           *s.get("cli_args", [])]  # e.g. --in-process, to see what the run queue costs
    stage, tree = run_monitored(cmd, os.path.join(s["dir"], "shardprep-run.log"), env=env, cwd=chain.ROOT)
    left_running = chain.wait_for_daemon(tree)
    cpu_of_pid = {pid: v["cpu"] for (pid, _), v in tree.seen.items()}
    timeline = chain.dagster_timeline(home, stage["started"], stage["ended"], cpu_of_pid)
    counts = chain.successes(os.path.join(out, "images"))
    return {"samples": counts["success"], **counts, "wall_seconds": stage["seconds"],
            "cpu_seconds": stage["cpu_seconds"], "peak_rss": stage["peak_rss"], "processes": stage["processes"],
            "cpu_waited": stage["cpu_waited"], "cpu_by_command": stage["cpu_by_command"],
            "energon_samples": chain.energon_samples(os.path.join(out, "images")),
            "reordered_rows": chain.nonzero_rows(os.path.join(out, "embeddings_reordered", "img")),
            "terminated_after_exit": left_running, "timeline": timeline, "work_seconds": stage["seconds"]}


def chain_glue(s: dict) -> dict:
    """img2dataset -> clip-retrieval inference -> reorder script -> energon prepare, one after another."""
    import glob

    import chain
    from measure import run_monitored

    _fresh(s["dir"])
    out = {k: os.path.join(s["dir"], k) for k in ("images", "embeddings", "reordered")}
    stages: dict[str, dict] = {}

    def stage(name: str, cmd: list[str]) -> None:
        log = os.path.join(s["dir"], f"{name.split()[0]}.log")
        stages[name] = run_monitored(cmd, log, cwd=s["dir"])[0]

    t0 = time.perf_counter()
    stage("img2dataset", chain.glue_commands(s, out)["img2dataset"])
    tars = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(out["images"], "*.tar")))
    cmds = chain.glue_commands(s, out, tars)
    for name in ("clip-retrieval inference", "reorder script", "energon prepare"):
        stage(name, cmds[name])
    wall = time.perf_counter() - t0  # the four commands and the moments between them
    counts = chain.successes(out["images"])
    return {"samples": counts["success"], **counts, "wall_seconds": wall,
            "cpu_seconds": sum(v["cpu_seconds"] for v in stages.values()),
            "peak_rss": max(v["peak_rss"] for v in stages.values()),
            "stages": {k: {f: v[f] for f in ("seconds", "cpu_seconds", "peak_rss")} for k, v in stages.items()},
            "energon_samples": chain.energon_samples(out["images"]),
            "reordered_rows": chain.nonzero_rows(out["reordered"]),
            "work_seconds": wall}


def clip_fidelity(s: dict) -> dict:
    from quality import clip_fast_vs_exact

    return clip_fast_vs_exact(s["model"], s["files"], tar=s.get("tar"))


def clip_gpu(s: dict) -> dict:
    from gpu import run_gpu

    return run_gpu(s)


# --------------------------------------------------------------------------------------------
# video shards: download, cut into clips, re-encode


def _ours_video_shard(args) -> dict:
    parquet, offset, length, shard_id, cfg_dict = args
    from shardprep.config import config_from_dict
    from shardprep.sources import read_rows
    from shardprep.video.shards import write_video_shard

    cfg = config_from_dict(cfg_dict)
    r = write_video_shard(read_rows(parquet, offset, offset + length), shard_id, cfg, cfg.output_root)
    return {"successes": r.successes, "failed_to_download": r.failed_to_download,
            "failed_to_subsample": r.failed_to_subsample, "clips": r.samples}


def video_ours(s: dict) -> dict:
    """``write_video_shard`` per shard, the shards in ``processes`` processes (as `shardprep run` puts
    shards in parallel in the download pool)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import pyarrow.parquet as pq

    _fresh(s["out"])
    n, spp = pq.read_metadata(s["parquet"]).num_rows, s["samples_per_shard"]
    cfg = {"source": s["parquet"], "output_root": s["out"], "video_source": s["parquet"], "video_url_col": "contentUrl",
           "video_caption_col": "name", "save_additional_columns": ["videoid"], "samples_per_shard": spp,
           "video_clip_col": "clips", "video_clip_length": s["clip_length"], "video_preset": s["preset"],
           "video_crf": s["crf"], "video_thread_count": s["threads"], "timeout": s["timeout"],
           "allow_private_addresses": True}
    jobs = [(s["parquet"], off, min(spp, n - off), k, cfg) for k, off in enumerate(range(0, n, spp))]
    t0, c0 = time.perf_counter(), tree_cpu_seconds()
    with ProcessPoolExecutor(s["processes"], mp_context=mp.get_context("fork")) as pool:
        reports = list(pool.map(_ours_video_shard, jobs))
    out = {k: sum(r[k] for r in reports) for k in reports[0]}
    out["work_seconds"], out["work_cpu_seconds"] = time.perf_counter() - t0, tree_cpu_seconds() - c0
    return out


def video_video2dataset(s: dict) -> dict:
    """video2dataset 1.3.0 (its own venv, tests/fixtures/video2dataset_oracle.py) with its
    ClippingSubsampler at ``precision: exact`` (re-encoded by its ffmpeg, cut at exact times)."""
    import glob

    import pyarrow.parquet as pq

    from tests.fixtures import video2dataset_oracle as oracle

    _fresh(s["out"])
    clipping = {"ClippingSubsampler": {"args": {"max_length": s["clip_length"], "min_length": 0.0,
                                                "precision": "exact"}}}
    config = oracle.v2d_config(samples_per_shard=s["samples_per_shard"], timeout=s["timeout"], subsampling=clipping,
                               thread_count=s["threads"])
    config["distribution"]["processes_count"] = s["processes"]
    t0, c0 = time.perf_counter(), tree_cpu_seconds()
    done = oracle.run([dict(url_list=s["parquet"], output_folder=s["out"], output_format="webdataset",
                            input_format="parquet", url_col="contentUrl", caption_col="name", clip_col="clips",
                            save_additional_columns=["videoid"], config=config)], s["work"], timeout=3000)
    work, work_cpu = time.perf_counter() - t0, tree_cpu_seconds() - c0
    if done.returncode != 0:
        raise RuntimeError(f"video2dataset failed ({done.returncode}): {done.stderr[-2000:]}")
    rows = [r for p in sorted(glob.glob(os.path.join(s["out"], "*.parquet")))
            for r in pq.read_table(p, columns=["key", "status"]).to_pylist()]
    ok = {r["key"].split("_")[0] for r in rows if r["status"] == "success"}
    failed = {r["key"] for r in rows if r["status"] != "success"}
    return {"successes": len(ok), "failed_to_download": sum(r["status"] == "failed_to_download" for r in rows),
            "failed_to_subsample": sum(r["status"] == "failed_to_subsample" for r in rows),
            "clips": sum(r["status"] == "success" for r in rows), "failed_rows": len(failed), "work_seconds": work,
            "work_cpu_seconds": work_cpu}


def _limits() -> dict:
    import limits

    return {f"{name}-limit": getattr(limits, f"{name}_limit") for name in ("images", "clip", "loader", "index", "video")}


SIDES = {
    "images-ours": images_ours, "images-img2dataset": images_img2dataset,
    "clip-ours": clip_ours, "clip-clip-retrieval": clip_clip_retrieval,
    "clip-fidelity": clip_fidelity, "clip-gpu": clip_gpu,
    "loader-ours": loader_ours, "loader-dalle2": loader_dalle2,
    "index-ours": index_ours, "index-energon": index_energon,
    "chain-ours": chain_ours, "chain-glue": chain_glue,
    "video-ours": video_ours, "video-video2dataset": video_video2dataset,
    **_limits(),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=sorted(SIDES))
    p.add_argument("--json", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    result = SIDES[a.side](json.loads(a.json))
    result["inner_seconds"] = time.perf_counter() - t0
    print("\n" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
