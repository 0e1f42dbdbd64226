"""A `shardprep run` (or one of its run workers) killed in the middle of a shard, then re-run: complete,
valid outputs, no temp files, no pool slot or device kept by the dead."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds

from shardprep.layout import Layout
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, write_config
from tests.fixtures.http_server import serve_directory


def _shardprep(config: str, home: Path, *flags: str) -> subprocess.Popen:
    # one shard per run, so that a run can be killed or cancelled with others still to come
    env = {**os.environ, "DAGSTER_HOME": str(home), "SHARDPREP_DOWNLOAD_SHARDS_PER_RUN": "1",
           "SHARDPREP_GPU_SHARDS_PER_RUN": "1"}
    return subprocess.Popen([sys.executable, "-m", "orchestration.cli", "run",
                             "--config", config, "--no-progress", *flags], env=env, cwd=CHECKOUT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def slow_dataset(tmp_path, tiny_clip_dir):
    """A source of 20-row shards whose images answer after 0.5 s each (4 download threads: ~2.5 s a
    shard), served while the test runs; yields (config, layout, DAGSTER_HOME)."""
    site = tmp_path / "site"
    synthetic.make_demo_site(str(site), n_images=60, seed=2)
    base_url, stop = serve_directory(str(site), slow_seconds=0.5)
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), base_url + "/slow", n_files=1, rows_per_file=80, n_images=60,
                                   broken_share=0.0)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=20, image_size=32, thread_count=4, timeout=5,
                          allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}",
                          enable_nemo_text2img=False, enable_nemo_diffusion=False)
    yield config, Layout(str(tmp_path / "out")), tmp_path / "dagster_home"
    stop()


def _wait_for(proc: subprocess.Popen, path: str, what: str) -> None:
    deadline = time.time() + 240
    while not Path(path).exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"{what} never happened"
        time.sleep(0.1)


def _complete(layout: Layout) -> None:
    for shard in ("00000", "00001", "00002", "00003"):
        table = pq.read_table(layout.shard_parquet(shard)).to_pandas()
        assert len(table) == 20 and set(table.status) == {"success"}
        assert len(list(wds.WebDataset(layout.tar(shard), shardshuffle=False))) == 20
        assert Path(layout.reordered_img(shard)).exists()
    assert [p for p in Path(layout.root).rglob("*") if ".tmp-" in p.name] == []


def _no_slot_held(home: Path) -> None:
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        for pool in ("download", "gpu"):
            assert instance.event_log_storage.get_concurrency_info(pool).claimed_slots == []


def test_killed_in_process_run_resumes_to_complete_outputs(slow_dataset):
    config, layout, home = slow_dataset
    proc = _shardprep(config, home, "--in-process")
    _wait_for(proc, layout.shard_stats("00000"), "shard 00000 finishing")  # 00001 is now downloading
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not Path(layout.shard_stats("00001")).exists(), "killed too late to test a partial shard"
    assert not Path(layout.tar("00001")).exists()  # never a half-written final file

    proc = _shardprep(config, home)  # the re-run goes through the run queue: the dead run's slots are free
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    _complete(layout)
    _no_slot_held(home)


def _worker_pid(home: Path, shard: str) -> int:
    """The pid of the run worker materializing ``shard`` (tagged by the worker itself)."""
    import dagster as dg

    from orchestration.launch import run_partitions

    deadline = time.time() + 120
    while time.time() < deadline:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])):
                if run_partitions(instance, run) == [shard] and "shardprep/pid" in run.tags:
                    return int(run.tags["shardprep/pid"])
        time.sleep(0.2)
    raise AssertionError(f"no run of shard {shard} started")


def test_killed_run_worker_is_reported_and_the_rerun_completes(slow_dataset):
    config, layout, home = slow_dataset
    proc = _shardprep(config, home)
    _wait_for(proc, layout.source_parquet("00001"), "shard 00001's run starting")
    time.sleep(1.0)  # its images are downloading
    os.kill(_worker_pid(home, "00001"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out  # the other shards finished; the killed one is reported, by shard
    assert "FAILED shard 00001: run" in out and "SIGKILL" in out, out
    if Path(layout.tar("00001")).exists():  # killed after its download step: a final file is never half-written
        assert len(list(wds.WebDataset(layout.tar("00001"), shardshuffle=False))) == 20
    _no_slot_held(home)

    rerun = _shardprep(config, home)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out
    _complete(layout)


def test_sigterm_stops_the_run_promptly_and_cancels_it(slow_dataset):
    import dagster as dg

    config, layout, home = slow_dataset
    proc = _shardprep(config, home)
    _wait_for(proc, layout.source_parquet("00001"), "shard 00001's run starting")
    time.sleep(1.0)  # its images are downloading
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)  # it waits for the cancellation (at most 120 s), not for the rest
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out

    # its backfill cancelled: no run left in flight or queued, no global output, nothing half-written
    assert not Path(layout.report_html).exists()
    assert not Path(layout.tar("00001")).exists() or Path(layout.shard_stats("00001")).exists()
    assert [p for p in Path(layout.root).rglob("*") if ".tmp-" in p.name] == []
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs()
        assert {r.status for r in runs} <= {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.CANCELED}
        assert dg.DagsterRunStatus.CANCELED in {r.status for r in runs}
        assert {b.status.value for b in instance.get_backfills()} == {"CANCELED"}
    _no_slot_held(home)

    rerun = _shardprep(config, home)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out
    _complete(layout)
