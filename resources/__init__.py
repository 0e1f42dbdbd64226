from shardprep_dagster.resources.clip import ClipResource
from shardprep_dagster.resources.dataset import DatasetResource
from shardprep_dagster.resources.nemo import NemoEncoders

__all__ = ["ClipResource", "DatasetResource", "NemoEncoders"]
