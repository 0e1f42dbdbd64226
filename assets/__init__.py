import warnings

# The shards job runs one shard (CLI); asset backfills from the UI use each asset's own BackfillPolicy, so
# the job-level "varying BackfillPolicies" warning does not apply. Partitioned checks are a preview API.
warnings.filterwarnings("ignore", message=".*varying BackfillPolicies")
warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec")
warnings.filterwarnings("ignore", message="Parameter `backfill_policy` of function `asset` is currently in beta")

from assets.diffusion import diffusion_samples
from assets.duplicates import duplicates
from assets.embeddings import clip_embeddings, reordered_embeddings
from assets.energon import diffusion_energon_index, image_energon_index
from assets.images import image_shards
from assets.nemo import balanced_shards, precached_encodings, wdinfo
from assets.partitions import shard_partitions
from assets.report import dataset_report
from assets.scores import image_scores
from assets.selection import sample_selection
from assets.source import source_parquet
from assets.video_diffusion import video_diffusion_samples
from assets.videos import video_shards

# image_shards and what is made from it do image shards, video_shards and video_diffusion_samples video
# shards (the ledger knows which is which); each materializes the other kind as "not applicable"
per_shard_assets = [source_parquet, image_shards, video_shards, clip_embeddings, reordered_embeddings, image_scores,
                    diffusion_samples, video_diffusion_samples]
# backfill runs take several shards each (counts: resources/settings.py), per kind of step
GPU_BATCHED = [clip_embeddings, reordered_embeddings, image_scores, diffusion_samples, video_diffusion_samples]
DOWNLOAD_BATCHED = [source_parquet, image_shards, video_shards]
# turned off by the config's enable_nemo_text2img / enable_nemo_diffusion
NEMO_TEXT2IMG = [balanced_shards, wdinfo, precached_encodings]
NEMO_DIFFUSION = [diffusion_samples, video_diffusion_samples, diffusion_energon_index]
global_assets = [duplicates, sample_selection, balanced_shards, wdinfo, precached_encodings, image_energon_index,
                 diffusion_energon_index, dataset_report]

__all__ = ["DOWNLOAD_BATCHED", "GPU_BATCHED", "NEMO_DIFFUSION", "NEMO_TEXT2IMG", "balanced_shards", "clip_embeddings",
           "dataset_report", "diffusion_energon_index", "diffusion_samples", "duplicates", "global_assets", "image_energon_index",
           "image_scores", "sample_selection",
           "image_shards", "per_shard_assets", "precached_encodings", "reordered_embeddings", "shard_partitions",
           "source_parquet", "video_diffusion_samples", "video_shards", "wdinfo"]
