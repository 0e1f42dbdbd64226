"""The executor every job runs its steps with: in the run's own process (the default), or on Celery workers
(``SHARDPREP_EXECUTOR=celery``; ``orchestration.distributed`` starts those workers with the same settings)."""

from __future__ import annotations

from shardprep_dagster.resources.settings import Settings

# Worker-side Celery settings (the executor passes the same to the workers' app):
# - acks_late + reject_on_worker_lost: a task is acknowledged when its step ends, so a worker killed
#   mid-step (SIGKILL, lost machine) gives its task back to the broker and another worker runs it;
#   the outputs are written atomically, so the dead worker left nothing half-written.
# - prefetch 1: a worker reserves one task at a time; a long step never holds a queue of others.
CELERY_SETTINGS = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "broker_connection_retry_on_startup": True,
    "worker_hijack_root_logger": False,
    "worker_redirect_stdouts_level": "INFO",  # Dagster's step logs are not warnings
}


def celery_config(settings: Settings) -> dict:
    """dagster-celery's executor config (``broker``, ``backend``, ``config_source``) from the settings."""
    return {"broker": settings.celery_broker, "backend": settings.celery_backend,
            "config_source": dict(CELERY_SETTINGS)}


def executor_for(settings: Settings):
    """The executor of every job: one process per run (default), or Celery workers."""
    import dagster as dg

    if settings.executor == "celery":
        from dagster_celery import celery_executor

        return celery_executor.configured(celery_config(settings), name="celery")
    # one process per run, not per step: a run loads each model once and skips ~15 s of imports per step
    return dg.in_process_executor
