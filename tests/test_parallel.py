"""One machine at full width: `shardprep run` through Dagster's run queue keeps several shards in flight
(downloads of one shard overlap embedding of another, within the pools' limits), GPU steps get one
device each, and several `shardprep run` processes on one instance never do a pair twice."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEventType

from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, write_config
from tests.fixtures.live_dagster import prepare_home
from tests.fixtures.slow_runs import slow_image_source


@dataclass(frozen=True)
class Step:
    asset: str
    run_id: str
    start: float
    end: float

    def overlaps(self, other: "Step") -> bool:
        return self.start < other.end and other.start < self.end


def steps(instance: dg.DagsterInstance) -> list[Step]:
    """Every successful step of every run, with its start and end time."""
    out = []
    for run in instance.get_runs():
        starts = {}
        for record in instance.all_logs(run.run_id, of_type={DagsterEventType.STEP_START,
                                                             DagsterEventType.STEP_SUCCESS}):
            event = record.dagster_event
            if event.event_type == DagsterEventType.STEP_START:
                starts[event.step_key] = record.timestamp
            elif event.step_key in starts:
                out.append(Step(event.step_key, run.run_id, starts[event.step_key], record.timestamp))
    return out


def most_at_once(intervals: list[Step]) -> int:
    edges = sorted([(s.start, 1) for s in intervals] + [(s.end, -1) for s in intervals])
    best = current = 0
    for _, delta in edges:
        current += delta
        best = max(best, current)
    return best


@pytest.fixture
def slow_source(tmp_path, tiny_clip_dir):
    """6 shards of 8 rows whose images answer after 0.4 s each: a shard's download takes ~2 s."""
    with slow_image_source(tmp_path, tiny_clip_dir, rows=48, samples_per_shard=8, slow_seconds=0.4,
                           thread_count=2, seed=5, batch_size=16) as source:
        yield source


@pytest.fixture
def slower_source(tmp_path, tiny_clip_dir):
    """``slow_source`` at 1.2 s an image (a shard ~5 s, a run of 3 ~15 s): two runs' downloads overlap even
    when the second run's process starts ~11 s after the first's, as seen on a loaded 2-core machine."""
    with slow_image_source(tmp_path, tiny_clip_dir, rows=48, samples_per_shard=8, slow_seconds=1.2,
                           thread_count=2, seed=5, batch_size=16) as source:
        yield source


@pytest.fixture
def two_shards_per_run(monkeypatch):
    # backfill runs of two shards each (every per-shard asset in one run): 3 runs in flight at once
    monkeypatch.setenv("SHARDPREP_DOWNLOAD_SHARDS_PER_RUN", "2")
    monkeypatch.setenv("SHARDPREP_GPU_SHARDS_PER_RUN", "2")


def embedding_work(instance: dg.DagsterInstance) -> dict[str, dict]:
    """``{shard: figures}`` of every shard clip_embeddings wrote (by its step, or following the
    download): when (started_at, finished_at) and on which device."""
    out = {}
    for record in instance.fetch_materializations(dg.AssetKey("clip_embeddings"), limit=1000).records:
        meta = record.asset_materialization.metadata
        rows = [r.data for r in meta["per_shard"].value.records] if "per_shard" in meta else \
            [{"shard": record.partition_key, **{k: v.value for k, v in meta.items()}}]
        out.update({r["shard"]: r for r in rows if r.get("status") == "written"})
    return out


def lease_spans(work: dict[str, dict]) -> list[Step]:
    """Each device lease that embedded shards, as ``Step(device, first shard, leased at, its last shard's
    end)``: the lease was held at least that long."""
    leases: dict[tuple[str, float], Step] = {}
    for shard, w in sorted(work.items()):
        key = (w["device"], w["device_leased_at"])
        held = leases.get(key)
        end = max(w["finished_at"], held.end if held else 0.0)
        leases[key] = Step(w["device"], held.run_id if held else shard, w["device_leased_at"], end)
    return sorted(leases.values(), key=lambda s: s.start)


def _run_six_shards(config: str, tmp_path: Path, pool_limits: dict[str, int]) -> tuple:
    """`shardprep run` (queued, on a fresh instance with these pool limits) over ``slow_source``: every
    shard through every per-shard asset. Returns its summary and the instance's home."""
    home = prepare_home(tmp_path / "home", pool_limits=pool_limits)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        summary = run_pipeline(config, instance=instance, progress=False)
    assert summary.ok, summary.failed
    assert summary.materialized["reordered_embeddings"] == 6
    return summary, home


def test_downloads_overlap_embedding_and_gpu_work_leases_its_own_device(slow_source, tmp_path, two_shards_per_run,
                                                                         monkeypatch):
    monkeypatch.setenv("SHARDPREP_SIMULATED_DEVICES", "3")  # three CPU-backed "GPUs"
    monkeypatch.setenv("SHARDPREP_DEVICE_LOCK_DIR", str(tmp_path / "device-locks"))
    home = _run_six_shards(slow_source[0], tmp_path, {"download": 2, "gpu": 3})[1]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        device = {r.run_id: r.tags.get("shardprep/device/clip_embeddings") for r in instance.get_runs()}
        done = steps(instance)
        work = embedding_work(instance)
        # a run of two shard partitions gives each its own figures, not the run's totals
        images = {r.partition_key: r.asset_materialization.metadata for r in instance.fetch_materializations(
            dg.AssetKey("image_shards"), limit=100).records}
    downloads = [s for s in done if s.asset == "image_shards"]
    embeds = [s for s in done if s.asset == "clip_embeddings"]
    assert len(downloads) == len(embeds) == 3  # two shards per run, every per-shard asset in one run
    assert most_at_once(downloads) == 2  # the download pool's limit, reached and never exceeded
    assert {p: m["samples"].value for p, m in images.items()} == {f"{i:05d}": 8 for i in range(6)}
    assert all(m["shards_in_run"].value == 2 for m in images.values())

    # every shard embedded, each after its own download and (the first of a run) while the run's next
    # shard downloaded, or in another run beside a download
    assert sorted(work) == [f"{i:05d}" for i in range(6)]
    spans = [Step(w["device"], k, w["started_at"], w["finished_at"]) for k, w in work.items()]
    assert any(d.overlaps(e) for d in downloads for e in spans), "no download overlapped an embedding"
    # GPU work: on a device leased for the download step it follows (or for the clip step), named in the
    # run's tags. A lease held at least from its start to the end of its last shard; two leases of one
    # device never overlap, and two runs downloading at once held two devices at once
    assert {s.asset for s in spans} <= {"sim0", "sim1", "sim2"}
    assert {device[s.run_id] for s in downloads} <= {"sim0", "sim1", "sim2"}
    leases = lease_spans(work)
    assert len(leases) >= 3  # each run's follower took its own lease
    pairs = [(a, b) for i, a in enumerate(leases) for b in leases[i + 1:]]
    same = [(a, b) for a, b in pairs if a.asset == b.asset and a.overlaps(b)]
    assert not same, f"two leases of one device at once: {same}"
    assert any(a.overlaps(b) for a, b in pairs), \
        f"no two devices were leased at once: nothing was tested ({leases})"


def test_a_small_backfill_is_spread_over_the_download_slots(slower_source, tmp_path):
    """6 shards, 16 per run by default: Dagster would make one run downloading them one after the other
    while the second download slot idled. `shardprep run` launches one backfill per slot instead."""
    from shardprep_dagster.orchestration.queued import spread

    assert spread(["a", "b"], slots=2, per_run=8) == [["a"], ["b"]]
    assert spread(list("abcde"), slots=2, per_run=8) == [["a", "b"], ["c", "d", "e"]]
    assert spread(list("abcde"), slots=8, per_run=8) == [[p] for p in "abcde"]
    assert spread(list("abcdefgh"), slots=2, per_run=4) == [list("abcdefgh")]  # enough runs already
    assert spread(["a"], slots=2, per_run=8) == [["a"]] and spread([], slots=2, per_run=8) == []
    summary, home = _run_six_shards(slower_source[0], tmp_path, {"download": 2, "gpu": 1})
    with dg.DagsterInstance.from_config(str(home)) as instance:
        done = steps(instance)
        ranges = sorted((r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
                        for r in instance.get_runs() if "dagster/asset_partition_range_start" in r.tags)
    # two halves, then the global assets (in a run of this process, not a backfill)
    assert len(summary.backfills) == 2 and summary.runs == 3
    assert ranges == [("00000", "00002"), ("00003", "00005")]
    assert most_at_once([s for s in done if s.asset == "image_shards"]) == 2


def _cli_run(config: str, home: Path) -> subprocess.Popen:
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "run", "--config", config,
                             "--no-progress"], env=env, cwd=CHECKOUT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _materializations(home: Path) -> dict[tuple[str, str | None], int]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        counts: dict[tuple[str, str | None], int] = {}
        for key in instance.get_asset_keys():
            for r in instance.fetch_materializations(key, limit=10_000).records:
                counts[(key.to_user_string(), r.partition_key)] = counts.get((key.to_user_string(), r.partition_key),
                                                                             0) + 1
        return counts


def test_several_cli_runs_at_once_do_each_pair_once(image_site, tiny_clip_dir, tmp_path):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[30], n_images=120, seed=13)
    root = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(root),
                          samples_per_shard=10, image_size=32, thread_count=4, timeout=5,
                          allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
                          enable_nemo_text2img=False, enable_nemo_diffusion=False)
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((CHECKOUT / "dagster.yaml").read_text())  # a fresh, uncreated instance

    def together(n: int) -> None:
        procs = [_cli_run(config, home) for _ in range(n)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * n, "\n-----\n".join(outs)

    together(2)
    counts = _materializations(home)
    shards = ["00000", "00001", "00002"]
    per_shard = ["source_parquet", "image_shards", "clip_embeddings", "reordered_embeddings"]
    assert {k: v for k, v in counts.items() if v != 1} == {}  # each (asset, shard) exactly once
    assert {(a, s) for a in per_shard for s in shards} <= set(counts)
    assert counts[("image_energon_index", None)] == counts[("dataset_report", None)] == 1

    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[20], n_images=120, seed=14,
                                   prefix="zz-new")
    together(4)
    counts = _materializations(home)
    assert {k: v for k, v in counts.items() if k[1] is not None and v != 1} == {}
    assert {(a, s) for a in per_shard for s in shards + ["00003", "00004"]} <= set(counts)
    assert counts[("image_energon_index", None)] == counts[("dataset_report", None)] == 2  # one more update
    assert [p for p in root.rglob("*") if ".tmp-" in p.name] == []


def test_both_instance_configs_launch_queued_runs_from_several_threads(tmp_path):
    """Dagster's code server answers a launch only once the run's worker process has imported everything
    (~2 s): launched one at a time, the second shard's run started that much after the first while a core
    idled (bench/E2E.md). Both instance files of the checkout launch from threads, and Dagster accepts
    that beside their `concurrency` block."""
    import yaml

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((CHECKOUT / "dagster.yaml").read_text())
    with dg.DagsterInstance.from_config(str(home)) as instance:
        coordinator = instance.run_coordinator
        assert coordinator.dequeue_use_threads and coordinator.dequeue_num_workers >= 2
        assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 8
    sqlite, postgres = (yaml.safe_load((CHECKOUT / name).read_text()) for name in ("dagster.yaml",
                                                                                  "dagster.postgres.yaml"))
    assert postgres["run_coordinator"] == sqlite["run_coordinator"]
    assert postgres["concurrency"] == sqlite["concurrency"]
