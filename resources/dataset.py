"""The dataset resource: one YAML config (source, output root, processing options) for every asset."""

import functools
import os
import socket

import dagster as dg
from pydantic import PrivateAttr

from shardprep.allocator import freeze_startup_objects
from shardprep.config import DatasetConfig, load_config
from shardprep.layout import Layout
from shardprep.storage import stat
from shardprep.versions import artifact_versions
from shardprep_dagster.resources.settings import load_settings


@functools.lru_cache(maxsize=8)
def _load(path: str, stamp: tuple[int, str]) -> tuple[DatasetConfig, dict[str, str]]:
    cfg = load_config(path)
    return cfg, artifact_versions(cfg)


def load_dataset(path: str) -> tuple[DatasetConfig, dict[str, str]]:
    """The config at ``path`` and its artifact versions, read again whenever the file changes (a
    long-lived code server sees an edited config without a restart)."""
    try:
        stamp = stat(path)
    except OSError:
        stamp = (-1, "")  # missing: load_config names the file in its error
    return _load(path, stamp)


CONFIG_TAG = "shardprep/config"  # a run carrying it runs that config, whatever the code location serves
# the process and machine executing a run: `shardprep run` marks the run failed when that process is gone
PID_TAG, HOST_TAG = "shardprep/pid", "shardprep/host"


class DatasetResource(dg.ConfigurableResource):
    """Points at the dataset config file; every asset reads paths and options through it.

    ``config_path`` is the code location's config (``SHARDPREP_CONFIG``: UI, sensor and automation
    runs). A run tagged ``shardprep/config`` (what ``shardprep run --config`` submits) uses that file
    instead, so a run always executes the config that launched it, whichever daemon launches it."""

    config_path: str
    _run_config_path: str | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        # a run worker's imports are done: the collector need not walk them again (shardprep.allocator)
        freeze_startup_objects()
        run = context.run
        self._run_config_path = run.tags.get(CONFIG_TAG) if run is not None else None
        # the run's process, by which recover_dead_runs knows it alive: only where the steps run in the run's
        # own process. A Celery step worker is not the run: killed, it gives its task back and another
        # worker goes on, so its pid marked a live run failed, and `shardprep run` started the global
        # assets while shards were still being written (tests/test_distributed.py: the diffusion index
        # missed 6 of 8 tars); the run worker's own pid, which Dagster logs, stands for the run there
        if run is not None and context.instance is not None and run.tags.get(PID_TAG) != str(os.getpid()) \
                and load_settings().executor != "celery":
            context.instance.add_run_tags(run.run_id, {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()})

    @property
    def path(self) -> str:
        return self._run_config_path or self.config_path

    @property
    def config(self) -> DatasetConfig:
        return load_dataset(self.path)[0]

    @property
    def versions(self) -> dict[str, str]:
        """``{artifact: version}`` of this config (``shardprep.versions``)."""
        return load_dataset(self.path)[1]

    @property
    def layout(self) -> Layout:
        return Layout(self.config.output_root)
