"""Within one run on one machine, a shard's embedding starts as soon as its download is done.

With the in-process executor a run's steps execute one after the other in one process, and Dagster
starts ``clip_embeddings`` only once ``image_shards`` has finished every shard of the run's blocks: a
block of 100 shards would download for an hour while the model waits. So the download step hands each
shard it finishes (or finds complete) to a follower thread, which embeds it at once under the clip
artifact's own per-shard protocol (lock, stamp, state index: ``shard_runs.write_one``). Downloading
shard k+1 overlaps embedding shard k. The clip step then runs as always: it finds those shards complete
and reports them with the figures the follower recorded (``shard_runs.FOLLOWED``), runs its check and
materializes its partitions, so each artifact is still its own asset, step, check and materialization.

When the run also materializes ``captions`` and ``image_scores``' watermark column, the follower feeds
their models from its decode of the images and writes them too, under their own protocol
(``assets.pixels``): one decode per image in the run.

The follower only embeds a shard whose tar passes ``image_shards``' blocking check, holds the device
lease while it works (one GPU step per device, as ever), and gives up quietly when the device is busy
or a shard fails: what it leaves is done, or reported failed, by the clip step itself. Under the Celery
executor the steps run on different workers (a GPU one for the embedding), so nothing follows there.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import dagster as dg

from shardprep.checks import check_image_shard
from shardprep.models.devices import lease
from shardprep_dagster.assets.pixels import SHARED, Sharing
from shardprep_dagster.assets.shard_runs import DEVICE_TAG, FOLLOWED, rebuilding, write_one
from shardprep_dagster.resources.clip import ClipResource
from shardprep_dagster.resources.dataset import DatasetResource

FOLLOWER = "clip_embeddings"
IN_PROCESS = ("in_process", "execute_in_process_executor")  # the executors that run every step in one process


def _follows(context: dg.AssetExecutionContext) -> bool:
    """The run also materializes the follower's asset, in this process (in-process executor)."""
    selection = context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys
    return context.job_def.executor_def.name in IN_PROCESS and dg.AssetKey(FOLLOWER) in selection


@contextlib.contextmanager
def embedding(context: dg.AssetExecutionContext, dataset: DatasetResource, clip: ClipResource,
              rebuild: bool = False) -> Iterator[Callable[[str], None] | None]:
    """Yields ``on_done(shard)`` for ``materialize_shards`` (None when nothing follows in this run);
    on exit, waits for the follower to finish the shards handed to it."""
    if not _follows(context):
        yield None
        return
    from shardprep_dagster.assets.embeddings import embed_shard  # the clip asset's own per-shard work

    # figures an earlier run of this process left (its clip step never ran: the download step failed) are
    # not this run's
    for stale in [k for k in FOLLOWED if k[0] in (FOLLOWER, *SHARED)]:
        del FOLLOWED[stale]
    layout, version = dataset.layout, dataset.versions[FOLLOWER]
    rebuild = rebuilding(context, rebuild)
    todo: queue.Queue[str | None] = queue.Queue()

    def follow() -> None:
        try:
            # no wait: with the device busy (another run's GPU step), the clip step does the work later
            with lease(dataset.config.device, wait_seconds=0) as device:
                # the run shows which device embedded its shards, as a GPU step's lease does
                context.instance.add_run_tags(context.run.run_id, {f"{DEVICE_TAG}/{FOLLOWER}": device.name})
                encoder = clip.encoder(device.torch_device)
                # the run's captions and watermark scores from the same decode of each image (assets.pixels)
                sharing = Sharing(context, dataset, lambda: device)
                while (key := todo.get()) is not None:
                    if not check_image_shard(layout, key).passed:
                        continue  # the blocking check fails: the clip step will not run on it either
                    result = write_one(layout, FOLLOWER, version, key,
                                       lambda k: embed_shard(layout, dataset.config, clip, encoder, k, device,
                                                             pixels=sharing.pass_for if sharing else None),
                                       rebuild=rebuild)
                    if result["status"] != "cached":
                        FOLLOWED[(FOLLOWER, key, version)] = {**result, "embedded": "following the download"}
                    sharing.finish(key)
        except Exception as e:  # noqa: BLE001 - its own step does (or reports) what is left
            context.log.warning(f"{FOLLOWER} stopped following the download ({type(e).__name__}: {e}); "
                                "its own step does the remaining shards")

    # the queue is unbounded: handing a shard over never blocks the download, even after a failure here
    thread = threading.Thread(target=follow, name=f"follow-{FOLLOWER}", daemon=True)
    thread.start()
    try:
        yield todo.put
    finally:
        todo.put(None)
        thread.join()
