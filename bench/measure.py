"""Run one side of a pair as a subprocess: wall time and peak memory of its whole process tree.

Peak memory is the largest sum of RSS over the process and all its descendants, sampled every
20 ms (a spawned worker pool counts in full). CPU time is user + system time of the process and
every descendant it waited for (``RUSAGE_CHILDREN``): on a machine shared with other work, wall
time moves with the neighbours' load, CPU time much less. Each run is a fresh interpreter, so imports, model
loads and worker start-up are part of the time, as they are for a user running the command.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Run:
    seconds: float
    peak_rss: int  # bytes
    cpu_seconds: float  # user + system time of the side and every descendant it waited for
    result: dict = field(default_factory=dict)  # what the driver printed as its last JSON line


class RunFailed(RuntimeError):
    pass


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_side(args: list[str], env: dict | None = None, timeout: float = 600, log_path: str | None = None) -> Run:
    """``python bench/drivers.py *args``; the driver's last stdout line is a JSON result."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", "NO_ALBUMENTATIONS_UPDATE": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "drivers.py"), *args], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(ps))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise RunFailed(f"{args[0]} timed out after {timeout}s: {err[-3000:]}") from None
    finally:
        seconds = time.perf_counter() - start
        stop.set()
        sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"### {' '.join(args)}\n{out[-20000:]}\n--- stderr\n{err[-20000:]}\n")
    if proc.returncode != 0:
        raise RunFailed(f"{args[0]} exited with {proc.returncode}: {err[-3000:]}")
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    return Run(seconds, peak, cpu, result)


def median(xs):
    return statistics.median(xs) if xs else float("nan")
