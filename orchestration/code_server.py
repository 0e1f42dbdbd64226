"""The code server started beside `shardprep run`'s queue daemon (``daemon_process.start_code_server``):
Dagster's ``dagster api grpc``, once the instance exists.

Dagster's code server opens the instance before it loads the code location. On a fresh ``DAGSTER_HOME``
the CLI, the daemon and the code server, started together, would each create the SQLite schema and race in
its migration (Alembic's "more than one head"). So the instance is opened here first, under the lock the
CLI and the daemon take for it (``instance.get_instance``); Dagster's code server then finds it made.

    python -m shardprep_dagster.orchestration.code_server api grpc <dagster api grpc's options>
"""

import sys

from dagster._cli import main as dagster_main

from shardprep_dagster.orchestration.instance import get_instance


def main() -> None:
    get_instance().dispose()
    sys.argv[0] = "dagster"  # the arguments stay `api grpc ...`: what run_workers.in_code_server looks for
    dagster_main()


if __name__ == "__main__":
    main()
