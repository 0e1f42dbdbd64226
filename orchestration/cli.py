"""The ``shardprep`` command: runs, status, backfills and verification of a dataset through Dagster.

Part of the Dagster side; the core library (``shardprep``) never imports it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def print_summary(summary) -> None:
    total = len(summary.shards)
    unit = "shards" if summary.shards_per_partition == 1 else "blocks"
    width = max([len(a) for a in summary.materialized] + [5])
    print(f"\n{'asset'.ljust(width)}  materialized")
    for asset, n in summary.materialized.items():
        done = ("yes" if n else "no") if asset in summary.global_assets else f"{n} of {total} {unit}"
        print(f"{asset.ljust(width)}  {done}")
    blocks = (f" in {total} blocks of up to {summary.shards_per_partition}" if summary.shards_per_partition > 1
              else "")
    print(f"\nshards: {summary.shard_count or total}{blocks} ({len(summary.new_shards)} new), runs this time: "
          f"{summary.runs}, failed: {len(summary.failed)}")
    for backfill_id in summary.backfills:
        print(f"backfill {backfill_id} (in the UI: Overview > Backfills)")
    if summary.global_run is not None:
        print(f"run {summary.global_run[:8]}: the unpartitioned assets, in this process (in the UI: Runs)")
    for backfill_id in summary.waited_on:
        print(f"waited for backfill {backfill_id} of another process, which had some of this work in flight")
    for url in summary.appended_sources:
        print(f"note: rows appended to {url} became new shards")
    for url in summary.empty_sources:
        print(f"note: source file has no rows, no shards made: {url}")
    for shard, err in summary.failed.items():
        print(f"FAILED shard {shard}: {err}")
    if summary.stopped_by is not None:
        print(f"stopped by {signal.Signals(summary.stopped_by).name}: the run in progress was cancelled; "
              f"{len(summary.not_run)} shard(s) left for the next run (only complete outputs were kept)")


def _start_daemon_early(config: str) -> None:
    """The queue daemon starts first thing, its imports beside ours (``orchestration.daemon_process``), and
    waits for our go before it touches the instance, given once the config is known to be good: a bad one
    is refused before an instance is opened or its folder made, and the daemon leaves. (Checking the config
    first, 0.45 CPU-s of pydantic and the YAML, held the daemon back: the first run was enqueued 0.1-0.3 s
    later, bench/E2E.md.)"""
    from shardprep_dagster.orchestration.daemon_process import release, start_early
    from shardprep_dagster.orchestration.home import dagster_home, dagster_home_path

    daemon = start_early(str(dagster_home_path()), wait_for_go=True)
    go = False
    try:
        from shardprep.config import config_url, load_config

        load_config(config_url(config))
        dagster_home()  # made, with its dagster.yaml, before the daemon opens the instance
        go = True
    finally:
        release(daemon, go)


def cmd_run(args: argparse.Namespace) -> int:
    from shardprep.allocator import collector_paused
    from shardprep.errors import ShardprepError

    try:
        if not args.in_process:
            _start_daemon_early(args.config)
        with collector_paused():  # Dagster and the code location: ~4 full collections otherwise, at the start
            from shardprep_dagster.orchestration.runner import run_pipeline

        if args.verify:
            _verify(args.config, mark=True)
        summary = run_pipeline(args.config, rebuild=args.rebuild, progress=not args.no_progress,
                               in_process=args.in_process, shards=args.shards)
    except ShardprepError as e:  # bad config, source or ledger: named, nothing was run
        print(f"shardprep: {e}", file=sys.stderr)
        return 2
    print_summary(summary)
    if summary.stopped_by is not None:
        # the shell's convention for "killed by this signal"; at once: everything is recorded, and tearing
        # down the interpreter (Dagster's modules) would take another second of a stop's grace period
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + summary.stopped_by)
    return 0 if summary.ok else 1


def _verify(config: str, mark: bool, rebuild_index: bool = False):
    from shardprep.config import config_url, load_config
    from shardprep_dagster.orchestration.instance import get_instance
    from shardprep_dagster.orchestration.verify import verify_dataset

    load_config(config_url(config))  # a bad config is named before the instance is opened
    report = verify_dataset(config, get_instance(), mark=mark, rebuild_index=rebuild_index)
    print(report.summary())
    return report


def cmd_verify(args: argparse.Namespace) -> int:
    from shardprep.errors import ShardprepError

    try:
        report = _verify(args.config, mark=not args.no_mark, rebuild_index=args.rebuild_index)
    except ShardprepError as e:
        print(f"shardprep verify: {e}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1


def cmd_reshard(args: argparse.Namespace) -> int:
    from shardprep.errors import ShardprepError
    from shardprep_dagster.orchestration.reshard import reshard

    try:
        result = reshard(args.config, args.source)
    except ShardprepError as e:
        print(f"shardprep reshard: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    from shardprep.errors import ShardprepError
    from shardprep.images.retry import parse_reasons
    from shardprep_dagster.orchestration.retry import retry

    try:
        reasons = parse_reasons(args.reasons)
        reports = retry(args.config, reasons, shards=args.shards, on_report=lambda r: print(r.summary(), flush=True))
    except (ShardprepError, ValueError) as e:  # a bad config, selection or reason class: named
        print(f"shardprep retry: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a shard that could not be rewritten: named, exit 1
        print(f"shardprep retry: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    retried = sum(r.retried for r in reports)
    recovered = sum(r.recovered for r in reports)
    changed = [r.shard for r in reports if r.invalidated]
    print(f"{len(reports)} shard(s) looked at, {retried} row(s) retried, {recovered} now successful, "
          f"{retried - recovered} still failed")
    if changed:
        print(f"{len(changed)} shard(s) gained samples: their downstream outputs are marked to be made again; "
              "run `shardprep run` to make them")
    return 0


def cmd_takedown(args: argparse.Namespace) -> int:
    from shardprep.errors import ShardprepError
    from shardprep_dagster.orchestration.takedown import takedown

    def shard_line(done) -> None:
        parts = ", ".join(f"{a} {n}" for a, n in done.artifacts.items() if n)
        print(f"shard {done.shard}: {len(done.removed)} sample(s) removed ({parts or 'no files held them'})",
              flush=True)

    try:
        report, summary = takedown(args.config, args.list or [], run=not args.no_run, on_shard=shard_line,
                                   in_process=args.in_process)
    except ShardprepError as e:  # a bad config or list: named, nothing was changed
        print(f"shardprep takedown: {e}", file=sys.stderr)
        return 2
    for lst in report.lists:
        print(f"list {lst['version']} ({lst['entries']} entries, {'new' if lst['new'] else 'registered before'}): "
              f"{lst['source']}")
    per_artifact = report.per_artifact()
    print(f"{report.removed} sample(s) removed from {len(report.shards)} shard(s) "
          f"({report.checked} shard(s) checked)" + (": " if per_artifact else ""))
    for name, n in per_artifact.items():
        print(f"  {name}: {n}")
    if report.audit:
        print(f"audit record: {report.audit}")
    if summary is not None:
        print_summary(summary)
        return 0 if summary.ok else 1
    if report.shards and args.no_run:
        print("global artifacts not updated yet (--no-run): `shardprep run` updates them")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from shardprep_dagster.orchestration.status import status

    print(status(args.config))
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    from shardprep_dagster.orchestration.backfill import BackfillError, launch_backfill

    partitions = [p.strip() for p in args.partitions.split(",") if p.strip()] if args.partitions else None
    try:
        backfill = launch_backfill(args.url, args.assets, partitions=partitions, all_missing=args.all_missing)
    except BackfillError as e:
        print(f"shardprep backfill: {e}", file=sys.stderr)
        return 2
    if backfill is None:
        print("nothing to backfill: every selected partition is materialized or in progress")
        return 0
    print(backfill.backfill_id)
    shards = f"{len(backfill.partitions)} partition(s)" if backfill.partitions else "unpartitioned"
    print(f"backfill {backfill.backfill_id} launched at {args.url}: {', '.join(backfill.assets)} ({shards})",
          file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Replace this process with a Celery worker (signals reach it directly; SIGTERM: a warm shutdown, the
    downloads in flight abandoned: ``orchestration.celery_app``)."""
    from shardprep_dagster.orchestration.distributed import QUEUES, worker_argv, worker_env

    queues = args.queue or list(QUEUES)
    argv = worker_argv(queues, args.concurrency, args.name, args.loglevel)
    os.execve(argv[0], argv, worker_env(dict(os.environ), args.gpus, args.config))
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardprep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="register new source files and materialize every missing shard asset")
    run.add_argument("--config", required=True, help="dataset config YAML")
    run.add_argument("--rebuild", action="store_true", help="redo every shard, even complete ones")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--shards", help="only these shards, e.g. 12-40,55 (ids; a block runs only them)")
    run.add_argument("--in-process", action="store_true",
                     help="one shard after the other in this process, not through Dagster's run queue "
                          "(debugging; output roots only this process sees, such as memory://)")
    run.add_argument("--verify", action="store_true",
                     help="first re-read every finished output and redo the broken ones (see `verify`)")
    run.set_defaults(func=cmd_run)
    verify = sub.add_parser("verify", help="re-read every finished output cheaply; report the broken ones and mark "
                            "them so the next run repairs them (exit 1 if any)")
    verify.add_argument("--config", required=True, help="dataset config YAML")
    verify.add_argument("--no-mark", action="store_true", help="only report, mark nothing for re-materialization")
    verify.add_argument("--rebuild-index", action="store_true",
                        help="make the state index (what `status` reads) again from the stamps")
    verify.set_defaults(func=cmd_verify)
    reshard = sub.add_parser("reshard", help="re-shard a source file rewritten after registration: shards whose "
                             "rows changed are redone by the next run, the others kept")
    reshard.add_argument("--config", required=True, help="dataset config YAML")
    reshard.add_argument("--source", required=True, help="the source file (path or URL) to re-shard")
    reshard.set_defaults(func=cmd_reshard)
    retry = sub.add_parser("retry", help="download again the failed rows of finished image shards whose failure "
                           "may pass (timeouts, 429, 5xx, connection); the next `run` redoes their downstream")
    retry.add_argument("--config", required=True, help="dataset config YAML")
    retry.add_argument("--reasons", default="transient",
                       help="transient (default), or some of timeout,429,5xx,connection,robots or a "
                            "transient HTTP status (503); permanent failures are never retried")
    retry.add_argument("--shards", help="only these shards, e.g. 12-40,55")
    retry.set_defaults(func=cmd_retry)
    take = sub.add_parser("takedown", help="remove the samples a takedown list names (URLs, domains, keys, "
                          "sha256) from every artifact, keep them out of later runs, and record an audit entry")
    take.add_argument("--config", required=True, help="dataset config YAML")
    take.add_argument("--list", action="append", help="a takedown list (parquet, CSV or text; any fsspec URL); "
                      "repeatable; without one, the config's takedown_lists are applied")
    take.add_argument("--no-run", action="store_true", help="change the shards only; the next `shardprep run` "
                      "updates the global artifacts")
    take.add_argument("--in-process", action="store_true", help="update the global artifacts in this process")
    take.set_defaults(func=cmd_takedown)
    status = sub.add_parser("status", help="per asset: shards materialized / failed / missing ($DAGSTER_HOME)")
    status.add_argument("--config", help="dataset config YAML (default: the code location's)")
    status.set_defaults(func=cmd_status)
    backfill = sub.add_parser("backfill", help="launch an asset backfill in the running Dagster webserver")
    backfill.add_argument("assets", metavar="ASSET_SELECTION", help="comma-separated asset names, or '*' for all")
    which = backfill.add_mutually_exclusive_group()
    which.add_argument("--partitions", help="comma-separated shard keys, e.g. 00000,00001")
    which.add_argument("--all-missing", action="store_true",
                       help="every shard some selected asset has not materialized (failed ones included)")
    backfill.add_argument("--url", default="http://127.0.0.1:3000", help="the Dagster webserver")
    backfill.set_defaults(func=cmd_backfill)
    worker = sub.add_parser("worker", help="a Celery worker that executes the steps of runs started with "
                            "SHARDPREP_EXECUTOR=celery (broker: SHARDPREP_CELERY_BROKER)")
    worker.add_argument("--queue", "-q", action="append", choices=["download", "gpu", "dagster"],
                        help="a queue to take steps from (repeat; default: all): download, gpu, or dagster "
                             "(steps without a pool: source, reordering, global assets)")
    worker.add_argument("--gpus", help="the GPUs this worker owns, e.g. 0 or 2,3 (sets CUDA_VISIBLE_DEVICES); "
                        "start one GPU worker per GPU")
    worker.add_argument("--concurrency", "-c", type=int, default=1,
                        help="steps at once (default 1: one step at a time in the worker's own process, "
                             "which keeps its models loaded between steps)")
    worker.add_argument("--config", help="the dataset config the runs use (sets SHARDPREP_CONFIG; "
                        "on many machines an s3:// URL)")
    worker.add_argument("--name", help="worker name (default shardprep-<pid>); @host is appended")
    worker.add_argument("--loglevel", default="INFO", help="Celery log level")
    worker.set_defaults(func=cmd_worker)
    args = parser.parse_args(argv)
    return args.func(args)


def program() -> None:
    """The `shardprep` command: ``main``, then the process ends without the interpreter's teardown, once
    everything is recorded and printed: unloading Dagster's modules, torch's and the rest took ~0.8 s of
    a chain's wall after its last run's success (what a stop by signal already skips)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    program()
