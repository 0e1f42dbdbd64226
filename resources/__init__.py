"""The code location's resources. Imported lazily: ``resources.settings`` (read by the CLI before it
needs Dagster) must not import Dagster through this package."""

__all__ = ["ClipResource", "DatasetResource", "NemoEncoders"]


def __getattr__(name: str):
    if name == "ClipResource":
        from shardprep_dagster.resources.clip import ClipResource

        return ClipResource
    if name == "DatasetResource":
        from shardprep_dagster.resources.dataset import DatasetResource

        return DatasetResource
    if name == "NemoEncoders":
        from shardprep_dagster.resources.nemo import NemoEncoders

        return NemoEncoders
    raise AttributeError(name)
