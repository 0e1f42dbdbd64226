"""The artifact records (shardprep.artifacts) are what the code location builds: the Dagster asset graph's
dependencies, partitions, pools, groups and partition mappings equal the records, and every record names
real files, a real check and real config flags."""

import warnings

import dagster as dg
import pytest

from shardprep import verify
from shardprep.artifacts import ARTIFACTS, GLOBALS, PER_SHARD
from shardprep.config import DatasetConfig, config_from_dict
from shardprep.layout import Layout


@pytest.fixture(scope="module")
def graph():
    from shardprep_dagster.definitions import build_defs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_defs("/no/config/yet.yaml").resolve_asset_graph()  # every asset, unversioned


def test_the_asset_graph_is_the_records(graph):
    assert {k.to_user_string() for k in graph.materializable_asset_keys} == set(ARTIFACTS)
    for name, record in ARTIFACTS.items():
        node = graph.get(dg.AssetKey(name))
        assert {p.to_user_string() for p in node.parent_keys} == set(record.parents), name
        assert (node.partitions_def is not None) == record.partitioned, name
        assert node.pools == ({record.pool} if record.pool else set()), name
        assert node.group_name == record.group, name
        for parent in record.parents:
            mapping = graph.get_partition_mapping(dg.AssetKey(name), dg.AssetKey(parent))
            if ARTIFACTS[parent].partitioned and not record.partitioned:  # a global asset reads every shard
                assert isinstance(mapping, dg.AllPartitionMapping), (name, parent)
            elif record.partitioned:  # a shard's asset reads the same shard of its parent
                assert isinstance(mapping, dg.IdentityPartitionMapping), (name, parent)


def test_records_come_in_dependency_order_and_name_real_things():
    names = list(ARTIFACTS)
    assert list(PER_SHARD) + list(GLOBALS) != [] and set(PER_SHARD) | set(GLOBALS) == set(names)
    fields = set(config_from_dict({"source": "/s/*.parquet", "output_root": "/o"}).to_dict())
    layout = Layout("/o")
    for i, (name, record) in enumerate(ARTIFACTS.items()):
        for parent in (*record.parents, *record.version_parents, *record.reads_only_when):
            assert parent in names[:i], f"{name} comes before its parent {parent}"
        switch = record.enabled_by  # a config field, or a property of the config derived from them
        assert set(record.fields) <= fields and (switch is None or switch in fields or isinstance(
            getattr(DatasetConfig, switch, None), property)), name
        assert {f for fs in record.reads_only_when.values() for f in fs} <= fields, name
        assert callable(getattr(verify, record.verify, None)), f"{name}: no check {record.verify!r}"
        assert bool(record.outputs) == record.partitioned, name
        if record.partitioned:  # each a Layout method naming a file of the shard under the root
            assert all(url.startswith("/o/") and "00000" in url for url in layout.shard_outputs(name, "00000")), name
        assert record.media in (None, "image", "video") and (record.media is None or record.partitioned), name
        assert record.pool in (None, "download", "gpu") and record.batch in (None, "download", "gpu"), name
