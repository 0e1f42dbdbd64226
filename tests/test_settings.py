"""Environment settings: parsed once, bad values named; the executor they select."""

import pytest

from shardprep_dagster.orchestration.distributed import QUEUES, worker_argv, worker_env
from shardprep_dagster.resources.executor import CELERY_SETTINGS
from shardprep_dagster.resources.settings import Settings, SettingsError, load_settings


def test_settings_default_and_parse():
    assert load_settings({}) == Settings()
    s = load_settings({"SHARDPREP_EXECUTOR": "celery", "SHARDPREP_GPU_SLOTS": "4", "SHARDPREP_AUTOMATION": "off",
                       "SHARDPREP_CELERY_BROKER": "pyamqp://u:p@broker:5672/vh"})
    assert (s.executor, s.gpu_slots, s.automation, s.celery_broker) == ("celery", 4, False,
                                                                         "pyamqp://u:p@broker:5672/vh")


@pytest.mark.parametrize("var,value,message", [
    ("SHARDPREP_EXECUTOR", "dask", "must be one of in_process, celery"),
    ("SHARDPREP_GPU_SLOTS", "0", "must be a positive integer"),
    ("SHARDPREP_AUTOMATION", "maybe", "must be on or off"),
    ("SHARDPREP_CELERY_BACKEND", " ", "is set but empty"),
])
def test_bad_settings_are_named(var, value, message):
    with pytest.raises(SettingsError, match=f"{var}.*{message}"):
        load_settings({var: value})


def test_the_executor_setting_selects_celery_and_routes_pools_to_queues(tmp_path):
    from shardprep_dagster.definitions import build_defs

    config = str(tmp_path / "absent.yaml")  # no config yet: every asset, unversioned
    local = build_defs(config, Settings()).resolve_job_def("shards_job")
    assert local.executor_def.name == "in_process"
    job = build_defs(config, Settings(executor="celery", celery_broker="pyamqp://guest@h//")).resolve_job_def(
        "shards_job")
    assert job.executor_def.name == "celery"
    queues = {node.name: node.definition.tags.get("dagster-celery/queue") for node in job.graph.nodes}
    assert queues["image_shards"] == "download" and queues["clip_embeddings"] == "gpu"
    assert queues["source_parquet"] is None  # dagster-celery's default queue, "dagster"
    assert set(q for q in queues.values() if q) | {"dagster"} == set(QUEUES)


def test_worker_command_and_environment():
    argv = worker_argv(["gpu"], 1, "g0")
    assert argv[1:4] == ["-A", "shardprep_dagster.orchestration.celery_app", "worker"] and "solo" in argv
    assert argv[argv.index("-Q") + 1] == "gpu" and argv[argv.index("-n") + 1].startswith("g0@")
    assert "prefork" in worker_argv(["download", "dagster"], 4, None)
    env = worker_env({"PATH": "/bin"}, "3", "s3://b/c.yaml")
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3", "SHARDPREP_CONFIG": "s3://b/c.yaml"}
    assert CELERY_SETTINGS["task_acks_late"] and CELERY_SETTINGS["task_reject_on_worker_lost"]
