"""A `shardprep run` (or one of its run workers) killed in the middle of a shard, then re-run: complete,
valid outputs, no temp files, no pool slot or device kept by the dead."""

import os
import signal
import time
from pathlib import Path

import webdataset as wds

from tests.fixtures.slow_runs import complete, no_slot_held, shardprep_run, slow_dataset, wait_for  # noqa: F401


def test_killed_in_process_run_resumes_to_complete_outputs(slow_dataset):
    config, layout, home = slow_dataset
    proc = shardprep_run(config, home, "--in-process")
    wait_for(proc, layout.shard_stats("00000"), "shard 00000 finishing")  # 00001 is now downloading
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not Path(layout.shard_stats("00001")).exists(), "killed too late to test a partial shard"
    assert not Path(layout.tar("00001")).exists()  # never a half-written final file

    proc = shardprep_run(config, home)  # the re-run goes through the run queue: the dead run's slots are free
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    complete(layout)
    no_slot_held(home)


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _worker_pid(home: Path, shard: str) -> int:
    """The pid of the run worker materializing ``shard`` (tagged by the worker itself)."""
    import dagster as dg

    from shardprep_dagster.orchestration.launch import run_partitions

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
    proc = shardprep_run(config, home)
    wait_for(proc, layout.source_parquet("00001"), "shard 00001's run starting")
    time.sleep(1.0)  # its images are downloading
    pid = _worker_pid(home, "00001")
    # forked from a fork of the code server (orchestration.run_workers), not spawned cold
    server = _parent(pid)
    assert _comm(server) == "shardprep-runs"
    code_server = _parent(server)  # a fork of the queue daemon, made once it had imported the code location
    assert _comm(code_server) == "shardprep-code"
    assert "orchestration.queue_daemon" in _cmdline(_parent(code_server))
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out  # the other shards finished; the killed one is reported, by shard
    assert "FAILED shard 00001: run" in out and "SIGKILL" in out, out
    if Path(layout.tar("00001")).exists():  # killed after its download step: a final file is never half-written
        assert len(list(wds.WebDataset(layout.tar("00001"), shardshuffle=False))) == 20
    no_slot_held(home)

    rerun = shardprep_run(config, home)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out
    complete(layout)
