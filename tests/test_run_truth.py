"""What a run says about itself is what the instance and the output root hold: a global asset's failure is
reported with its cause (not Dagster's wrapper line), global assets made from nothing do not claim to be
materialized, and a bad config is refused before the Dagster instance is even opened."""

import os
import subprocess
import sys

import dagster as dg
import pytest

from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, nemo_config, write_config
from tests.fixtures.live_dagster import prepare_home


@pytest.fixture
def source(tmp_path, image_site):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[20], n_images=120, seed=5,
                                   broken_share=0.0)
    return f"{src}/*.parquet", tmp_path / "out"


@pytest.mark.parametrize("in_process", [True, False])
def test_a_global_asset_failure_names_its_cause(tmp_path, source, tiny_clip_dir, tiny_nemo_dirs, in_process):
    # queued (in_process False): the global assets run in the CLI's own process, not as a backfill
    # (orchestration.queued._globals_here), and their failure is reported from that run
    glob, out = source
    config = write_config(tmp_path / "c.yaml", source=glob, output_root=str(out), samples_per_shard=10,
                          image_size=32, allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}",
                          batch_size=16, tar_chunk_size=4, **nemo_config(tiny_nemo_dirs), enable_nemo_diffusion=False)
    out.mkdir()
    (out / "report").write_text("a file where the report's folder must go")
    with (dg.instance_for_test() if in_process else
          dg.DagsterInstance.from_config(str(prepare_home(tmp_path / "home")))) as instance:
        summary = run_pipeline(config, instance=instance, progress=False, in_process=in_process)
    if not in_process:
        assert summary.global_run is not None and summary.backfills  # the shards through backfills
    assert not summary.ok
    error = summary.failed["(global)"]
    assert error.startswith("dataset_report: ") and "Error occurred while executing" not in error, error
    assert "Errno" in error and "report" in error, error  # the OSError itself, naming the path
    assert summary.materialized["dataset_report"] == 0 and summary.materialized["wdinfo"] == 1
    assert list(summary.failed) == ["(global)"] and summary.materialized["image_shards"] == 2


def test_global_assets_made_from_no_embedding_are_not_materialized(tmp_path, source, tiny_clip_dir):
    glob, out = source
    config = write_config(tmp_path / "c.yaml", source=glob, output_root=str(out), samples_per_shard=10,
                          image_size=32, allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}",
                          batch_size=16, dedup=True, enable_nemo_text2img=False, enable_nemo_diffusion=False)
    out.mkdir()
    (out / "embeddings").write_text("a file: every shard's clip_embeddings fails")
    with dg.instance_for_test() as instance:
        summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert not summary.ok and summary.materialized["clip_embeddings"] == 0
    assert summary.materialized["image_shards"] == 2
    # nothing to de-duplicate, select or report on: none claims to be done
    for name in ("duplicates", "sample_selection", "dataset_report"):
        assert summary.materialized[name] == 0, summary.materialized
    assert "no image shard has CLIP embeddings" in summary.failed["(global)"], summary.failed


def test_a_bad_config_is_refused_before_the_instance_is_opened(tmp_path, source):
    glob, out = source
    config = write_config(tmp_path / "c.yaml", source=glob, output_root=str(out), image_size=-3)
    home = tmp_path / "home"
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    for command in (["run"], ["run", "--verify"], ["verify"]):
        done = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", *command, "--config", config], env=env,
                              cwd=CHECKOUT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "image_size" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not home.exists() and not out.exists(), command  # no instance opened, nothing written


@pytest.mark.parametrize("executor", ["in_process", "celery"])
def test_a_run_is_tagged_with_the_pid_of_its_own_process_only(tmp_path, executor, monkeypatch):
    """recover_dead_runs judges a run by the pid it is tagged with. Where steps run in the run's own
    process, the dataset resource tags it with that process; a Celery step worker is not the run (killed,
    its task goes to another worker and the run goes on), so under Celery it tags nothing and the run
    worker's own pid, which Dagster logs, stands for the run."""
    from shardprep_dagster.resources.dataset import PID_TAG, DatasetResource

    monkeypatch.setenv("SHARDPREP_EXECUTOR", executor)
    config = write_config(tmp_path / "shardprep.yaml", source=str(tmp_path / "none.parquet"),
                          output_root=str(tmp_path / "out"))

    @dg.asset
    def probe(dataset: DatasetResource) -> None:
        pass

    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([probe], resources={"dataset": DatasetResource(config_path=config)},
                                instance=instance)
        tags = instance.get_run_by_id(result.run_id).tags
    assert tags.get(PID_TAG) == (str(os.getpid()) if executor == "in_process" else None)


def test_a_dead_worker_of_a_live_code_server_is_left_to_it_for_a_while(monkeypatch):
    """The code server that launched a run worker records how it died ("terminated by signal 9
    (SIGKILL)"), which `shardprep run` reports: recover_dead_runs must not close the run first, yet closes
    it if the code server never does."""
    import json
    import socket

    from dagster._core.storage.tags import GRPC_INFO_TAG

    from shardprep_dagster.orchestration import recovery
    from shardprep_dagster.resources.dataset import HOST_TAG, PID_TAG

    dead = subprocess.Popen(["true"])
    dead.wait()
    with socket.socket() as server, dg.instance_for_test() as instance:  # a listening port: the live code server
        server.bind(("127.0.0.1", 0))
        server.listen()
        run = instance.create_run_for_job(dg.GraphDefinition(name="job", node_defs=[]).to_job(), tags={
            PID_TAG: str(dead.pid), HOST_TAG: socket.gethostname(),
            GRPC_INFO_TAG: json.dumps({"host": "127.0.0.1", "port": server.getsockname()[1]})})
        # started, as a run worker's run is
        instance.handle_new_event(dg.EventLogEntry(
            error_info=None, level="DEBUG", user_message="", run_id=run.run_id, timestamp=0.0,
            dagster_event=dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name="job")))
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
        assert recovery.recover_dead_runs(instance) == []  # within the grace
        monkeypatch.setattr(recovery, "CODE_SERVER_GRACE_SECONDS", 0.0)
        assert recovery.recover_dead_runs(instance) == [run.run_id]  # the code server never reported it
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
        assert run.run_id in recovery._first_seen_gone
        assert recovery.recover_dead_runs(instance) == [] and run.run_id not in recovery._first_seen_gone  # forgotten
