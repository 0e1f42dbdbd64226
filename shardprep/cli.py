"""`shardprep` command line. Dagster is driven through the code location in the checkout
(``orchestration/``), imported only by the commands that need it, so this package stays Dagster-free."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _code_location(explicit: str | None) -> Path:
    candidates = [Path(explicit)] if explicit else []
    if os.environ.get("SHARDPREP_CODE_LOCATION"):
        candidates.append(Path(os.environ["SHARDPREP_CODE_LOCATION"]))
    candidates += [Path(__file__).resolve().parent.parent, Path.cwd()]
    for c in candidates:
        if (c / "definitions.py").exists() and (c / "orchestration").is_dir():
            return c.resolve()
    raise SystemExit("shardprep: the Dagster code location (definitions.py, orchestration/) was not found; "
                     "run from the shardprep checkout or pass --code-location DIR")


def _import_orchestration(explicit: str | None):
    root = _code_location(explicit)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def print_summary(summary) -> None:
    total = len(summary.shards)
    width = max([len(a) for a in summary.materialized] + [5])
    print(f"\n{'asset'.ljust(width)}  materialized")
    for asset, n in summary.materialized.items():
        done = ("yes" if n else "no") if asset in summary.global_assets else f"{n} of {total} shards"
        print(f"{asset.ljust(width)}  {done}")
    print(f"\nshards: {total} ({len(summary.new_shards)} new), runs this time: {summary.runs}, "
          f"failed: {len(summary.failed)}")
    for url in summary.changed_sources:
        print(f"warning: source file changed after its shards were assigned (not re-sharded): {url}")
    for url in summary.empty_sources:
        print(f"note: source file has no rows, no shards made: {url}")
    for shard, err in summary.failed.items():
        print(f"FAILED shard {shard}: {err}")


def cmd_run(args: argparse.Namespace) -> int:
    _import_orchestration(args.code_location)
    from orchestration.runner import run_pipeline
    from shardprep.config import ConfigError
    from shardprep.ledger import LedgerError
    from shardprep.sources import SourceError

    try:
        summary = run_pipeline(args.config, rebuild=args.rebuild, progress=not args.no_progress)
    except (ConfigError, SourceError, LedgerError) as e:
        print(f"shardprep: {e}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0 if summary.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    _import_orchestration(args.code_location)
    from orchestration.status import status

    print(status(args.config))
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    _import_orchestration(args.code_location)
    from orchestration.backfill import BackfillError, launch_backfill

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardprep", description=__doc__)
    parser.add_argument("--code-location", help="folder holding definitions.py (default: the checkout)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="register new source files and materialize every missing shard asset")
    run.add_argument("--config", required=True, help="dataset config YAML")
    run.add_argument("--rebuild", action="store_true", help="redo every shard, even complete ones")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)
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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
