"""Which accelerator a GPU step runs on: one device per step, never two steps on one device.

A step leases a device for its duration with an exclusive ``flock`` on a per-device lock file of this
machine; the kernel releases it when the process dies, however it dies, so a killed run gives its
device back. The Dagster ``gpu`` pool bounds how many GPU steps run at once (one slot per device);
the lease picks which device each one gets.

Devices: ``cuda:0 .. cuda:N-1`` for the GPUs torch sees (``CUDA_VISIBLE_DEVICES`` applies), else one
CPU "device". ``SHARDPREP_SIMULATED_DEVICES=N`` simulates N devices backed by the CPU, to exercise
the leasing on a machine without GPUs (tests, demos).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from shardprep.errors import ShardprepError

SIMULATED_ENV = "SHARDPREP_SIMULATED_DEVICES"
LOCK_DIR_ENV = "SHARDPREP_DEVICE_LOCK_DIR"


class DeviceError(ShardprepError, RuntimeError):
    """No device can be leased (none requested exists, or the wait ran out)."""


@dataclass(frozen=True)
class Device:
    name: str  # what runs and metadata show: cuda:1, cpu, sim2
    torch_device: str  # what models are moved to: cuda:1 or cpu
    # when ``lease`` took it (unix seconds; 0 when not leased): a shard's figures carry it, so one can tell
    # which of a run's leases did the shard and check that two leases of one device never overlapped
    leased_at: float = field(default=0.0, compare=False)


def visible_devices() -> list[Device]:
    """The devices GPU steps share out, in order."""
    simulated = os.environ.get(SIMULATED_ENV)
    if simulated:
        return [Device(f"sim{i}", "cpu") for i in range(int(simulated))]
    count = cuda_device_count()
    if count:
        return [Device(f"cuda:{i}", f"cuda:{i}") for i in range(count)]
    return [Device("cpu", "cpu")]


def cuda_device_count() -> int:
    """GPUs torch can use here (0 without CUDA); torch is imported only on a machine with a driver."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")):
        return 0  # no NVIDIA driver: skip importing torch (seconds) just to learn that
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _lock_name(device: Device) -> str:
    """The lock file of ``device`` on this machine. Processes that see different GPUs (each Celery GPU
    worker sets its own ``CUDA_VISIBLE_DEVICES``) all call theirs ``cuda:0``: lock the physical device
    the index maps to, so two workers never lease one GPU twice and never block each other's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if device.name.startswith("cuda:") and visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        index = int(device.name.split(":")[1])
        if index < len(ids):
            return f"gpu-{ids[index]}.lock"
    return f"{device.name.replace(':', '-')}.lock"


def _lock_dir() -> str:
    folder = os.environ.get(LOCK_DIR_ENV) or os.path.join(tempfile.gettempdir(), "shardprep-devices")
    os.makedirs(folder, exist_ok=True)
    return folder


@contextlib.contextmanager
def lease(requested: str = "auto", wait_seconds: float = 24 * 3600, poll_seconds: float = 0.2) -> Iterator[Device]:
    """Hold one device for the block. ``requested``: ``auto`` (the first free device), or a device
    name (``cuda:1``: that one, waiting for it); ``cpu`` leases nothing (any number of CPU steps)."""
    if requested == "cpu":
        yield Device("cpu", "cpu")
        return
    devices = visible_devices()
    if requested not in ("auto", "cuda"):
        devices = [d for d in devices if d.name == requested]
        if not devices:
            raise DeviceError(f"device {requested!r} is not on this machine (visible: "
                              f"{[d.name for d in visible_devices()]})")
    deadline = time.monotonic() + wait_seconds
    folder = _lock_dir()
    while True:
        for device in devices:
            fh = open(os.path.join(folder, _lock_name(device)), "a")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            try:
                yield replace(device, leased_at=time.time())
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()
            return
        if time.monotonic() > deadline:
            raise DeviceError(f"no device of {[d.name for d in devices]} came free in {wait_seconds:.0f} s")
        time.sleep(poll_seconds)
