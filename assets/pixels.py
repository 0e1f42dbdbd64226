"""The clip_embeddings step's decode of a shard's images also feeds the run's other pixel models (issue 24).

``image_scores`` (its ``pwatermark`` column: LAION's watermark detector on the images) and ``captions``
(the VLM) each decoded every image of a shard tar again after clip_embeddings had. When a run also
materializes them, in this process (the in-process executor, as ``assets.follow``), the clip step and
the download's follower embed a shard with a ``shardprep.pixels.PixelPass``: one decode per image feeds
CLIP, the detector and the captioner. Once the embeddings are written and stamped, this module writes
``captions`` and ``image_scores`` of that shard under their own per-shard protocol (lock, stamp, state
index: ``shard_runs.write_one``; image_scores needs the embedding metadata, so it comes after, and only
when clip_embeddings' blocking check passes for the shard, as Dagster would gate its step), and leaves
their figures in ``shard_runs.FOLLOWED``. Their own steps then find the shards complete and report those
figures: each artifact is still its own asset, step and materialization.

A shard whose captions or scores are already complete at their versions is embedded as before (nothing
shared); under another executor the steps run in other processes and each decodes on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

from shardprep.checks import check_clip_embeddings
from shardprep.models.captioner import load_captioner
from shardprep.models.devices import Device
from shardprep.models.watermark import load_watermark_model
from shardprep.pixels import PixelPass, write_caption_rows
from shardprep.versions import read_stamp
from shardprep_dagster.assets.shard_runs import FOLLOWED, REBUILD_TAG, write_one
from shardprep_dagster.resources.dataset import DatasetResource

SHARED = ("image_scores", "captions")  # the artifacts that can take their pixels from the clip step's decode
IN_PROCESS = ("in_process", "execute_in_process_executor")  # the executors that run every step in one process


def _in_run(context: dg.AssetExecutionContext) -> set[dg.AssetKey]:
    if context.job_def.executor_def.name not in IN_PROCESS:
        return set()
    return set(context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys)


def _rebuild(context: dg.AssetExecutionContext, artifact: str) -> bool:
    """Whether ``artifact``'s own step would redo complete shards (its run config, or the run's tag)."""
    ops = (context.run.run_config or {}).get("ops", {})
    return bool(ops.get(artifact, {}).get("config", {}).get("rebuild")) or context.run.tags.get(REBUILD_TAG) == "true"


class Sharing:
    """One run's sharing, for the clip step or the follower: ``pass_for(shard)`` before a shard is embedded,
    ``finish(shard)`` after its embeddings are complete."""

    def __init__(self, context: dg.AssetExecutionContext, dataset: DatasetResource, device: Callable[[], Device]):
        cfg = dataset.config
        selected = _in_run(context)
        wanted = {"image_scores": cfg.watermark_model is not None, "captions": cfg.captioner is not None}
        self.artifacts = [a for a in SHARED if wanted[a] and dg.AssetKey(a) in selected]
        self.rebuild = {a: _rebuild(context, a) for a in self.artifacts}
        self.dataset, self.device = dataset, device
        self.pending: dict[str, tuple[list[str], PixelPass]] = {}

    def __bool__(self) -> bool:
        return bool(self.artifacts)

    def pass_for(self, key: str) -> PixelPass | None:
        """The models to feed while embedding ``key``: those of the shared artifacts not complete yet."""
        layout, versions, cfg = self.dataset.layout, self.dataset.versions, self.dataset.config
        todo = [a for a in self.artifacts
                if self.rebuild[a] or (read_stamp(layout, a, key) or {}).get("version") != versions[a]]
        if not todo:
            return None
        device = self.device().torch_device
        pixels = PixelPass(
            detector=load_watermark_model(cfg.watermark_model, device) if "image_scores" in todo else None,
            watermark_batch=cfg.batch_size,
            captioner=load_captioner(cfg.captioner, device) if "captions" in todo else None,
            caption_batch=cfg.caption_batch_size, prompt=cfg.caption_prompt,
            max_new_tokens=cfg.caption_max_new_tokens)
        self.pending[key] = (todo, pixels)
        return pixels

    def finish(self, key: str) -> None:
        """Write what the pass made for ``key`` as the shared artifacts' outputs (module docstring)."""
        todo, pixels = self.pending.pop(key, ((), None))
        layout, cfg = self.dataset.layout, self.dataset.config
        for artifact in todo:
            # clip_embeddings' blocking check, as that asset runs it
            if artifact == "image_scores" and not check_clip_embeddings(layout, key, cfg.text_embeddings).passed:
                continue  # its step will not run on this shard either
            version = self.dataset.versions[artifact]
            write = {"captions": self._captions, "image_scores": self._scores}[artifact]
            result = write_one(layout, artifact, version, key, lambda k, w=write: w(k, pixels),
                               rebuild=self.rebuild[artifact])
            if result["status"] != "cached":
                FOLLOWED[(artifact, key, version)] = {**result, "decoded": "once, with clip_embeddings"}

    def _captions(self, key: str, pixels: PixelPass) -> dict:
        # the captions asset's figures, from the pass's rows
        from shardprep_dagster.assets.captions import captions_metadata

        layout = self.dataset.layout
        report = write_caption_rows(key, layout, pixels.caption_rows)
        return captions_metadata(layout, self.dataset.config, key, report, "image", self.device().name)

    def _scores(self, key: str, pixels: PixelPass) -> dict:
        from shardprep_dagster.assets.scores import score_models, score_shard

        heads, models = score_models(self.dataset.config)
        return score_shard(self.dataset.layout, key, heads, models, pixels.watermark_scores(), self.device().name)
