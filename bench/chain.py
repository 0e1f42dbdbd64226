"""The end-to-end pair (``chain``): URL parquet -> image tars -> CLIP embeddings -> reordered embeddings
-> energon index of the image tars, by ``shardprep run`` and by the glue users write today.

Both sides are driven from ``bench/drivers.py`` (``chain-ours``, ``chain-glue``); every command runs
as a subprocess under ``measure.run_monitored`` (wall, peak RSS and CPU of its whole process tree).
``dagster_timeline`` reads where a ``shardprep run``'s wall time went from its Dagster instance.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import sys

import psutil
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DAEMON_EXIT_SECONDS = 60  # the private queue daemon exits after 20 s idle (orchestration.queue_daemon)


def _fresh(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)


def successes(folder: str) -> dict:
    """Status counts from the img2dataset-layout ``{shard}.parquet`` files of ``folder``."""
    import pyarrow.parquet as pq

    statuses = [s for p in sorted(glob.glob(os.path.join(folder, "*.parquet")))
                for s in pq.read_table(p, columns=["status"]).column("status").to_pylist()]
    return {k: statuses.count(k) for k in ("success", "failed_to_download", "failed_to_resize")}


def energon_samples(dataset_dir: str) -> int:
    with open(os.path.join(dataset_dir, ".nv-meta", ".info.json")) as f:
        return sum(json.load(f)["shard_counts"].values())


def nonzero_rows(folder: str) -> int:
    import numpy as np

    return sum(int(np.any(np.load(p) != 0, axis=1).sum()) for p in glob.glob(os.path.join(folder, "*.npy")))


# ------------------------------------------------------------------------------------ ours


def write_config(s: dict, path: str, out: str) -> str:
    """The dataset YAML, as tests/fixtures/configs.write_config and demo/run_demo.py write one: the
    settings both sides share, shardprep's defaults for everything else, NeMo outputs off."""
    fields = {"source": f"{os.path.dirname(s['parquet'])}/*.parquet", "output_root": out,
              "url_col": "url", "caption_col": "caption", "save_additional_columns": ["source_id"],
              "samples_per_shard": s["samples_per_shard"], "image_size": s["image_size"],
              "resize_mode": s["resize_mode"], "thread_count": s["threads"], "timeout": float(s["timeout"]),
              "allow_private_addresses": True, "clip_model": s["model"], "device": "cpu",
              "batch_size": s["batch_size"], "enable_nemo_text2img": False, "enable_nemo_diffusion": False,
              "energon_split_ratio": s["split_ratio"]}
    with open(path, "w") as f:
        yaml.safe_dump(fields, f, sort_keys=False)
    return path


def fresh_home(home: str) -> str:
    """A new Dagster instance folder with the checkout's dagster.yaml, as `make ui` / the CLI make one."""
    _fresh(home)
    shutil.copy(os.path.join(ROOT, "dagster.yaml"), os.path.join(home, "dagster.yaml"))
    return home


def wait_for_daemon(tree) -> int:
    """Once `shardprep run` has exited, wait for what it left running (its private queue daemon, which
    exits after 20 s idle, and the daemon's code server) so it does not load the next measurement;
    terminate what is still there after DAEMON_EXIT_SECONDS. Only processes of this run's tree."""
    left = []
    for pid, created in tree.seen:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                left.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=DAEMON_EXIT_SECONDS)
    for p in alive:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    return len(alive)


# ------------------------------------------------------------------------------------ where Dagster's time goes


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _run_events(instance, run_id: str) -> dict:
    """First timestamp of each run-level event, and the run's steps as (step, start, end)."""
    from dagster._core.events import DagsterEventType as E

    kinds = {E.RUN_ENQUEUED, E.RUN_STARTING, E.RUN_START, E.RUN_SUCCESS, E.RUN_FAILURE, E.ENGINE_EVENT,
             E.STEP_START, E.STEP_SUCCESS, E.STEP_FAILURE, E.ASSET_MATERIALIZATION}
    first: dict[str, float] = {}
    starts: dict[str, float] = {}
    engine: dict[str, float] = {}  # step -> seconds its shards' writers report (summed over a batch)
    steps = []
    for record in instance.all_logs(run_id, of_type=kinds):
        event = record.dagster_event
        kind = event.event_type
        if kind == E.ASSET_MATERIALIZATION:  # a batch's partitions share one summary: read it once
            seconds = event.step_materialization_data.materialization.metadata.get("seconds")
            if seconds is not None and event.step_key not in engine:
                engine[event.step_key] = float(seconds.value)
            continue
        if kind == E.ENGINE_EVENT:
            message = record.message or ""
            if message.startswith("Started process for run"):  # "... (pid: 1234)."
                first.setdefault("process_started", record.timestamp)
                first.setdefault("pid", int(message.rsplit("pid: ", 1)[1].split(")")[0]))
            continue
        if kind == E.STEP_START:
            starts[event.step_key] = record.timestamp
        elif kind in (E.STEP_SUCCESS, E.STEP_FAILURE) and event.step_key in starts:
            steps.append((event.step_key, starts[event.step_key], record.timestamp))
        else:
            first.setdefault(kind.value, record.timestamp)
    return {"events": first, "steps": steps, "engine": engine}


def _shard_spans(instance, asset: str, started: float) -> dict[str, tuple[float, float]]:
    """``{shard: (started, finished)}`` of the shards ``asset`` wrote, from its materializations' figures."""
    import dagster as dg

    out = {}
    for record in instance.fetch_materializations(dg.AssetKey(asset), limit=10_000).records:
        meta = record.asset_materialization.metadata
        rows = [r.data for r in meta["per_shard"].value.records] if "per_shard" in meta else \
            [{"shard": record.partition_key, **{k: v.value for k, v in meta.items()}}]
        for r in rows:
            if isinstance(r.get("started_at"), float) and isinstance(r.get("finished_at"), float):
                out[r["shard"]] = (round(r["started_at"] - started, 2), round(r["finished_at"] - started, 2))
    return dict(sorted(out.items()))


def _overlapped(spans: dict[str, dict[str, tuple[float, float]]]) -> int:
    downloads, embeds = spans["image_shards"], spans["clip_embeddings"]
    shards = sorted(downloads)
    return sum(1 for k, nxt in zip(shards, shards[1:]) if k in embeds and embeds[k][0] < downloads[nxt][1])


def dagster_timeline(home: str, started: float, ended: float, cpu_of_pid: dict[int, float] | None = None) -> dict:
    """Where the wall time of a `shardprep run` (``started``..``ended``, epoch seconds) went, from its
    instance: the steps' busy time (our engines), and per run its queue wait, process start-up (launch ->
    "Started process" -> RUN_START) and its tail after the last step. ``cpu_of_pid``: sampled CPU seconds
    of each process, to give each run its worker's CPU."""
    import dagster as dg
    from dagster._core.events import DagsterEventType as E

    with dg.DagsterInstance.from_config(home) as instance:
        runs = instance.get_runs()
        per_run = {r.run_id: {"tags": r.tags, **_run_events(instance, r.run_id)} for r in runs}
        shard_spans = {a: _shard_spans(instance, a, started) for a in ("image_shards", "clip_embeddings")}
    steps = [(k, a, b) for r in per_run.values() for k, a, b in r["steps"]]
    wall = ended - started
    busy = _union([(a, b) for _, a, b in steps])
    by_asset: dict[str, float] = {}
    for key, a, b in steps:
        by_asset[key] = by_asset.get(key, 0.0) + (b - a)
    writers: dict[str, float] = {}  # the shard writers' own seconds; the rest of a step: imports, model load
    for r in per_run.values():
        for key, seconds in r["engine"].items():
            writers[key] = writers.get(key, 0.0) + seconds

    def spans(frm: str, to: str) -> list[float]:
        return [r["events"][to] - r["events"][frm] for r in per_run.values() if frm in r["events"]
                and to in r["events"]]

    starting, start, done = E.RUN_STARTING.value, E.RUN_START.value, E.RUN_SUCCESS.value
    tails = [r["events"][done] - max(b for _, _, b in r["steps"]) for r in per_run.values()
             if done in r["events"] and r["steps"]]
    heads = [min(a for _, a, _ in r["steps"]) - r["events"][start] for r in per_run.values()
             if start in r["events"] and r["steps"]]
    enqueued = [r["events"][E.RUN_ENQUEUED.value] for r in per_run.values() if E.RUN_ENQUEUED.value in r["events"]]
    finished = [r["events"][done] for r in per_run.values() if done in r["events"]]
    runs_busy = _union([(r["events"][starting], r["events"][done]) for r in per_run.values()
                        if starting in r["events"] and done in r["events"]])
    return {
        "wall": wall, "runs": len(per_run), "steps": len(steps), "step_busy_union": busy,
        "overhead_share": 1 - busy / wall if wall else float("nan"),
        "step_seconds_sum": sum(b - a for _, a, b in steps), "step_seconds_by_asset": by_asset,
        "writer_seconds_by_asset": writers,
        "any_run_in_flight": runs_busy,  # launch of a run .. its success, union over runs
        "queue_wait_sum": sum(spans(E.RUN_ENQUEUED.value, starting)),
        "launch_to_process_sum": sum(spans(starting, "process_started")),
        "process_to_run_start_sum": sum(spans("process_started", start)),
        "startup_sum": sum(spans(starting, start)),  # launch -> RUN_START, per run, summed
        "startup_per_run": sorted(spans(starting, start)),
        "run_start_to_first_step_sum": sum(heads), "last_step_to_run_success_sum": sum(tails),
        "cli_to_first_enqueue": (min(enqueued) - started) if enqueued else None,
        "last_success_to_cli_exit": (ended - max(finished)) if finished else None,
        # per shard, seconds after the start: when its download and its embedding ran, and how many
        # shards were embedded while the next one was still downloading (assets.follow)
        "shard_spans": shard_spans,
        "embedded_during_next_download": _overlapped(shard_spans),
        "runs_detail": [{"steps": [(k, round(a - started, 2), round(b - started, 2)) for k, a, b in r["steps"]],
                         "events": {k: round(v - started, 2) for k, v in r["events"].items() if k != "pid"},
                         "cpu": (cpu_of_pid or {}).get(r["events"].get("pid")),
                         "partitions": r["tags"].get("dagster/partition")
                         or f"{r['tags'].get('dagster/asset_partition_range_start', '')}.."
                            f"{r['tags'].get('dagster/asset_partition_range_end', '')}"}
                        for r in sorted(per_run.values(), key=lambda r: r["events"].get(starting, 0))],
    }


# ------------------------------------------------------------------------------------ theirs


def glue_commands(s: dict, out: dict[str, str], tars: list[str] | None = None) -> dict[str, list[str]]:
    """The four commands, as a user would type them (each tool's CLI, the same settings as ours)."""
    bin_dir = os.path.dirname(sys.executable)
    cmds = {
        "img2dataset": [os.path.join(bin_dir, "img2dataset"), "--url_list", s["parquet"], "--input_format", "parquet",
                        "--url_col", "url", "--caption_col", "caption", "--save_additional_columns", '["source_id"]',
                        "--output_format", "webdataset", "--output_folder", out["images"],
                        "--processes_count", str(s["processes"]), "--thread_count", str(s["threads"]),
                        "--image_size", str(s["image_size"]), "--resize_mode", s["resize_mode"],
                        "--number_sample_per_shard", str(s["samples_per_shard"]), "--timeout", str(s["timeout"]),
                        "--retries", "0", "--distributor", "multiprocessing", "--enable_wandb", "False"],
        "energon prepare": [os.path.join(bin_dir, "energon"), "prepare", out["images"], "--non-interactive",
                            "--split-ratio", ",".join(str(x) for x in s["split_ratio"]),
                            "--sample-type", "CaptioningSample", "--field-map", '{"image": "jpg", "caption": "txt"}',
                            "--num-workers", str(s["processes"]), "--no-progress"],
        "reorder script": [sys.executable, os.path.join(HERE, "reorder_glue.py"),
                           "--embeddings_folder", os.path.join(out["embeddings"], "img_emb"),
                           "--metadata_folder", os.path.join(out["embeddings"], "metadata"),
                           "--output_folder", out["reordered"], "--index_width", str(s["index_width"]),
                           "--output_shard_width", "5"],
    }
    if tars:  # known once img2dataset has run: the brace range of the tars it wrote
        cmds["clip-retrieval inference"] = [
            os.path.join(bin_dir, "clip-retrieval"), "inference",
            "--input_dataset", f"{out['images']}/{{{tars[0]}..{tars[-1]}}}.tar", "--input_format", "webdataset",
            "--output_folder", out["embeddings"], "--enable_metadata", "True", "--clip_model", s["model"],
            "--batch_size", str(s["batch_size"]), "--num_prepro_workers", str(s["processes"]),
            "--enable_text", "True", "--use_jit", "False", "--enable_wandb", "False"]
    return cmds
