"""diffusion_samples: NeMo diffusion training samples per shard (latents, T5 states, metadata)."""

import dagster as dg

from shardprep.curation.image_scores import read_scores
from shardprep.nemo.diffusion import write_diffusion_samples
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
    **from_record("diffusion_samples"),
    kinds={"webdataset", "pytorch"},
    automation_condition=SHARD_AUTOMATION,
)
def diffusion_samples(context: dg.AssetExecutionContext, config: ShardRunConfig, dataset: DatasetResource,
                      nemo: NemoEncoders) -> dg.MaterializeResult:
    """``<root>/diffusion/{shard}.tar`` with NeMo's diffusion members: ``{key}..pth`` (bf16 latent
    ``[C, 1, h, w]``), ``{key}..pickle`` (float16 T5 states ``[L, d]``, no padding) and ``{key}..json``
    (its ``aesthetic_score`` from image_scores when an aesthetic head is configured, else the source's).
    NaN/Inf latents are recorded failures; a shard with no sample gets no tar."""
    cfg, layout = dataset.config, dataset.layout

    def encode(key: str) -> dict:
        if not exists(layout.tar(key)):
            return {"status": "no samples (shard has no tar)", "samples": 0}
        r = write_diffusion_samples(key, layout, nemo.t5(device.torch_device),
                                    nemo.diffusion_autoencoder(device.torch_device),
                                    resolution=cfg.diffusion_resolution, batch_size=cfg.nemo_batch_size,
                                    scores=read_scores(layout, key, ["aesthetic_score"]),
                                    synthetic_text=cfg.synthetic_text, reuse_latents=not config.rebuild)
        reasons: dict[str, int] = {}
        for f in r.failures:
            reasons[f["reason"]] = reasons.get(f["reason"], 0) + 1
        return {"status": "written", "samples": r.samples, "failures": len(r.failures),
                "failures_by_reason": dg.MetadataValue.json(reasons), "latent_shape": str(r.latent_shape),
                "text_dim": r.text_dim or 0, "latents_reused": r.latents_reused, "bytes": r.tar_bytes,
                "seconds": round(r.seconds, 3)}

    with gpu_device(context, dataset) as device:
        result = materialize_shards(context, dataset, "diffusion_samples", encode, rebuild=config.rebuild)
    return result._replace(metadata={**result.metadata, "device": device.name})
