"""The code server of `shardprep run`'s queue daemon: Dagster's ``dagster api grpc``, run in a fork of the
daemon (``queue_daemon.fork_code_server``), once the instance exists.

The run workers' forkserver, forked from here first (``run_workers``), opens the instance as it starts. On
a fresh ``DAGSTER_HOME`` the CLI, the daemon and it would each create the SQLite schema and race in its
migration (Alembic's "more than one head"). So the instance is made first, under the lock the CLI and the
daemon take for it (``instance.ensure_made``: not opened here when another process made it).
"""

import sys

from dagster._cli import main as dagster_main

from shardprep_dagster.orchestration import daemon_process, run_workers
from shardprep_dagster.orchestration.instance import ensure_made


def main() -> None:
    """``sys.argv``: ``dagster api grpc <its options>`` (what run_workers.in_code_server looks for)."""
    ensure_made()
    # the code location was imported before this process was forked from the daemon, so its import did not
    # find itself in a code server: the run workers' server is forked here, still single-threaded
    run_workers.fork_from_warm_process(daemon_process.CODE_LOCATION)
    sys.argv[0] = "dagster"
    dagster_main()
