"""The Celery app shardprep workers run (``celery -A orchestration.celery_app worker``; ``shardprep worker``
starts it): dagster-celery's step task, with the broker, backend and settings of
``orchestration.distributed`` (``SHARDPREP_CELERY_BROKER`` / ``SHARDPREP_CELERY_BACKEND``), so the
runs and the workers always agree."""

from dagster._core.execution.retries import RetryMode
from dagster_celery.executor import CeleryExecutor
from dagster_celery.make_app import make_app
from dagster_celery.tasks import create_task

from orchestration.distributed import celery_config
from resources.settings import load_settings

app = make_app(CeleryExecutor(retries=RetryMode(RetryMode.DISABLED), **celery_config(load_settings())).app_args())
execute_plan = create_task(app)
