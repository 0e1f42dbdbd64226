"""Where the Dagster instance lives (``$DAGSTER_HOME``), with nothing but the standard library imported: the
first thing `shardprep run` does is start its queue daemon there (``cli._start_daemon_early``), and every
import before that delays the daemon's own imports, which lie on the path to the first run (the heavier
``orchestration.instance`` delayed it by ~0.13 s, bench/E2E.md)."""

import os
import shutil
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent

# The server dagster.postgres.yaml points at, unless the environment names another (the yaml can only
# read environment variables, which it requires to be set).
POSTGRES_ENV_DEFAULTS = {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": "5432", "DAGSTER_PG_USER": "postgres",
                         "DAGSTER_PG_PASSWORD": "", "DAGSTER_PG_DB": "test"}


def dagster_home_path() -> Path:
    """$DAGSTER_HOME, defaulting to ``<checkout>/.dagster_home``; nothing made."""
    return Path(os.environ.get("DAGSTER_HOME") or CHECKOUT / ".dagster_home").resolve()


def dagster_home() -> Path:
    """``dagster_home_path()``, created with the repo's dagster.yaml."""
    for var, value in POSTGRES_ENV_DEFAULTS.items():
        os.environ.setdefault(var, value)
    home = dagster_home_path()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copy(CHECKOUT / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home
