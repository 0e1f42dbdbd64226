"""Device leases: one step per device, distinct devices at once, a dead process's device given back."""

import os
import signal
import subprocess
import sys
import time

import pytest

from shardprep.models import devices


@pytest.fixture
def three_devices(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.SIMULATED_ENV, "3")
    monkeypatch.setenv(devices.LOCK_DIR_ENV, str(tmp_path / "locks"))
    return tmp_path / "locks"


def test_without_gpus_there_is_one_cpu_device(monkeypatch):
    monkeypatch.delenv(devices.SIMULATED_ENV, raising=False)
    assert devices.visible_devices() == [devices.Device("cpu", "cpu")]
    with devices.lease("cpu") as d, devices.lease("cpu") as e:  # cpu is never leased: any number of steps
        assert d.torch_device == e.torch_device == "cpu"


def test_leases_are_distinct_and_wait_when_all_are_taken(three_devices):
    with devices.lease() as a, devices.lease() as b, devices.lease() as c:
        assert {a.name, b.name, c.name} == {"sim0", "sim1", "sim2"}
        with pytest.raises(devices.DeviceError, match="came free"):
            with devices.lease(wait_seconds=0.3):
                pass
    before = time.time()
    with devices.lease("sim2") as d:
        assert d == devices.Device("sim2", "cpu")
        assert before <= d.leased_at <= time.time()  # when it was taken, which shard figures carry
    with pytest.raises(devices.DeviceError, match="not on this machine"):
        with devices.lease("cuda:7"):
            pass


def test_a_killed_holders_device_is_leased_again(three_devices):
    code = ("import time\nfrom shardprep.models import devices\n"
            "with devices.lease('sim1'):\n    print('held', flush=True)\n    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert child.stdout.readline().strip() == "held"
    with pytest.raises(devices.DeviceError):
        with devices.lease("sim1", wait_seconds=0.3):
            pass
    child.send_signal(signal.SIGKILL)
    child.wait()
    start = time.monotonic()
    with devices.lease("sim1", wait_seconds=5) as d:  # the kernel dropped the dead process's lock
        assert d.name == "sim1" and time.monotonic() - start < 5


def test_workers_with_their_own_visible_gpus_lock_the_physical_device(monkeypatch):
    # two Celery GPU workers (`shardprep worker --gpus 2` and `--gpus 5`) each see only "cuda:0"
    cuda0 = devices.Device("cuda:0", "cuda:0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    first = devices._lock_name(cuda0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    second = devices._lock_name(cuda0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    assert devices._lock_name(devices.Device("cuda:1", "cuda:1")) == first == "gpu-2.lock"
    assert second == "gpu-5.lock" != first
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert devices._lock_name(cuda0) == "cuda-0.lock"
