"""Run workers forked from a warm process (orchestration.run_workers): a code server of the code location
starts them as forks of a fork of itself, with Dagster, the code location and the instance's modules
loaded; anywhere else nothing changes."""

import json
import os
import subprocess
import sys
import textwrap

from tests.fixtures.live_dagster import prepare_home

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE_SERVER = textwrap.dedent("""
    import json, multiprocessing, sys
    sys.argv = ["dagster", "api", "grpc"]  # as `dagster api grpc` runs
    import shardprep_dagster.definitions  # loaded as the code server loads it
    from dagster._grpc.server import DagsterApiServer
    from multiprocessing import forkserver
    from tests.fixtures.run_worker_probe import report

    server = DagsterApiServer.__new__(DagsterApiServer)
    server._mp_ctx = multiprocessing.get_context("spawn")  # what the server's __init__ sets
    ctx = server._mp_ctx  # what its StartRun starts a run's process with
    queue = ctx.Queue()
    runs = [ctx.Process(target=report, args=(queue,)) for _ in range(2)]
    for p in runs:
        p.start()
    seen = [queue.get(timeout=60) for _ in runs]
    for p in runs:
        p.join(timeout=60)
    print(json.dumps({"method": ctx.get_start_method(), "server": forkserver._forkserver._forkserver_pid,
                      "exitcodes": [p.exitcode for p in runs], "runs": seen}))
""")


def _code_server(tmp_path, **env) -> dict:
    home = prepare_home(tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", CODE_SERVER], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "DAGSTER_HOME": str(home), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_code_servers_runs_are_forks_of_a_warm_fork_of_it(tmp_path):
    r = _code_server(tmp_path)
    assert r["method"] == "forkserver" and r["exitcodes"] == [0, 0]
    server = r["server"]
    for run in r["runs"]:
        assert run["ppid"] == server and run["comm"] == "shardprep-runs"  # forked from the warm server
        assert run["code_location_loaded"] and run["instance_loaded"]  # nothing left to import first
        assert run["python_threads"] == 1
    assert r["runs"][0]["pid"] != r["runs"][1]["pid"]  # a process per run, as with spawn


def test_spawn_is_kept_when_asked_for(tmp_path):
    r = _code_server(tmp_path, SHARDPREP_RUN_WORKERS="spawn")
    assert r["method"] == "spawn" and r["server"] is None and r["exitcodes"] == [0, 0]
    assert not any(run["instance_loaded"] for run in r["runs"])  # a fresh interpreter each


def test_the_warm_process_is_made_without_leaving_a_thread(tmp_path):
    # a Python thread left in the server would be missing from every fork, with any lock it held, held
    home = prepare_home(tmp_path / "home")
    code = ("import threading, shardprep_dagster.orchestration.forkserver_preload, sys; "
            "print(threading.active_count(), 'dagster._core.storage.runs.sqlite.sqlite_run_storage' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DAGSTER_HOME": str(home)})
    assert out.stdout.split() == ["1", "True"], out.stderr[-2000:]


def test_nothing_changes_outside_a_code_server():
    from dagster._grpc.server import DagsterApiServer

    from shardprep_dagster.orchestration import run_workers

    assert not run_workers.fork_from_warm_process("shardprep_dagster.definitions")  # pytest is no code server
    assert "_mp_ctx" not in vars(DagsterApiServer)
