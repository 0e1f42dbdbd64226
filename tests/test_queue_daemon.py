"""The private queue daemon's pacing: what makes it look at the instance at once."""

import time

import dagster as dg
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill

from shardprep_dagster.orchestration.queue_daemon import _state


def _backfill(backfill_id: str) -> PartitionBackfill:
    return PartitionBackfill(backfill_id=backfill_id, status=BulkActionStatus.REQUESTED, from_failure=False,
                             tags={}, backfill_timestamp=time.time(), asset_selection=[dg.AssetKey("x")])


def _states_around(change) -> tuple:
    """The daemon's state before and after ``change(instance, backfill)`` of an instance with one active
    backfill."""
    with dg.instance_for_test() as instance:
        backfill = _backfill("first")
        instance.add_backfill(backfill)
        before = _state(instance)
        change(instance, backfill)
        return before, _state(instance)


def test_a_backfill_added_as_another_completes_changes_the_daemon_state():
    # `shardprep run` adds its unpartitioned assets' backfill right after its shards' one completes: the
    # active count is 1 before and after, and the daemon used to wait its busy poll (15 s) to notice
    def complete_and_add(instance, first):
        instance.update_backfill(first.with_status(BulkActionStatus.COMPLETED_SUCCESS))
        instance.add_backfill(_backfill("second"))

    before, after = _states_around(complete_and_add)
    assert before.backfills_active == after.backfills_active == 1
    assert after != before


def test_a_cancellation_changes_the_daemon_state():
    # REQUESTED -> CANCELING leaves the active count as it was: the daemon then looked at the cancellation
    # only when a run ended, and a SIGTERM'd `shardprep run`'s runs downloaded on to SUCCESS
    before, after = _states_around(
        lambda instance, backfill: instance.update_backfill(backfill.with_status(BulkActionStatus.CANCELING)))
    assert before.backfills_active == after.backfills_active == 1
    assert (before.backfills_canceling, after.backfills_canceling) == (0, 1)
    assert after != before


def test_opening_the_instance_imports_its_storage_before_the_lock(tmp_path):
    # `shardprep run`'s CLI, daemon and code server open the instance together: what it imports (~490
    # modules, 0.5 s) is imported before the lock (instance.STORAGE_MODULES), so none waits on another's
    # imports; only a few small modules may be left for inside it
    import ast
    import os
    import subprocess
    import sys

    from tests.fixtures.configs import CHECKOUT

    script = """
import importlib, sys
import dagster
from shardprep_dagster.orchestration import instance
for m in instance.STORAGE_MODULES:
    importlib.import_module(m)
before = set(sys.modules)
with instance.home_lock(instance.dagster_home(), "instance"):
    dagster.DagsterInstance.get()
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
                         cwd=CHECKOUT, capture_output=True, text=True, check=True).stdout
    late = ast.literal_eval(out.strip().splitlines()[-1])
    assert not [m for m in late if m.split(".")[0] in ("sqlalchemy", "alembic", "mako")], late
    assert not [m for m in late if m.startswith("dagster._core.storage.")], late
    assert len(late) < 60, late

def test_a_run_enqueued_after_it_was_created_changes_the_daemon_state():
    # the backfill daemon creates a run (NOT_STARTED) and enqueues it ~1 s later, after its planned events:
    # a look in between saw the run in flight already, and the run-queue daemon, poked then, found nothing
    # queued and waited its busy poll (15 s) for the enqueue
    from dagster._core.events import DagsterEvent
    from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.test_utils import create_run_for_test

    origin = RemoteJobOrigin(RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("shardprep"), "r"), "x")
    with dg.instance_for_test() as instance:
        run = create_run_for_test(instance, job_name="x", status=dg.DagsterRunStatus.NOT_STARTED,
                                  remote_job_origin=origin)
        created = _state(instance)
        instance.report_dagster_event(DagsterEvent.job_enqueue(run), run_id=run.run_id)
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.QUEUED
        enqueued = _state(instance)
        assert created.in_flight == enqueued.in_flight == 1
        assert (created.queued, enqueued.queued) == (0, 1)
        assert enqueued != created


def _code_server_of(log) -> tuple[int, str]:
    """The pid and socket of the code server the daemon forked, as its log says."""
    import re

    found = re.findall(r"code server (\d+) \(shardprep-code\) on (\S+)", open(log).read())
    assert found, open(log).read()
    return int(found[-1][0]), found[-1][1]


def test_a_private_daemon_started_early_leaves_an_instance_a_dagster_daemon_serves(tmp_path):
    """`shardprep run` starts its daemon before it can tell whether a dagster-daemon (`make ui`'s) serves
    the instance: the daemon looks itself and leaves, or two would turn one backfill into runs twice."""
    import os
    import subprocess
    import sys

    from dagster._daemon.types import DaemonHeartbeat

    from shardprep.storage import pid_alive
    from shardprep_dagster.orchestration import daemon_process
    from tests.fixtures.live_dagster import prepare_home

    home = prepare_home(tmp_path / "home")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "BACKFILL", "a-dagster-daemon", None))
    daemon_process.start_early(str(home))
    spawned = daemon_process._spawned[str(home)]
    assert spawned.wait(timeout=120) == 0  # gone by itself, long before its 20 s idle exit would end it
    assert open(daemon_process.lock_path(str(home))).read() == ""  # it never served: no id of its own
    # its code server, a fork of it, is stopped with it and its socket removed, well before the code server
    # would stop by itself without heartbeats (20 s)
    pid, socket_path = _code_server_of(home / "shardprep_daemon.log")
    deadline = time.time() + 15
    while pid_alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid) and not os.path.exists(socket_path)

    # without the dagster-daemon's heartbeat, a private daemon serves (and writes its id) until idle
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.wipe_daemon_heartbeats()
    ours = subprocess.Popen([sys.executable, "-m", "shardprep_dagster.orchestration.queue_daemon", "--idle-seconds",
                             "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    assert ours.wait(timeout=120) == 0
    assert open(daemon_process.lock_path(str(home))).read().strip() != ""


def test_a_daemon_started_before_the_config_check_waits_for_the_go(tmp_path):
    """`shardprep run` starts its daemon first thing, so the daemon's imports overlap the CLI's config check:
    the daemon touches nothing before the CLI says go. Without it, it leaves and the instance's folder is
    never made; given it, it logs to that folder and serves."""
    import os
    import signal

    from shardprep_dagster.orchestration import daemon_process
    from tests.fixtures.live_dagster import prepare_home

    home = tmp_path / "refused"
    daemon = daemon_process.start_early(str(home), wait_for_go=True)
    daemon_process.release(daemon, go=False)
    assert daemon.wait(timeout=120) == 0
    assert not home.exists()

    home = prepare_home(tmp_path / "home")
    daemon = daemon_process.start_early(str(home), wait_for_go=True)
    assert daemon is not None and daemon_process.running_here(str(home))
    daemon_process.release(daemon, go=True)
    code_server = None
    try:
        deadline = time.time() + 120
        while not open(daemon_process.lock_path(str(home))).read().strip() and time.time() < deadline:
            time.sleep(0.1)
        assert daemon_process.last_daemon_id(str(home)) is None  # it holds the lock: it serves
        code_server = _code_server_of(home / "shardprep_daemon.log")[0]  # as its log in the instance says
    finally:
        for pid in (daemon.pid, code_server):  # the code server would outlive a killed daemon by 20 s
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
        daemon.wait(timeout=60)


def test_migration_scripts_are_loaded_once_a_process(tmp_path):
    # Dagster asks Alembic for a fresh script directory at every revision check and stamp, which loaded
    # all ~90 migration scripts each time: three times an instance open and once per run's SQLite event log
    # (instance.cache_migration_scripts). After the first open, neither loads a migration script again
    import os
    import subprocess
    import sys

    from tests.fixtures.configs import CHECKOUT

    script = """
import uuid
import alembic.util
import dagster
from shardprep_dagster.orchestration.instance import get_instance
get_instance()
loaded = []
load = alembic.util.load_python_file
alembic.util.load_python_file = lambda d, f: loaded.append(f) or load(d, f)
instance = dagster.DagsterInstance.get()
with instance.event_log_storage.run_connection(str(uuid.uuid4())):  # a new run's own event log
    pass
print(sorted(set(loaded)))
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
                         cwd=CHECKOUT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] in ("[]", "['env.py']"), out



_OPEN = """
import dagster
from shardprep_dagster.orchestration.instance import get_instance, import_storage
import_storage()
print("READY", flush=True)  # (what is left is the open itself: well under a second)
get_instance().dispose()
print("OPENED", flush=True)
"""


def test_a_made_instance_is_opened_without_the_lock_and_a_fresh_one_under_it(tmp_path):
    """The instance's lock guards its making only (two processes making a fresh SQLite schema race in its
    migration). Once made, `shardprep run`'s CLI, daemon and code server open it side by side: under the lock
    they took turns, on the path to the first run. A changed dagster.yaml (another storage) is made under
    the lock again."""
    import os
    import select
    import shutil
    import subprocess
    import sys

    from shardprep_dagster.orchestration import instance
    from tests.fixtures.configs import CHECKOUT

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(CHECKOUT / "dagster.yaml", home / "dagster.yaml")

    def line(fd: int, seconds: float) -> str | None:  # unbuffered: what select sees is what is unread
        out = b""
        while not out.endswith(b"\n"):
            if not select.select([fd], [], [], seconds)[0]:
                return None
            out += os.read(fd, 1)
        return out.decode().strip()

    def opens_while_locked() -> bool:
        with instance.home_lock(home, "instance"):
            proc = subprocess.Popen([sys.executable, "-c", _OPEN], env={**os.environ, "DAGSTER_HOME": str(home)},
                                    cwd=CHECKOUT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
            fd = proc.stdout.fileno()
            assert line(fd, 120) == "READY"
            opened = line(fd, 3) == "OPENED"  # within 3 s (the open alone takes ~0.2 s): it did not wait for the lock
        assert opened or line(fd, 120) == "OPENED"  # once the lock is free, at the latest
        assert proc.wait(timeout=60) == 0
        return opened

    assert not (home / instance.MADE_MARK).exists()
    assert not opens_while_locked()  # fresh: made under the lock
    assert (home / instance.MADE_MARK).exists()
    assert opens_while_locked()  # made: opened beside the lock's holder
    with open(home / "dagster.yaml", "a") as f:
        f.write("\n# another storage\n")
    assert not opens_while_locked()  # changed settings: made under the lock again
    assert opens_while_locked()
