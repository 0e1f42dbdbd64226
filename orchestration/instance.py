"""Locating the checkout and the Dagster instance the CLI, the demo and the UI share."""

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from shardprep.allocator import collector_paused
from shardprep.storage import atomic_write, file_lock
from shardprep_dagster.orchestration.home import (  # noqa: F401 - where the instance's other users look
    CHECKOUT,
    POSTGRES_ENV_DEFAULTS,
    dagster_home,
    dagster_home_path,
)
from shardprep_dagster.resources.settings import default_download_slots, default_gpu_slots, load_settings


def pool_limits() -> dict[str, int]:
    """Pool limits set on an instance that has none yet (change them in the UI: Deployment > Concurrency).
    One GPU step per device (each leases its own, ``shardprep.models.devices``); downloads are network-bound
    and each step decodes on every core, so a couple of them keep the cores busy."""
    settings = load_settings()
    return {"gpu": settings.gpu_slots or default_gpu_slots(),
            "download": settings.download_slots or default_download_slots()}


@contextlib.contextmanager
def home_lock(home: str | os.PathLike | None, name: str) -> Iterator[None]:
    """Serialise a step between the processes of one machine using one instance (``$DAGSTER_HOME``):
    creating a fresh instance, registering partitions, planning and launching work. No home (an
    ephemeral instance): nothing to share, no lock."""
    if home is None:
        yield
        return
    with file_lock(os.path.join(home, f".shardprep-{name}.lock")):
        yield


def instance_lock(instance, name: str):
    return home_lock(getattr(instance, "root_directory", None), name)


def apply_pool_limits(instance) -> None:
    storage = instance.event_log_storage
    for pool, slots in pool_limits().items():
        if pool in storage.get_concurrency_keys():
            continue
        try:
            storage.set_concurrency_slots(pool, slots)
        except Exception:
            # Processes starting together race to create the row (Postgres: unique violation);
            # the loser keeps the winner's limit, which is the same default or a user's setting.
            if pool not in storage.get_concurrency_keys():
                raise


# What opening an instance imports (its storages, SQLAlchemy, Alembic: ~490 modules, 0.5-0.65 s on 2 cores),
# imported before the instance lock is taken: `shardprep run`'s CLI, its queue daemon and the daemon's code
# server open the instance together at start, and each held the lock through these imports while the others
# waited (the CLI got its instance 1 s after asking, on the critical path of every run)
STORAGE_MODULES = ("dagster._core.storage.sqlite_storage", "dagster._core.storage.runs.sqlite.sqlite_run_storage",
                   "dagster._core.storage.event_log.sqlite.consolidated_sqlite_event_log",
                   "dagster._core.storage.event_log.sqlite.sqlite_event_log",
                   "dagster._core.storage.schedules.sqlite.sqlite_schedule_storage", "dagster._core.instance.factory",
                   "dagster._core.workspace.context", "dagster._core.execution.backfill", "alembic.command",
                   "alembic.config", "alembic.runtime.migration", "dagster._core.secrets.loader",
                   "dagster._core.storage.migration.utils", "dagster._core.storage.root")


def import_storage() -> None:
    """Import what opening an instance imports (STORAGE_MODULES), the cyclic collector paused."""
    import importlib

    with collector_paused():
        for module in STORAGE_MODULES:
            importlib.import_module(module)
    cache_migration_scripts()


def cache_migration_scripts() -> None:
    """One Alembic script directory per migration folder for the life of the process. Dagster asks Alembic
    for a new one at each check or stamp of a schema's revision, which loads every migration script of the
    folder again (~90 files, ~55 ms): three times an instance open (runs, event log, schedules), and once
    more for each run's own SQLite event log, which the queue daemon creates as it creates the run (the
    first runs of `shardprep run` waited on it). The scripts are the installed package's files: they do not
    change while a process lives. Forked processes (the code server, its run workers) inherit the cache."""
    from alembic.script import ScriptDirectory

    if getattr(ScriptDirectory.from_config, "cached", False):
        return
    load = ScriptDirectory.from_config  # (bound to the class)
    scripts: dict = {}
    lock = threading.Lock()

    def from_config(config):
        key = (config.get_alembic_option("script_location"), tuple(config.get_version_locations_list() or ()))
        with lock:
            if key not in scripts:
                scripts[key] = load(config)
            return scripts[key]

    from_config.cached = True
    ScriptDirectory.from_config = staticmethod(from_config)


# Written under the instance's lock once an instance has been opened there (its storage made), holding a
# digest of the dagster.yaml it was opened with: a later process opens that instance without the lock.
MADE_MARK = ".shardprep-instance-made"


def _settings_digest(home: Path) -> str:
    return hashlib.sha256((home / "dagster.yaml").read_bytes()).hexdigest()


def get_instance():
    """The instance of ``$DAGSTER_HOME`` (made on first use), its pool limits set. Two processes making a
    fresh instance at once race in its schema migration, so it is made under the home's lock; once made
    (``MADE_MARK``), processes open it side by side: `shardprep run`'s CLI, queue daemon and the daemon's
    code server open the instance together at start, and each opened it under the lock in turn, the daemon
    ~0.2 s after the CLI had made it, on the path to the first run (bench/E2E.md). A changed dagster.yaml
    (another storage) is made under the lock again."""
    import dagster as dg

    instance = _make()
    if instance is None:
        instance = dg.DagsterInstance.get()
        apply_pool_limits(instance)
    return instance


def ensure_made() -> None:
    """The instance of ``$DAGSTER_HOME`` made (as ``get_instance``), not opened where another process made it."""
    instance = _make()
    if instance is not None:
        instance.dispose()


def _make():
    """The instance, opened and made under the lock if no process had made it (else None)."""
    import dagster as dg

    home = dagster_home()
    import_storage()
    if _made(home):
        return None
    with home_lock(home, "instance"):
        if _made(home):  # (another process made it while this one waited)
            return None
        instance = dg.DagsterInstance.get()
        apply_pool_limits(instance)
        with atomic_write(str(home / MADE_MARK), "w") as f:
            f.write(_settings_digest(home))
        return instance


def _made(home: Path) -> bool:
    try:
        return (home / MADE_MARK).read_text() == _settings_digest(home)
    except FileNotFoundError:
        return False


if __name__ == "__main__":  # `make ui`: prepare the instance before the webserver and daemon start
    get_instance()
    print(os.environ["DAGSTER_HOME"])
