import warnings

# The shards job runs one shard (CLI); asset backfills from the UI use each asset's own BackfillPolicy, so
# the job-level "varying BackfillPolicies" warning does not apply. Partitioned checks are a preview API.
warnings.filterwarnings("ignore", message=".*varying BackfillPolicies")
warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec")
warnings.filterwarnings("ignore", message="Parameter `backfill_policy` of function `asset` is currently in beta")

from shardprep.artifacts import ARTIFACTS, GLOBALS, PER_SHARD
from shardprep_dagster.assets.captions import captions
from shardprep_dagster.assets.diffusion import diffusion_samples
from shardprep_dagster.assets.duplicates import duplicates
from shardprep_dagster.assets.embeddings import clip_embeddings, reordered_embeddings
from shardprep_dagster.assets.energon import diffusion_energon_index, image_energon_index
from shardprep_dagster.assets.images import image_shards
from shardprep_dagster.assets.nemo import balanced_shards, precached_encodings, wdinfo
from shardprep_dagster.assets.partitions import shard_partitions
from shardprep_dagster.assets.report import dataset_report
from shardprep_dagster.assets.scores import image_scores
from shardprep_dagster.assets.selection import sample_selection
from shardprep_dagster.assets.source import source_parquet
from shardprep_dagster.assets.takedowns import takedowns
from shardprep_dagster.assets.training_text import training_text
from shardprep_dagster.assets.video_diffusion import video_diffusion_samples
from shardprep_dagster.assets.videos import video_shards

_BY_NAME = {a.key.path[-1]: a for a in (source_parquet, image_shards, video_shards, clip_embeddings,
                                        reordered_embeddings, image_scores, captions, training_text, diffusion_samples, video_diffusion_samples,
                                        takedowns, duplicates, sample_selection, balanced_shards, wdinfo, precached_encodings,
                                        image_energon_index, diffusion_energon_index, dataset_report)}
# in the records' order (shardprep.artifacts): a record without its asset fails here, at import
per_shard_assets = [_BY_NAME[name] for name in PER_SHARD]
global_assets = [_BY_NAME[name] for name in GLOBALS]


def batched(kind: str) -> list:
    """The per-shard assets whose backfill runs take ``kind``'s shards-per-run ("download", "gpu")."""
    return [_BY_NAME[name] for name in PER_SHARD if ARTIFACTS[name].batch == kind]


__all__ = ["balanced_shards", "batched", "captions", "clip_embeddings", "dataset_report", "diffusion_energon_index",
           "diffusion_samples", "duplicates", "global_assets", "image_energon_index", "image_scores", "image_shards",
           "per_shard_assets", "precached_encodings", "reordered_embeddings", "sample_selection", "shard_partitions",
           "source_parquet", "takedowns", "training_text", "video_diffusion_samples", "video_shards", "wdinfo"]
