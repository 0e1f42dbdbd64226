"""Steps on many machines: the dagster-celery executor and the ``shardprep worker`` command.

``SHARDPREP_EXECUTOR=celery`` makes every run hand its steps to Celery workers through a broker
(RabbitMQ) instead of executing them in the run's own process. Each step goes to the queue named
after its pool (``download``, ``gpu``; other steps to ``dagster``), so CPU workers take downloads and
one worker per GPU takes the GPU steps. Steps run inside the long-lived worker process, so the model
cache of ``shardprep.models.clip`` / ``shardprep.models.nemo`` survives from shard to shard.

Workers share nothing with the launching machine but the broker, the instance's PostgreSQL and the
object store (output root and dataset config on ``s3://``).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys

DEFAULT_QUEUE = "dagster"  # dagster-celery's queue for steps without a pool
QUEUES = ("download", "gpu", DEFAULT_QUEUE)  # the pools' queues (``assets.shard_runs.in_pool``)

def worker_argv(queues: list[str], concurrency: int, name: str | None, loglevel: str = "INFO") -> list[str]:
    """The ``celery worker`` command line of a shardprep worker.

    One task at a time runs in the worker's own process (``--pool solo``), so a model loaded by one
    step is there for the next; ``concurrency`` > 1 forks that many long-lived children instead."""
    celery = shutil.which("celery", path=os.path.dirname(sys.executable)) or "celery"
    pool = ["--pool", "solo"] if concurrency == 1 else ["--pool", "prefork", "--concurrency", str(concurrency)]
    return [celery, "-A", "shardprep_dagster.orchestration.celery_app", "worker", "--loglevel", loglevel,
            "-Q", ",".join(queues), *pool, "-n", f"{name or 'shardprep-' + str(os.getpid())}@{socket.gethostname()}",
            "--without-gossip", "--without-mingle"]


def worker_env(environ: dict[str, str], gpus: str | None, config: str | None) -> dict[str, str]:
    """The worker's environment: ``gpus`` ("0", "2,3") becomes ``CUDA_VISIBLE_DEVICES`` (the worker owns
    those devices; ``shardprep.models.devices`` locks them by their physical index); ``config`` the dataset
    config the worker's code location loads (the same URL the runs use)."""
    env = dict(environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if config is not None:
        env["SHARDPREP_CONFIG"] = config
    return env
