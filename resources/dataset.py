"""The dataset resource: one YAML config (source, output root, processing options) for every asset."""

import functools

import dagster as dg

from shardprep.config import DatasetConfig, load_config
from shardprep.layout import Layout
from shardprep.storage import stat
from shardprep.versions import artifact_versions


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


class DatasetResource(dg.ConfigurableResource):
    """Points at the dataset config file; every asset reads paths and options through it."""

    config_path: str

    @property
    def config(self) -> DatasetConfig:
        return load_dataset(self.config_path)[0]

    @property
    def versions(self) -> dict[str, str]:
        """``{artifact: version}`` of this config (``shardprep.versions``)."""
        return load_dataset(self.config_path)[1]

    @property
    def layout(self) -> Layout:
        return Layout(self.config.output_root)
