"""Energon's on-disk names and documents: ``.info.json``/``.info.yaml``, ``split.yaml``, ``dataset.yaml``."""

from __future__ import annotations

import json

import yaml

from shardprep.errors import ShardprepError

META_DIR = ".nv-meta"
INFO_JSON = ".info.json"
INFO_YAML = ".info.yaml"
SPLIT_YAML = "split.yaml"
DATASET_YAML = "dataset.yaml"
INDEX_SQLITE = "index.sqlite"
INDEX_UUID = "index.uuid"
STATE_JSON = "shardprep_index.json"  # our bookkeeping, not energon's
STATE_VERSION = 1
SPLIT_NAMES = ("train", "val", "test")
ENERGON_FORMAT_VERSION = "7.4.1"  # the energon release whose on-disk format this mirrors

# energon's megatron/energon/flavors/webdataset/config.py
SAMPLE_TYPES = ("captioning", "crude")
DEFAULT_FIELD_MAP = {"image": "jpg", "caption": "txt"}


class EnergonIndexError(ShardprepError, ValueError):
    """An energon index cannot be built as asked (bad arguments, an empty or duplicate-keyed dataset)."""


def dataset_definition(sample_type: str, field_map: dict | None) -> dict:
    """The ``dataset.yaml`` document: a field-mapped ``CaptioningSample`` or a ``CrudeWebdataset``."""
    if sample_type not in SAMPLE_TYPES:
        raise EnergonIndexError(f"sample_type must be one of {SAMPLE_TYPES}, got {sample_type!r}")
    if sample_type == "captioning":
        return {"sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
                "field_map": dict(field_map or DEFAULT_FIELD_MAP)}
    if field_map:
        raise EnergonIndexError("field_map applies to sample_type='captioning' only; crude samples are cooked by a "
                                "task encoder")
    return {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}


def energon_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-energon")
    except Exception:  # noqa: BLE001 - energon is optional for writing its format
        return ENERGON_FORMAT_VERSION


def info_json(shard_counts: dict[str, int]) -> bytes:
    """``.info.json`` (energon 7), ``shard_counts`` in ``tar_file_id`` order."""
    return json.dumps({"energon_version": energon_version(), "shard_counts": shard_counts}, indent=2).encode("utf-8")


def info_yaml(shard_counts: dict[str, int]) -> bytes:
    """``.info.yaml``: ``shard_counts`` only, all energon <= 5.x reads (it parses strictly)."""
    return yaml.dump({"shard_counts": shard_counts}).encode("utf-8")


def split_yaml(split_parts: dict[str, list[str]], exclude: list[str] | None = None) -> bytes:
    """``exclude``: ``"<tar>"`` (a whole tar) or ``"<tar>/<sample key>"`` entries energon leaves out."""
    return yaml.dump({"split_parts": split_parts, "exclude": list(exclude or [])}, sort_keys=False).encode("utf-8")


def dataset_yaml(definition: dict) -> bytes:
    return yaml.dump(definition, sort_keys=False).encode("utf-8")
