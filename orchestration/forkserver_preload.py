"""Imported once by the run workers' forkserver (``run_workers``) before its first fork: what every run's
process would otherwise load for itself before its first event.

A run's process opens the instance first (``DagsterInstance.from_ref``): SQLAlchemy, Alembic, the storage
classes, ~470 modules, 2.0 s in a fresh interpreter on the 2-core benchmark machine. The instance is opened
and closed here, so its modules are loaded once for all runs; it keeps no connection (closed before any
fork) and no thread (a thread left here would be missing from every fork, and any lock it held, held for ever; tested).
"""

import os

from dagster import DagsterInstance


def _warm_instance() -> None:
    if not os.environ.get("DAGSTER_HOME"):  # an ephemeral instance: nothing on disk to open
        return
    with DagsterInstance.get() as instance:
        instance.get_run_by_id("")  # the run storage's first query: its schema checks, its statements


_warm_instance()
