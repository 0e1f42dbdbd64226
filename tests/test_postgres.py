"""A Postgres-backed instance (the repo's dagster.postgres.yaml) running three shard runs at once.

Three processes each run every per-shard asset of one shard, as `shardprep run` does
(``execute_in_process`` on the instance at $DAGSTER_HOME), released together; pool slots are claimed
and freed across them through Postgres. A fresh database is created for the test and
dropped after. Skipped only where no PostgreSQL answers (DAGSTER_PG_* or 127.0.0.1:5432, user postgres).
"""

import shutil
import subprocess
import sys
import threading
import time

import dagster as dg

from shardprep.artifacts import artifact
from shardprep.config import load_config
from shardprep.ledger import register_sources
from shardprep_dagster.assets import per_shard_assets
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, write_config
from tests.fixtures.services import pg_database, pg_env  # noqa: F401 - a fixture

SHARDS = ["00000", "00001", "00002"]
LOCK_ERRORS = ("database is locked", "deadlock detected", "could not obtain lock", "could not serialize",
               "LockNotAvailable", "SerializationFailure")

# One shard run, as `shardprep run` does it; waits for "go" so that the three start together.
CHILD = r"""
import sys
checkout, config, shard = sys.argv[1:4]

from shardprep_dagster.definitions import build_defs
from shardprep_dagster.orchestration.instance import get_instance
from shardprep_dagster.orchestration.in_process import QUIET_RUN_CONFIG

instance = get_instance()
job = build_defs(config).resolve_job_def("shards_job")
print("ready", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(3)
result = job.execute_in_process(partition_key=shard, instance=instance, run_config=QUIET_RUN_CONFIG,
                                raise_on_error=False, tags={"shardprep/test": "postgres"})
print("run", result.run_id, "success" if result.success else "failure", flush=True)
sys.exit(0 if result.success else 1)
"""


def test_three_shard_runs_at_once_on_postgres(tmp_path, pg_database, image_site, tiny_clip_dir, monkeypatch):
    _, base_url = image_site
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), base_url, n_files=1, rows_per_file=[15], n_images=120, seed=8)
    config = write_config(
        tmp_path / "shardprep.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"), samples_per_shard=5,
        image_size=32, resize_mode="center_crop", allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}",
        batch_size=16, thread_count=4, timeout=5, enable_nemo_text2img=False, enable_nemo_diffusion=False)
    assert register_sources(load_config(config)).all_keys == SHARDS
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(CHECKOUT / "dagster.postgres.yaml", home / "dagster.yaml")
    for var, value in {**pg_env(), "DAGSTER_PG_DB": pg_database, "DAGSTER_HOME": str(home)}.items():
        monkeypatch.setenv(var, value)  # the yaml reads the server from the environment

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        instance.add_dynamic_partitions("shards", SHARDS)
        # three "gpu" slots (CPU here, no GPU), so the runs overlap; the download pool keeps its 2 slots,
        # so one run waits for a slot another process holds, claimed and freed through Postgres
        instance.event_log_storage.set_concurrency_slots("gpu", len(SHARDS))
        logs = run_together([[sys.executable, "-c", CHILD, str(CHECKOUT), config, shard] for shard in SHARDS])
        for log in logs:
            assert not [e for e in LOCK_ERRORS if e.lower() in log.lower()], log[-4000:]

        runs = instance.get_runs(filters=dg.RunsFilter(tags={"shardprep/test": "postgres"}))
        assert len(runs) == 3 and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        assert sorted(r.tags["dagster/partition"] for r in runs) == SHARDS
        # diffusion: disabled, not run; captions: no captioner, not in the graph
        for asset in [a for a in per_shard_assets if artifact(a.key.path[-1]).enabled_by is None]:
            assert instance.get_materialized_partitions(asset.key) == set(SHARDS), asset.key
            events = instance.fetch_materializations(asset.key, limit=10).records
            assert sorted(e.partition_key for e in events) == SHARDS, asset.key  # once per shard
        # every blocking check was recorded, and passed, for every shard
        checked = {}
        for run in runs:
            for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
                data = e.dagster_event.event_specific_data
                checked[(data.asset_key.to_user_string(), data.check_name, run.tags["dagster/partition"])] = data.passed
        # video_shards' check passes as not applicable on image shards
        assert {k[0] for k in checked} == {"image_shards", "video_shards", "clip_embeddings", "reordered_embeddings"}
        assert len(checked) == 4 * len(SHARDS) and all(checked.values()), checked
        # every pool slot was given back
        for pool, slots in (("gpu", len(SHARDS)), ("download", 2)):
            info = instance.event_log_storage.get_concurrency_info(pool)
            assert info.slot_count == slots and info.active_slot_count == 0 and info.pending_step_count == 0, pool
    finally:
        instance.dispose()


def run_together(commands: list[list[str]], ready_timeout: float = 120, run_timeout: float = 240) -> list[str]:
    """Start the processes, wait until each prints "ready", release them all with "go"; returns their
    output. Each must exit 0. Every wait is bounded."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    outputs: list[list[str]] = [[] for _ in procs]
    ready = [threading.Event() for _ in procs]

    def pump(i: int) -> None:
        for line in procs[i].stdout:
            outputs[i].append(line)
            if line.strip() == "ready":
                ready[i].set()

    readers = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + ready_timeout
        for i, p in enumerate(procs):
            while not ready[i].wait(0.5):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"shard run process {i} is not ready (exit code {p.poll()}):\n"
                                         + "".join(outputs[i])[-4000:])
        for p in procs:  # release the runs together
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + run_timeout
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"shard run process {i} still running after {run_timeout:.0f}s:\n"
                                     + "".join(outputs[i])[-4000:]) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in readers:
            t.join(timeout=5)
    logs = ["".join(o) for o in outputs]
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"shard run process {i} exited {p.returncode}:\n{logs[i][-4000:]}"
    return logs



def test_processes_starting_together_set_pool_limits_once(tmp_path, pg_database, monkeypatch):
    """Runs started together each find no "download" limit and insert one; Postgres refuses all but
    the first insert (unique violation). The others must keep that limit, not crash. Replayed with
    threads released by a barrier, round after round, on a real server."""
    from shardprep_dagster.orchestration.instance import apply_pool_limits, pool_limits

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(CHECKOUT / "dagster.postgres.yaml", home / "dagster.yaml")
    for var, value in {**pg_env(), "DAGSTER_PG_DB": pg_database}.items():
        monkeypatch.setenv(var, value)
    instances = [dg.DagsterInstance.from_config(str(home)) for _ in range(6)]
    try:
        storage = instances[0].event_log_storage
        for _ in range(8):
            for pool in pool_limits():
                if pool in storage.get_concurrency_keys():
                    storage.delete_concurrency_limit(pool)
            barrier = threading.Barrier(len(instances))
            errors = []

            def start(instance):
                barrier.wait()
                try:
                    apply_pool_limits(instance)
                except Exception as e:  # noqa: BLE001 - collected and shown below
                    errors.append(e)

            threads = [threading.Thread(target=start, args=(i,)) for i in instances]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            for pool, slots in pool_limits().items():
                assert storage.get_concurrency_info(pool).slot_count == slots
    finally:
        for instance in instances:
            instance.dispose()


def test_a_lost_pool_wake_up_is_repaired_on_postgres(tmp_path, pg_database, monkeypatch):
    """The lost wake-up of Dagster's pool queue (``resources.concurrency_wait``) on the production storage: a
    step queued unassigned while the slot is free claims it on its second claim."""
    from shardprep_dagster.resources import concurrency_wait
    from tests.test_concurrency_wait import _lose_a_wake_up

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(CHECKOUT / "dagster.postgres.yaml", home / "dagster.yaml")
    for var, value in {**pg_env(), "DAGSTER_PG_DB": pg_database, "DAGSTER_HOME": str(home)}.items():
        monkeypatch.setenv(var, value)
    concurrency_wait.apply()
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        storage = instance.event_log_storage
        assert type(storage).__name__ == "PostgresEventLogStorage"
        _lose_a_wake_up(storage, "gpu", "run-b", "clip_embeddings")
        assert [storage.claim_concurrency_slot("gpu", "run-b", "clip_embeddings").is_claimed
                for _ in range(2)] == [False, True]
    finally:
        instance.dispose()
