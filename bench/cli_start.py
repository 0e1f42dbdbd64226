"""How long the `shardprep` command takes to answer what needs no engine: `status` on the demo's dataset,
`--help`, `verify --help` (issue 20: at most 1.5 s for status on the demo on a 2-core machine).

    python bench/cli_start.py [--reps 5] [--out bench/CLI.md]

Runs the demo first when its dataset is not there. Each command is a fresh process (what a user waits
for: interpreter start, imports, reading the state index); the median of the repetitions is reported,
and which heavy modules each one imported (none of Dagster, torch, transformers, faiss, PyAV, OpenCV,
pandas).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = CHECKOUT / "demo" / "work" / "shardprep.yaml"
HEAVY = ("dagster", "torch", "transformers", "faiss", "av", "cv2", "pandas")
COMMANDS = {"status on the demo": ["status", "--config", str(DEMO_CONFIG)], "--help": ["--help"],
            "verify --help": ["verify", "--help"]}
FLOOR_SECONDS = 1.5  # status on the demo


def _time(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", *argv], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"shardprep {' '.join(argv)} failed: {out.stderr[-2000:]}")
    return time.perf_counter() - start


def _imports(argv: list[str], env: dict) -> list[str]:
    code = ("import sys\nfrom shardprep_dagster.orchestration.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print of a list of names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(CHECKOUT / "bench" / "CLI.md"))
    args = parser.parse_args(argv)
    env = {**os.environ, "DAGSTER_HOME": os.environ.get("DAGSTER_HOME", str(CHECKOUT / ".dagster_home"))}
    if not DEMO_CONFIG.exists():
        subprocess.run([sys.executable, "-m", "demo.run_demo"], cwd=CHECKOUT, env=env, check=True)
    rows = []
    for name, cmd in COMMANDS.items():
        _time(cmd, env)  # a first run warms the file cache, as any second call of a user's would
        times = [_time(cmd, env) for _ in range(args.reps)]
        rows.append((name, statistics.median(times), min(times), _imports(cmd, env)))
    load = os.getloadavg()
    lines = ["# `shardprep` command start-up (`bench/cli_start.py`, part of `make bench`)", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load average "
             f"{load[0]:.1f}; {args.reps} fresh processes each, after one warm-up run", "",
             "| command | median s | best s | heavy modules imported |", "|---|---|---|---|"]
    lines += [f"| `shardprep {name}` | {med:.2f} | {best:.2f} | {', '.join(mods) or 'none'} |"
              for name, med, best, mods in rows]
    status = rows[0][1]
    lines += ["", f"status on the demo: {status:.2f} s, floor {FLOOR_SECONDS} s: "
              f"{'PASS' if status <= FLOOR_SECONDS else 'MISSED (a loaded machine?)'}"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(not r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
