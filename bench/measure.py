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
import re
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


def run_side(args: list[str], env: dict | None = None, timeout: float = 600, log_path: str | None = None,
             sample_every: float = 0.02) -> Run:
    """``python bench/drivers.py *args``; the driver's last stdout line is a JSON result. ``sample_every``:
    seconds between peak-memory samples (each walks every process of the machine: on 2 cores, 20 ms costs
    ~15% of a core, which a long side that samples its own commands can do without)."""
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
            stop.wait(sample_every)

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


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process, every child it has reaped (and what they reaped), and
    every live descendant (and what it reaped): a driver's timed part is the difference of two calls.
    Orphans nobody waits for are missed (a lower bound)."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for p in me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------ one command's process tree, sampled


def _command(p: psutil.Process) -> str:
    """A process's command line, short and with numbers masked, so that processes of one kind (each run
    worker has its own pipe handle) group together."""
    if p.name() in ("shardprep-runs", "shardprep-code"):  # forks: run workers and their server (run_workers.py),
        return p.name()  # the daemon's code server (queue_daemon.fork_code_server)
    cmd = p.cmdline()
    if not cmd:
        return p.name()
    return re.sub(r"\d+", "N", " ".join([os.path.basename(cmd[0]), *cmd[1:4]]))[:90]


class TreeSampler:
    """Peak RSS and CPU time of a process and every descendant, sampled every 50 ms while it runs.

    CPU is each process's own user + system time at its last sample, summed over every process seen:
    unlike ``RUSAGE_CHILDREN`` it covers descendants nobody waits for (``shardprep run``'s detached
    queue daemon, its code server and the run workers it launches), but it misses what a process uses
    after its last sample (< 50 ms each) and processes it never saw: the tree is walked again every
    ``rescan`` samples only (a walk reads every process of the machine, ~4 ms of CPU here), so a process
    that lives less than ``interval * rescan`` may be missed."""

    def __init__(self, pid: int, interval: float = 0.05, rescan: int = 5):
        self.root = psutil.Process(pid)
        self.interval, self.rescan = interval, rescan
        self.peak = 0
        self.seen: dict[tuple[int, float], dict] = {}  # (pid, create time) -> {"cpu": s, "cmd": str}
        self._procs: list[psutil.Process] = [self.root]
        self._samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        if self._samples % self.rescan == 0:
            try:
                self._procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                pass
        self._samples += 1
        rss = 0
        for p in self._procs:
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    rss += p.memory_info().rss
                    t = p.cpu_times()
                if key not in self.seen:
                    self.seen[key] = {"cpu": 0.0, "cmd": _command(p)}
                self.seen[key]["cpu"] = t.user + t.system
            except psutil.Error:
                pass
        self.peak = max(self.peak, rss)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    @property
    def cpu_seconds(self) -> float:
        return sum(v["cpu"] for v in self.seen.values())

    def cpu_by_command(self) -> dict[str, list]:
        """``{command line (first words): [processes, CPU seconds]}``, most CPU first."""
        out: dict[str, list] = {}
        for v in self.seen.values():
            n, cpu = out.get(v["cmd"], [0, 0.0])
            out[v["cmd"]] = [n + 1, cpu + v["cpu"]]
        return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_monitored(cmd: list[str], log_path: str, env: dict | None = None, cwd: str | None = None,
                  timeout: float = 1800) -> tuple[dict, TreeSampler]:
    """Run ``cmd`` (output to ``log_path``); its wall seconds, peak tree RSS and CPU seconds. CPU is the
    larger of two lower bounds: the sampled tree (covers detached descendants) and ``RUSAGE_CHILDREN``
    (exact for every descendant that was waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "w") as log:
        start, t0 = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with TreeSampler(proc.pid) as tree:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    waited = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RunFailed(f"{os.path.basename(cmd[0])} {' '.join(cmd[1:3])} exited with {proc.returncode}: {tail}")
    return {"seconds": seconds, "started": start, "ended": start + seconds, "peak_rss": tree.peak,
            "cpu_seconds": max(waited, tree.cpu_seconds), "cpu_waited": waited, "cpu_sampled": tree.cpu_seconds,
            "processes": len(tree.seen), "cpu_by_command": tree.cpu_by_command()}, tree
