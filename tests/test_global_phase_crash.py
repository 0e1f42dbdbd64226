"""`shardprep run` and every process of its DAGSTER_HOME killed with SIGKILL, as an operator or a lost
machine would: then one re-run exits 0 only with every output made and verifying. At random moments of
the global phase (balanced tars, wdinfo, precache, energon index, dedup, report being updated after new
shards); and before a run carries its process's pid, which must not hold up the next run until Dagster's
5-minute start timeout."""

import os
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEventType

from shardprep_dagster.orchestration.instance import home_lock
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, nemo_config, write_config
from tests.fixtures.slow_runs import kill_instance

GLOBAL_OUTPUTS = ("balanced/wdinfo.pkl", "precached/wdinfo.pkl", "images/.nv-meta/index.sqlite",
                  "report/index.html", "dedup/state.json")


class Cli:
    """A `shardprep` command whose output lines are read as they come."""

    def __init__(self, home: Path, *args: str):
        env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "shardprep_dagster.orchestration.cli", *args], env=env, cwd=CHECKOUT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            assert line is not None, "".join(self.out)  # it ended without printing it
            self.out.append(line)
            if text in line:
                return
        raise AssertionError(f"no {text!r} in {timeout} s:\n{''.join(self.out)}")

    def finish(self, timeout: float = 280) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        while (line := self.lines.get(timeout=30)) is not None:
            self.out.append(line)
        return rc, "".join(self.out)


@pytest.fixture
def dataset(tmp_path, image_site, tiny_clip_dir, tiny_nemo_dirs):
    src = tmp_path / "source"
    src.mkdir()
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=10, image_size=32, allow_private_addresses=True, thread_count=8,
                          timeout=5, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, tar_chunk_size=4,
                          dedup=True, dedup_threshold=0.999, **nemo_config(tiny_nemo_dirs),
                          enable_nemo_diffusion=False)
    return config, src, image_site[1], tmp_path / "out", tmp_path / "home"


def add_source(src: Path, base_url: str, n: int, rows: int) -> None:
    synthetic.make_source_parquets(str(src), base_url, n_files=1, rows_per_file=rows, n_images=120, seed=n,
                                   broken_share=0.0, prefix=f"part{n}")


def verified(config: str, home: Path, out: Path) -> str:
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    verify = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "verify", "--config", config, "--no-mark"],
                            env=env, cwd=CHECKOUT, capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for rel in GLOBAL_OUTPUTS:
        assert (out / rel).exists(), rel
    return verify.stdout


def test_kill_9_in_the_global_phase_then_one_rerun_completes(dataset):
    config, src, base_url, out, home = dataset
    for seed in (1, 2, 3):  # each round: a new source file, a run killed while the global assets update
        add_source(src, base_url, seed, rows=10 if seed > 1 else 20)
        run = Cli(home, "run", "--config", config, "--no-progress")
        run.wait_for("updating balanced tars")
        # the CLI runs the global assets itself (orchestration.queued._globals_here), for a few seconds: the
        # kill must land while it does (with up to 10 s, as when a backfill ran them, one round killed nothing)
        time.sleep(random.Random(seed).uniform(0.1, 1.0))
        assert run.proc.poll() is None, "the global phase was over before the kill"
        killed = kill_instance(home, run.proc.pid)
        assert len(killed) > 1, "only the CLI was running"
        rc, text = run.finish()
        assert rc == -9 and "runs this time" not in text, text  # killed before its summary

        rerun = Cli(home, "run", "--config", config, "--no-progress")
        rc, text = rerun.finish()
        # the truth: 0 only when every shard and every global asset is made, whoever made it
        assert rc == 0 and "failed: 0" in text, text
        assert "no" not in [line.split()[-1] for line in text.splitlines() if line.startswith(
            ("duplicates", "sample_selection", "balanced_shards", "wdinfo", "precached_encodings",
             "image_energon_index", "dataset_report"))], text
        verified(config, home, out)
    kill_instance(home)  # the private daemon, idle now


def test_a_run_killed_before_it_started_does_not_hold_up_the_next(dataset):
    config, src, base_url, out, home = dataset
    add_source(src, base_url, 1, rows=20)
    run = Cli(home, "run", "--config", config, "--no-progress")
    victim = None
    deadline = time.monotonic() + 240
    while victim is None and time.monotonic() < deadline:  # a run launched, its process not tagged yet
        if (home / "dagster.yaml").exists():
            with home_lock(home, "instance"), dg.DagsterInstance.from_config(str(home)) as instance:
                # (the lock: not while the CLI creates the instance's schema)
                starting = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTING]))
                victim = starting[0].run_id if starting else None
        time.sleep(0.05)
    assert victim is not None, "no run was ever starting"
    kill_instance(home, run.proc.pid)
    run.finish()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(victim).status in (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)

    rerun = Cli(home, "run", "--config", config, "--no-progress")
    rc, text = rerun.finish(timeout=240)  # Dagster's own run monitoring would wait 300 s for its start
    assert rc == 0 and "failed: 0" in text, text
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(victim).status == dg.DagsterRunStatus.FAILURE
        [failure] = instance.all_logs(victim, of_type=DagsterEventType.RUN_FAILURE)
        assert "is gone" in failure.message, failure.message  # found by the re-run, not timed out
    verified(config, home, out)
    kill_instance(home)
