"""Many machines, on one: a `shardprep run` whose steps execute on two dagster-celery workers that share
nothing but the broker (RabbitMQ), the instance (PostgreSQL) and the object store (seaweedfs S3).

Each worker starts in a directory of its own, with its own temp dir and device locks, no $DAGSTER_HOME
and no output on local disk; the dataset config and every output live in S3. One worker is SIGKILLed in
the middle of a step: its task goes back to the broker (acks late), the other worker runs it, and
nothing partial is left in S3.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg

from shardprep.layout import Layout
from shardprep_dagster.orchestration.launch import run_partitions
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, nemo_config, write_config
from tests.fixtures.http_server import serve_directory
from tests.fixtures.s3_readback import assert_outputs_load_from_s3
from tests.fixtures.services import connect, pg_database, pg_env, rabbitmq_vhost  # noqa: F401 - fixtures

SHARDS = [f"{i:05d}" for i in range(8)]
ROWS_PER_SHARD = 6
PER_SHARD = ("source_parquet", "image_shards", "clip_embeddings", "reordered_embeddings", "diffusion_samples")
GLOBAL = ("balanced_shards", "wdinfo", "precached_encodings", "image_energon_index", "diffusion_energon_index",
          "dataset_report")
# the instance as on many machines: PostgreSQL; step stdout/stderr stays with the worker that printed
# it (structured events go to PostgreSQL), so no worker writes into the launcher's $DAGSTER_HOME
NO_COMPUTE_LOGS = """
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
"""


def _start_worker(tmp_path: Path, name: str, env: dict[str, str], config: str) -> subprocess.Popen:
    home = tmp_path / name
    (home / "tmp").mkdir(parents=True)
    env = {**env, "TMPDIR": str(home / "tmp"), "SHARDPREP_DEVICE_LOCK_DIR": str(home / "locks")}
    log = open(home / "worker.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "worker", "--name", name, "--config", config],
                            cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _worker_steps(dbname: str, worker: str) -> list[tuple[str, str, bool]]:
    """(run id, step key, finished) of every step a worker has taken, from the instance's event log:
    dagster-celery's engine event names the worker as each task starts."""
    import psycopg2

    conn = connect(dbname)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT run_id, step_key FROM event_logs WHERE dagster_event_type = 'ENGINE_EVENT' "
                        "AND event LIKE '%%in celery worker%%' AND event LIKE %s ORDER BY id", (f'%"{worker}@%',))
            taken = cur.fetchall()
            cur.execute("SELECT run_id, step_key FROM event_logs WHERE dagster_event_type IN "
                        "('STEP_SUCCESS', 'STEP_FAILURE')")
            ended = set(cur.fetchall())
    except psycopg2.errors.UndefinedTable:
        return []  # the launcher has not set the instance's tables up yet
    finally:
        conn.close()
    return [(run, step, (run, step) in ended) for run, step in taken]


def _kill_mid_step(proc: subprocess.Popen, dbname: str, worker: str, launcher: subprocess.Popen) -> str:
    """SIGKILL ``worker`` once it is inside a download step, after it has finished another step; returns
    the run it was killed in."""
    deadline = time.time() + 240
    while time.time() < deadline:
        assert launcher.poll() is None, launcher.stdout.read()
        steps = _worker_steps(dbname, worker)
        if steps and any(done for *_, done in steps):
            run, step, done = steps[-1]
            if not done and step == "image_shards":
                time.sleep(0.5)  # its images are downloading (1 s each)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                return run
        time.sleep(0.1)
    raise AssertionError(f"worker {worker} never reached a second download step")


def _runs_report(home: Path, killed_run: str) -> str:
    """Each run's status and partitions, and the killed run's step events (to tell a failure apart)."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        lines = [f"{r.run_id[:8]} {r.status.value} {run_partitions(instance, r)}" for r in instance.get_runs()]
        for e in instance.all_logs(killed_run):
            if e.dagster_event is not None:
                lines.append(f"  {e.step_key} {e.dagster_event.event_type_value} {e.message[:200]!r}")
    return "\n" + "\n".join(lines)


def test_a_run_on_two_celery_workers_over_s3_and_postgres_survives_a_killed_worker(
        tmp_path, s3_server, pg_database, rabbitmq_vhost, tiny_clip_dir, tiny_nemo_dirs, monkeypatch):
    fs = s3_server.filesystem()
    root = f"s3://{s3_server.bucket}/distributed-{uuid.uuid4().hex[:8]}"
    site = tmp_path / "site"
    synthetic.make_demo_site(str(site), n_images=len(SHARDS) * ROWS_PER_SHARD, seed=5)
    base_url, stop_site = serve_directory(str(site), slow_seconds=1.0)
    workers: dict[str, subprocess.Popen] = {}
    try:
        src = tmp_path / "src"
        synthetic.make_source_parquets(str(src), base_url + "/slow", n_files=1,
                                       rows_per_file=len(SHARDS) * ROWS_PER_SHARD,
                                       n_images=len(SHARDS) * ROWS_PER_SHARD, broken_share=0.0)
        for path in src.glob("*.parquet"):
            fs.put_file(str(path), f"{root}/source/{path.name}")
        local_config = write_config(
            tmp_path / "shardprep.yaml", source=f"{root}/source/*.parquet", output_root=f"{root}/out",
            samples_per_shard=ROWS_PER_SHARD, image_size=32, resize_mode="center_crop", thread_count=2, timeout=5,
            allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
            **nemo_config(tiny_nemo_dirs))  # every asset: NeMo's too
        config = f"{root}/shardprep.yaml"  # every process reads the one config in S3
        fs.put_file(str(local_config), config)

        env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "SHARDPREP_CONFIG")}
        env.update({**s3_server.env(), **pg_env(), "DAGSTER_PG_DB": pg_database})
        env.update(SHARDPREP_EXECUTOR="celery",
                   SHARDPREP_CELERY_BROKER=rabbitmq_vhost, SHARDPREP_CELERY_BACKEND="redis://127.0.0.1:6379/0",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        for name in ("w1", "w2"):
            workers[name] = _start_worker(tmp_path, name, env, config)

        home = tmp_path / "launcher" / "dagster_home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text((CHECKOUT / "dagster.postgres.yaml").read_text() + NO_COMPUTE_LOGS)
        # two shards per run, so both workers get shards; a slot per worker in each pool
        launcher_env = {**env, "DAGSTER_HOME": str(home), "SHARDPREP_DOWNLOAD_SHARDS_PER_RUN": "2",
                        "SHARDPREP_GPU_SHARDS_PER_RUN": "2", "SHARDPREP_GPU_SLOTS": "2",
                        "SHARDPREP_DOWNLOAD_SLOTS": "2"}

        def shardprep(*args: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "shardprep_dagster.orchestration.cli", *args], cwd=home.parent,
                                    env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        launcher = shardprep("run", "--config", config, "--no-progress")
        killed_run = _kill_mid_step(workers["w1"], pg_database, "w1", launcher)
        out, _ = launcher.communicate(timeout=400)
        # the killed worker's task goes back to the broker and w2 runs it, so the run itself succeeds; should
        # a shard still be reported (the issue allows it), a re-run finishes the backfill on w2
        if launcher.returncode != 0:
            print("first run:", out, _runs_report(home, killed_run))
            rerun = shardprep("run", "--config", config, "--no-progress")
            out, _ = rerun.communicate(timeout=400)
            assert rerun.returncode == 0, out + _runs_report(home, killed_run)
        assert "failed: 0" in out, out
        for name, proc in workers.items():
            if name != "w1":
                assert proc.poll() is None, (tmp_path / name / "worker.log").read_text()[-4000:]

        # nothing partial in S3, every output whole: no temp object, and `verify` re-reads every output
        assert [p for p in fs.find(root) if ".tmp-" in p] == []
        verify = shardprep("verify", "--config", config, "--no-mark")
        report, _ = verify.communicate(timeout=300)
        assert verify.returncode == 0, report
        for var, value in {**s3_server.env(), **pg_env(), "DAGSTER_PG_DB": pg_database}.items():
            monkeypatch.setenv(var, value)  # the loaders find the server as users' do: AWS_* variables
        assert_outputs_load_from_s3(s3_server, Layout(f"{root}/out"), SHARDS, ROWS_PER_SHARD, tmp_path)

        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            by_worker: dict[str, list[tuple[str, str, int]]] = {}
            for asset in PER_SHARD:
                records = instance.fetch_materializations(dg.AssetKey(asset), limit=100).records
                assert sorted({r.partition_key for r in records}) == SHARDS, asset
                for r in records:
                    meta = r.asset_materialization.metadata
                    loads = (meta["clip_loads_by_worker"].value, meta["nemo_loads_by_worker"].value)
                    by_worker.setdefault(meta["worker"].value, []).append((asset, r.partition_key, *loads))
            for asset in GLOBAL:
                assert instance.get_latest_materialization_event(dg.AssetKey(asset)) is not None, asset
            pids = {int(w.split(":")[1]) for w in by_worker}
            # both workers did work: the killed one before it died, the other one the rest
            assert pids == {workers["w1"].pid, workers["w2"].pid}, by_worker
            # the shards whose download was killed were downloaded again, by the surviving worker
            killed_shards = run_partitions(instance, instance.get_run_by_id(killed_run))
            w2 = f"{os.uname().nodename}:{workers['w2'].pid}"
            assert {("image_shards", s) for s in killed_shards} <= {(a, s) for a, s, *_ in by_worker[w2]}, by_worker
            # each worker process loaded each model once, however many shards it did: CLIP once by its
            # CLIP steps, T5 and the autoencoder once by its diffusion steps (counted per library)
            clip = {w: [c for a, _, c, _ in steps if a == "clip_embeddings"] for w, steps in by_worker.items()}
            nemo = {w: [n for a, _, _, n in steps if a == "diffusion_samples"] for w, steps in by_worker.items()}
            assert max(len(v) for v in clip.values()) >= 2 and max(len(v) for v in nemo.values()) >= 2, by_worker
            assert all(c == 1 for v in clip.values() for c in v), clip
            assert all(n == 2 for v in nemo.values() for n in v), nemo
            # the workers' steps went through the run queue's runs, every one of them a success now
            runs = instance.get_runs()
            assert runs and all(r.tags.get("shardprep/config") == config for r in runs if "dagster/partition" in r.tags)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in workers.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        stop_site()
        fs.rm(root, recursive=True)
