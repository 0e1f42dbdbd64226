"""video_diffusion_samples: NeMo diffusion samples of the video shards (video latents, T5 states)."""

import dagster as dg

from shardprep.nemo.video_diffusion import write_video_diffusion_samples
from shardprep.storage import exists
from shardprep_dagster.assets.shard_runs import (
    SHARD_AUTOMATION,
    ShardRunConfig,
    from_record,
    gpu_device,
    materialize_shards,
)
from shardprep_dagster.resources.dataset import DatasetResource
from shardprep_dagster.resources.nemo import NemoEncoders


@dg.asset(
    **from_record("video_diffusion_samples"),
    kinds={"webdataset", "pytorch"},
    automation_condition=SHARD_AUTOMATION,
)
def video_diffusion_samples(context: dg.AssetExecutionContext, config: ShardRunConfig, dataset: DatasetResource,
                            nemo: NemoEncoders) -> dg.MaterializeResult:
    """``<root>/diffusion/{shard}.tar`` for a video shard, beside the image shards' in one energon
    dataset: ``{key}..pth`` (bf16 latent ``[C, T', h, w]`` of a causal video autoencoder, T' = 1 + (T-1)/tc),
    ``{key}..pickle`` (T5 states) and ``{key}..json`` (caption, height, width, framerate, num_frames, ...).
    Image shards: not applicable (``diffusion_samples`` makes theirs)."""
    cfg, layout = dataset.config, dataset.layout

    def encode(key: str) -> dict:
        if not exists(layout.video_tar(key)):
            return {"status": "no samples (shard has no video tar)", "samples": 0}
        r = write_video_diffusion_samples(layout.video_tar(key), layout.diffusion_tar(key),
                                          nemo.t5(device.torch_device), nemo.video_autoencoder(device.torch_device),
                                          resolution=cfg.video_diffusion_resolution,
                                          max_frames=cfg.video_diffusion_frames, batch_size=cfg.nemo_batch_size)
        reasons: dict[str, int] = {}
        for f in r.failures:
            reasons[f["reason"]] = reasons.get(f["reason"], 0) + 1
        return {"status": "written", "samples": r.samples, "failures": len(r.failures),
                "failures_by_reason": dg.MetadataValue.json(reasons), "latent_shapes": str(r.latent_shapes),
                "text_dim": r.text_dim or 0, "bytes": r.tar_bytes, "seconds": round(r.seconds, 3)}

    with gpu_device(context, dataset) as device:
        result = materialize_shards(context, dataset, "video_diffusion_samples", encode, rebuild=config.rebuild)
    return result._replace(metadata={**result.metadata, "device": device.name})
