"""Every environment setting of the Dagster side, in one place, with its default.

The dataset itself is configured by its YAML file (``shardprep.config``); these settings say how this
code location runs it. They are read once, when the definitions are built (``settings()``), never at
import of an asset or sensor module. README "Environment settings" lists the same table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

from shardprep.errors import ShardprepError

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "demo" / "work" / "shardprep.yaml")


class SettingsError(ShardprepError, ValueError):
    """An environment setting has a value it cannot take."""


@dataclass(frozen=True)
class Settings:
    # SHARDPREP_CONFIG: the dataset config the code location serves (UI, daemon, sensors)
    config: str = DEFAULT_CONFIG
    # SHARDPREP_AUTOMATION: on | off -- the declarative automation sensor starts running or stopped
    automation: bool = True
    # SHARDPREP_AUTOMATION_INTERVAL: seconds between automation ticks
    automation_interval: int = 15
    # SHARDPREP_SENSOR_INTERVAL: seconds between ticks of the new_source_files sensor
    sensor_interval: int = 30
    # SHARDPREP_GPU_SHARDS_PER_RUN: shards per backfill run of a GPU asset (a model loads once per run).
    # 16: a 20 x 1,000-row chain is two runs of 10 on the download pool's 2 slots (89.4 s, 3.6 GiB peak);
    # with 8, Dagster's runs of 8, 8 and 4 left the last 8 downloading alone (~94 s, 4.9 GiB), and four
    # runs of 5 paid two more process starts and model loads (104.7 s, 6.3 GiB; bench/E2E.md)
    gpu_shards_per_run: int = 16
    # SHARDPREP_DOWNLOAD_SHARDS_PER_RUN: shards per backfill run of source_parquet / image_shards. Equal to
    # the GPU one, every per-shard asset has the same backfill policy and Dagster puts a chunk of shards
    # through all of them in one run: one process start and one model load per chunk (bench/QUEUE.md)
    download_shards_per_run: int = 16
    # SHARDPREP_GPU_SLOTS: slots of the `gpu` pool set on an instance that has none yet
    # (default: one per visible GPU, 1 without GPUs; each GPU step leases its own device)
    gpu_slots: int | None = None
    # SHARDPREP_DOWNLOAD_SLOTS: slots of the `download` pool set on an instance that has none yet
    # (default: half the cores, at least 2: each download step already decodes on every core)
    download_slots: int | None = None
    # SHARDPREP_EXECUTOR: in_process | celery -- where a run's steps execute: in the run's own process
    # (one machine), or as tasks on dagster-celery workers (`shardprep worker`; many machines)
    executor: str = "in_process"
    # SHARDPREP_CELERY_BROKER: the Celery broker the runs and the workers share (RabbitMQ)
    celery_broker: str = "pyamqp://guest:guest@127.0.0.1:5672//"
    # SHARDPREP_CELERY_BACKEND: the Celery result backend (Redis)
    celery_backend: str = "redis://127.0.0.1:6379/0"


CHOICES = {"executor": ("in_process", "celery")}


def env_name(field: str) -> str:
    return f"SHARDPREP_{field.upper()}"


def _parse(field: str, raw: str, kind: str):
    name = env_name(field)
    if kind == "bool":
        value = raw.strip().lower()
        if value in ("on", "1", "true", "yes"):
            return True
        if value in ("off", "0", "false", "no"):
            return False
        raise SettingsError(f"environment setting {name}={raw!r}: must be on or off")
    if kind.startswith("int"):
        try:
            number = int(raw)
        except ValueError:
            number = 0
        if number < 1:
            raise SettingsError(f"environment setting {name}={raw!r}: must be a positive integer")
        return number
    if not raw.strip():
        raise SettingsError(f"environment setting {name} is set but empty")
    if field in CHOICES and raw.strip() not in CHOICES[field]:
        raise SettingsError(f"environment setting {name}={raw!r}: must be one of {', '.join(CHOICES[field])}")
    return raw.strip()


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings from ``environ`` (default: the process environment); unset ones keep their default."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields(Settings):
        raw = environ.get(env_name(f.name))
        if raw is not None:
            values[f.name] = _parse(f.name, raw, str(f.type))
    return Settings(**values)


def default_download_slots() -> int:
    return max(2, (os.cpu_count() or 2) // 2)


def default_gpu_slots() -> int:
    from shardprep.models.devices import visible_devices

    return len(visible_devices())
