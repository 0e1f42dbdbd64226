"""The dataset resource: one YAML config (source, output root, processing options) for every asset."""

import functools

import dagster as dg

from shardprep.config import DatasetConfig, load_config
from shardprep.layout import Layout


@functools.lru_cache(maxsize=8)
def _load(path: str) -> DatasetConfig:
    return load_config(path)


class DatasetResource(dg.ConfigurableResource):
    """Points at the dataset config file; every asset reads paths and options through it."""

    config_path: str

    @property
    def config(self) -> DatasetConfig:
        return _load(self.config_path)

    @property
    def layout(self) -> Layout:
        return Layout(self.config.output_root)
