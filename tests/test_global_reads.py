"""Whether the unpartitioned assets must run, and whether a run brought them up to date, read from one query
of their asset records (``plan.latest_materializations``) instead of two per asset: what the instance holds,
as the materializations' own events say."""

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG

from shardprep_dagster.orchestration.plan import (
    current_globals,
    globals_needed,
    latest_materializations,
    latest_version,
    newest_materialization,
    outdated_globals,
)

SHARD, REPORT, INDEX = dg.AssetKey("image_shards"), dg.AssetKey("dataset_report"), dg.AssetKey("image_energon_index")
VERSIONS = {"image_shards": "s1", "dataset_report": "r1", "image_energon_index": "i1"}


def _materialize(instance: dg.DagsterInstance, key: dg.AssetKey, version: str, partition: str | None = None) -> int:
    """Report a materialization of ``key`` at ``version``; its storage id."""
    instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=partition,
                                                                tags={DATA_VERSION_TAG: version}))
    return instance.fetch_materializations(key, limit=1).records[0].storage_id


def test_the_globals_latest_materializations_are_their_newest_events():
    with dg.instance_for_test() as instance:
        assert latest_materializations(instance, [REPORT, INDEX]) == {REPORT: None, INDEX: None}
        assert latest_version(instance, REPORT) is None
        _materialize(instance, REPORT, "r0")
        newest = _materialize(instance, REPORT, "r1")
        latest = latest_materializations(instance, [REPORT, INDEX])
        assert latest[REPORT].storage_id == newest and latest[INDEX] is None
        assert latest_version(instance, REPORT) == "r1"
        instance.wipe_assets([REPORT])
        assert latest_materializations(instance, [REPORT])[REPORT] is None


def test_the_globals_are_needed_when_outdated_or_older_than_a_shard():
    globals_ = [REPORT, INDEX]
    with dg.instance_for_test() as instance:
        assert globals_needed(instance, [SHARD], globals_, VERSIONS)  # never made
        assert outdated_globals(instance, globals_, VERSIONS) == globals_
        shard = _materialize(instance, SHARD, "s1", partition="00000")
        report = _materialize(instance, REPORT, "r1")
        assert globals_needed(instance, [SHARD], globals_, VERSIONS)  # the index: never made
        index = _materialize(instance, INDEX, "i0")
        assert outdated_globals(instance, globals_, VERSIONS) == [INDEX]  # made at another version
        assert globals_needed(instance, [SHARD], globals_, VERSIONS)
        index = _materialize(instance, INDEX, "i1")
        assert not outdated_globals(instance, globals_, VERSIONS)
        assert not globals_needed(instance, [SHARD], globals_, VERSIONS)  # both after the shard
        assert not globals_needed(instance, [SHARD], globals_, VERSIONS, newest_shard=shard)
        later = _materialize(instance, SHARD, "s1", partition="00001")
        assert newest_materialization(instance, [SHARD]) == later
        assert globals_needed(instance, [SHARD], globals_, VERSIONS)  # a shard after the report
        assert globals_needed(instance, [SHARD], globals_, VERSIONS, newest_shard=later)
        # what the run summary calls current: at its version, after the shards had settled
        assert current_globals(instance, globals_, VERSIONS, after=shard) == {REPORT, INDEX}
        assert current_globals(instance, globals_, VERSIONS, after=report) == {INDEX}
        assert current_globals(instance, globals_, {**VERSIONS, "dataset_report": "r2"}, after=shard) == {INDEX}
        assert current_globals(instance, globals_, VERSIONS, after=index) == set()


def test_an_unversioned_global_never_made_is_needed_and_not_current():
    # (a code location without versions: versions.get(name) is None, as is a never-made asset's version)
    with dg.instance_for_test() as instance:
        _materialize(instance, SHARD, "s1", partition="00000")
        assert globals_needed(instance, [SHARD], [REPORT], {})
        assert current_globals(instance, [REPORT], {}, after=0) == set()
