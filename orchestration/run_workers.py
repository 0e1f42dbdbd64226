"""Run workers forked from a warm process instead of started cold.

Dagster 1.13's code server starts each run's process with multiprocessing's spawn context
(``DagsterApiServer._mp_ctx``, dagster/_grpc/server.py): a fresh interpreter that imports Dagster and the
code location again before the run's first step. On 2 cores beside the other runs that took 1.9-2.6 s of
wall a run and ~1.5 CPU-seconds (the chain benchmark, bench/E2E.md), and the first run's start lies on the
critical path of every `shardprep run`.

A code server of this code location instead forks a server from itself as soon as it has loaded the code
location (``_fork_server_here``; the queue daemon's code server, itself a fork of the daemon made after that
import, does it as it starts: ``code_server.main``): it is still single-threaded then (its gRPC server and threads come after),
and has Dagster, the code location and the instance's storage loaded. The server speaks multiprocessing's
forkserver protocol and forks one process per run: launch -> run start 2.3-2.5 s -> 0.4-0.9 s on the
benchmark machine. Where the code server is not single-threaded at that point, or on a Python whose
forkserver protocol differs, a fresh forkserver interpreter imports it all once instead (~2.5 CPU-s; its
first runs wait for that). Not a plain fork of the code server per run: by then it runs gRPC's threads, and
a fork of a threaded process may inherit a held lock. What stays as with spawn: each run has a process of
its own, with its own pid and a clean run state (no instance, no model, no thread is made before the fork);
the code server's termination (``Process.terminate``) and its watch for a dead worker (the exit code, -9 for
a SIGKILL, through the forkserver's status pipe) work as before. What differs: a run's process has the code
location as the code server loaded it, as the code server's own snapshot of it is; a changed config is seen
by the next code server (`shardprep run` starts one per daemon; the UI's "reload").

``SHARDPREP_RUN_WORKERS=spawn`` keeps Dagster's spawn.
"""

import multiprocessing
import os
import socket
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from multiprocessing import connection, forkserver, resource_tracker, util

ENV = "SHARDPREP_RUN_WORKERS"
RUN_ENTRY = "dagster._grpc.impl"  # start_run_in_subprocess, what a run's process runs first
PRELOAD = "shardprep_dagster.orchestration.forkserver_preload"  # what a run's process loads next: the instance
PROCESS_NAME = "shardprep-runs"  # the forked server's and its runs' processes' (15 characters at most)
# the Pythons whose forkserver protocol _fork_server_here speaks (3.14 adds an authentication key)
FORK_HERE_PYTHONS = ((3, 10), (3, 13))

_ctx = None


def in_code_server() -> bool:
    """This process is a Dagster code server (`dagster api grpc ...`, as the daemon, `dagster dev` and the
    webserver start one per code location)."""
    return sys.argv[1:3] == ["api", "grpc"]


def fork_from_warm_process(code_location: str) -> bool:
    """In a code server, make its runs' processes forks of a forkserver that has Dagster and
    ``code_location`` (a module name) loaded; started now, so the first run finds it ready. True when
    applied (here or earlier in this process)."""
    global _ctx
    if _ctx is not None:
        return True
    if os.environ.get(ENV, "forkserver") != "forkserver" or not in_code_server() or not _preloadable(code_location):
        return False
    from dagster._grpc.server import DagsterApiServer

    _ctx = multiprocessing.get_context("forkserver")
    # a data descriptor on the class wins over the instance's own attribute, which the server set in its
    # __init__ (already run: the server loads the code location from its __init__)
    DagsterApiServer._mp_ctx = property(lambda _self: _ctx, lambda _self, _value: None)
    if single_threaded() and FORK_HERE_PYTHONS[0] <= sys.version_info[:2] <= FORK_HERE_PYTHONS[1]:
        _fork_server_here([RUN_ENTRY, PRELOAD], code_location)
    else:  # a fresh interpreter that imports it all again (~2.5 CPU-s), in the background
        _ctx.set_forkserver_preload([RUN_ENTRY, PRELOAD, code_location])
        threading.Thread(target=forkserver.ensure_running, name="run-worker-forkserver", daemon=True).start()
    return True


def _fork_server_here(preload: list[str], code_location: str) -> None:
    """``ForkServer.ensure_running``, with the server a fork of this process instead of a fresh interpreter:
    the code server is still single-threaded while it imports the code location (its gRPC server and
    threads come after), and has then loaded what a run needs, the instance's storage included, so the
    server costs next to no imports. The server's end of the protocol is multiprocessing's own
    (``forkserver.main``)."""
    server = forkserver._forkserver
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # EOF once this process is gone: the server then exits (SystemExit)

        def serve() -> None:
            os.close(alive_w)
            # forked from inside the import of the code location, which in this process never returns:
            # mark it done, so an import of it (a run's job, from any thread) takes the loaded module
            sys.modules[code_location].__spec__._initializing = False
            name_process(PROCESS_NAME)
            forkserver.main(listener.fileno(), alive_r, preload)

        pid = fork_child(serve)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def fork_child(child: Callable[[], object]) -> int:
    """Fork; the child runs ``child()`` and exits, never returning into this process's code: with its
    ``SystemExit``'s code, 0 when it returns, 1 on any other exception (its traceback on stderr). Returns the
    child's pid. Call it single-threaded (``single_threaded``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # Python 3.12 warns of the native threads already there
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        child()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 - said on stderr; never back into the parent's code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def name_process(name: str) -> None:
    """The name `ps -o comm`, `top` and psutil show (Linux), inherited by the runs' processes: the server
    and runs would otherwise all show as code servers."""
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(name)
    except OSError:
        pass


def single_threaded() -> bool:
    """No thread of Python's but this one: a fork leaves the others behind, holding whatever lock they held
    (the logging module's, an import's, ours). The native threads that are already there (OpenBLAS's
    for numpy, jemalloc's for pyarrow) handle a fork themselves, as with every fork multiprocessing makes."""
    return threading.active_count() == 1


def _preloadable(module: str) -> bool:
    # a code location loaded from a file (`dagster api grpc -f`) is not importable by name in the forkserver
    spec = sys.modules.get(module).__spec__ if module in sys.modules else None
    return spec is not None and spec.name == module
