"""The code location under a real ``dagster dev`` (webserver + daemon) on 127.0.0.1, driven through
GraphQL and a real browser (Debian's chromium via Playwright).

One live Dagster serves the whole module, over one dataset of 9 shards (5 rows each):
  * 00000-00005: source_parquet and image_shards materialized before the server starts (the
    model-loads backfill test embeds them),
  * 00006, 00007: materialized from the UI (browser test),
  * 00008: registered, never materialized,
  * 00009: a source file dropped while the daemon runs (sensor + automation, no manual step).
Much of the time goes to waiting for daemon ticks (the backfill daemon wakes every 30 s), so the
fixture sets the daemon-driven work going as soon as the server is up (the new source file, the GPU
backfill) and the browser test runs meanwhile; each test then asserts on its own outcome.
Screenshots land in test-artifacts/live_ui/ (git-ignored).
"""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest

from shardprep.artifacts import artifact
from shardprep.config import load_config
from shardprep.ledger import register_sources
from shardprep_dagster.assets import per_shard_assets
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, write_config
from tests.fixtures.live_dagster import LiveDagster, prepare_home, start_live_dagster

SHARDS = [f"{i:05d}" for i in range(9)]
BACKFILL_SHARDS = SHARDS[:6]  # upstream ready before the server starts
UI_SHARDS = ["00006", "00007"]
# the stack's config disables the NeMo outputs and sets no captioner, so the diffusion assets and captions
# are not in its graph
PER_SHARD = [a.key.to_user_string() for a in per_shard_assets if artifact(a.key.path[-1]).enabled_by is None]
GPU_SHARDS_PER_RUN = 3
ARTIFACTS = CHECKOUT / "test-artifacts" / "live_ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# the live code location: small batches for the GPU backfill, sensor and automation ticking fast
LIVE_ENV = {"SHARDPREP_GPU_SHARDS_PER_RUN": str(GPU_SHARDS_PER_RUN), "SHARDPREP_SENSOR_INTERVAL": "1",
            "SHARDPREP_AUTOMATION_INTERVAL": "1"}

REPOSITORIES = """
query { repositoriesOrError { __typename ... on RepositoryConnection { nodes { name location { name }
  assetNodes { assetKey { path } isPartitioned }
  sensors { name minIntervalSeconds sensorState { status } } } } } }"""

PARTITION_STATUS = """
query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { assetKey { path }
  assetPartitionStatuses { __typename ... on DefaultPartitionStatuses {
    materializedPartitions failedPartitions materializingPartitions } } } }"""

PARTITION_KEYS = """
query($key: AssetKeyInput!) { assetNodeOrError(assetKey: $key) { ... on AssetNode { partitionKeys } } }"""

BACKFILL = """
query($id: String!) { partitionBackfillOrError(backfillId: $id) { __typename
  ... on PartitionBackfill { id status partitionNames assetSelection { path } }
  ... on PythonError { message } } }"""

IN_FLIGHT = ("QUEUED", "NOT_STARTED", "MANAGED", "STARTING", "STARTED", "CANCELING")
RUNS = """
query($filter: RunsFilter) { runsOrError(filter: $filter) { __typename ... on Runs { results {
  runId status tags { key value } assetSelection { path } } } } }"""

MATERIALIZATIONS = """
query($key: AssetKeyInput!, $partitions: [String!]) { assetOrError(assetKey: $key) { ... on Asset {
  assetMaterializations(partitions: $partitions) { runId partition
    metadataEntries { label ... on IntMetadataEntry { intValue } } } } } }"""

SENSOR_TICKS = """
query($selector: SensorSelector!) { sensorOrError(sensorSelector: $selector) { __typename
  ... on Sensor { sensorState { ticks(limit: 5) { status } } } } }"""

LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) { __typename
  ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message stack } } }"""


NEW_FILE_SHARDS = ["00009"]


@dataclass
class Stack:
    live: LiveDagster
    config: str
    source: Path
    gpu_backfill_id: str  # launched through GraphQL once the server is up


def _key(asset: str) -> dict:
    return {"path": [asset]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, image_site, tiny_clip_dir):
    _, base_url = image_site
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # the screenshots of this run only
    root = tmp_path_factory.mktemp("live")
    src = root / "source"
    synthetic.make_source_parquets(str(src), base_url, n_files=1, rows_per_file=[45], n_images=120, seed=5)
    config = write_config(
        root / "shardprep.yaml", source=f"{src}/*.parquet", output_root=str(root / "out"), samples_per_shard=5,
        image_size=32, resize_mode="center_crop", allow_private_addresses=True,
        clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, thread_count=4, timeout=5,
        enable_nemo_text2img=False, enable_nemo_diffusion=False)
    assert register_sources(load_config(config)).all_keys == SHARDS
    # two "gpu" slots (no GPU here: CPU steps), so the module's four CLIP runs overlap their start-up
    home = prepare_home(root / "dagster_home", pool_limits={"gpu": 2})

    # registered (so the sensor's first tick finds nothing new) and upstream-ready for the GPU backfill
    # test: materialized before the daemon's first automation tick, which does not act on old events
    from shardprep_dagster.definitions import build_defs

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        instance.add_dynamic_partitions("shards", SHARDS)
        job = build_defs(config).resolve_job_def("shards_job")
        result = job.execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("source_parquet"), dg.AssetKey("image_shards")],
            tags={"dagster/asset_partition_range_start": BACKFILL_SHARDS[0],
                  "dagster/asset_partition_range_end": BACKFILL_SHARDS[-1]},
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}}, raise_on_error=False)
        assert result.success, [e.message for e in result.all_events if e.is_failure]
    finally:
        instance.dispose()

    live = start_live_dagster(home, config, env=LIVE_ENV)
    try:
        # Declarative automation ignores what happened before its first tick (its conditions start
        # "handled"), so a file whose source_parquet run ended before that tick would never be carried
        # on: on a loaded machine the daemon's first tick can come many seconds after it reports healthy
        live.wait_for("the automation sensor's first tick", lambda: automation_ticked(live), 120)
        # a new source file while the daemon runs: 4 rows, one new shard (00009)
        synthetic.make_source_parquets(str(src), base_url, n_files=1, rows_per_file=[4], n_images=120, seed=11,
                                       prefix="zz-new")
        launched = live.graphql(LAUNCH_BACKFILL, {"params": {
            "assetSelection": [_key("clip_embeddings")], "partitionNames": BACKFILL_SHARDS}})
        launched = launched["launchPartitionBackfill"]
        assert launched["__typename"] == "LaunchBackfillSuccess", launched
        yield Stack(live, config, src, launched["backfillId"])
    finally:
        live.stop()


def automation_ticked(live: LiveDagster) -> bool:
    selector = {"repositoryLocationName": "shardprep", "repositoryName": "__repository__",
                "sensorName": "shardprep_automation"}
    sensor = live.graphql(SENSOR_TICKS, {"selector": selector})["sensorOrError"]
    assert sensor["__typename"] == "Sensor", sensor
    return any(t["status"] in ("SUCCESS", "SKIPPED") for t in sensor["sensorState"]["ticks"])


def partition_statuses(live: LiveDagster, assets: list[str]) -> dict[str, dict[str, list[str]]]:
    nodes = live.graphql(PARTITION_STATUS, {"keys": [_key(a) for a in assets]})["assetNodes"]
    return {n["assetKey"]["path"][-1]: n["assetPartitionStatuses"] for n in nodes}


def wait_materialized(live: LiveDagster, assets: list[str], partitions: list[str], timeout: float, what: str,
                      run_tags: dict[str, str]):
    """Poll GraphQL until every asset has every partition materialized; fail at once if one fails.
    Partition statuses cost the webserver (on these 2 cores) more than a runs query: they are read
    only while no run tagged ``run_tags`` is queued or in flight."""
    def probe():
        if any(r["status"] in IN_FLIGHT for r in runs_for(live, run_tags)):
            return False
        statuses = partition_statuses(live, assets)
        assert sorted(statuses) == sorted(assets), statuses
        failed = {a: sorted(set(s["failedPartitions"]) & set(partitions)) for a, s in statuses.items()}
        if any(failed.values()):
            raise live.fail(f"{what}: failed partitions {failed}")
        missing = {a: sorted(set(partitions) - set(s["materializedPartitions"])) for a, s in statuses.items()}
        last_missing.clear()
        last_missing.update({a: m for a, m in missing.items() if m})
        return not last_missing

    last_missing: dict[str, list[str]] = {}
    try:
        live.wait_for(what, probe, timeout, interval=3)
    except Exception as e:
        raise AssertionError(f"still not materialized: {last_missing}") from e


def runs_for(live: LiveDagster, tags: dict[str, str]) -> list[dict]:
    data = live.graphql(RUNS, {"filter": {"tags": [{"key": k, "value": v} for k, v in tags.items()]}})
    return data["runsOrError"]["results"]


def wait_runs_succeeded(live: LiveDagster, tags: dict[str, str], what: str, timeout: float = 90) -> list[dict]:
    """The runs carrying ``tags``, once none is queued or running any more; all must have succeeded."""
    def probe():
        runs = runs_for(live, tags)
        return runs if runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs) else None

    runs = live.wait_for(f"the runs of {what} to finish", probe, timeout, interval=3)
    if any(r["status"] != "SUCCESS" for r in runs):
        raise live.fail(f"runs of {what} did not all succeed: {[(r['runId'], r['status']) for r in runs]}")
    return runs


def materializations(live: LiveDagster, asset: str, partitions: list[str]) -> list[dict]:
    data = live.graphql(MATERIALIZATIONS, {"key": _key(asset), "partitions": partitions})
    events = data["assetOrError"]["assetMaterializations"]
    for e in events:
        e["metadata"] = {m["label"]: m.get("intValue") for m in e.pop("metadataEntries")}
    return events


# -- GraphQL smoke -------------------------------------------------------------------------------------

def test_code_location_serves_every_asset_and_both_sensors_running(stack):
    from shardprep_dagster.definitions import build_defs

    defs = build_defs(stack.config)
    repos = stack.live.graphql(REPOSITORIES)["repositoriesOrError"]
    assert repos["__typename"] == "RepositoryConnection"
    (repo,) = [r for r in repos["nodes"] if r["location"]["name"] == "shardprep"]
    served = {"/".join(n["assetKey"]["path"]): n["isPartitioned"] for n in repo["assetNodes"]}
    assert set(served) == {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert all(served[a] for a in PER_SHARD)  # one partition per shard
    sensors = {s["name"]: s for s in repo["sensors"]}
    assert {"new_source_files", "shardprep_automation"} <= set(sensors)
    for name in ("new_source_files", "shardprep_automation"):
        assert sensors[name]["sensorState"]["status"] == "RUNNING", sensors[name]  # on by default
        assert sensors[name]["minIntervalSeconds"] == 1  # SHARDPREP_*_INTERVAL reached the code location
    # the repo's dagster.yaml turns off the "Join the Dagster community" dialog that would cover the UI
    assert stack.live.graphql("query { shouldShowNux }")["shouldShowNux"] is False


# -- the browser: materialize two shards of the per-shard assets from the asset graph --------------------

@pytest.fixture
def page(request):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test extra: run `make setup`")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            context.set_default_timeout(60_000)
            pg = context.new_page()
            failed_before = request.session.testsfailed
            yield pg
            if request.session.testsfailed > failed_before:  # what the page showed when the test failed
                shot(pg, f"failure-{request.node.name}")
                (ARTIFACTS / f"failure-{request.node.name}.html").write_text(pg.content())
        finally:
            browser.close()


def open_page(pg, url: str, ready, attempts: int = 3) -> None:
    """Navigate and wait for ``ready``; retried, as a busy webserver can drop a first load."""
    from playwright.sync_api import Error

    for attempt in range(attempts):
        try:
            pg.goto(url, wait_until="domcontentloaded", timeout=60_000)
            ready.wait_for(state="visible", timeout=60_000)
            return
        except Error:
            if attempt == attempts - 1:
                raise
            time.sleep(2)


def shot(pg, name: str) -> None:
    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def select_partitions(pg, dialog, keys: list[str]) -> None:
    """Tick exactly ``keys`` in the launch dialog's partition list. The dialog loads the partition sets
    after it opens and then picks a default (none, or every partition once some are materialized)."""
    from playwright.sync_api import expect

    expect(dialog.get_by_text("Loading pipeline and partition sets")).to_have_count(0, timeout=60_000)
    dialog.get_by_role("button", name="Custom").click()
    dialog.locator('[aria-haspopup="dialog"]').filter(has=pg.get_by_role("img", name="expand_more")).first.click()
    items = pg.get_by_role("menuitem").filter(has=pg.locator("[data-tooltip]"))
    items.first.wait_for()
    listed = [item.locator("[data-tooltip]").first.get_attribute("data-tooltip") for item in items.all()]
    assert set(keys) <= set(listed), listed

    def item(key: str):
        return items.filter(has=pg.locator(f'[data-tooltip="{key}"]'))

    def box(key: str):  # a hidden input under a drawn box: read it, click the menu item
        return item(key).get_by_role("checkbox")

    for key in listed:
        if box(key).is_checked() != (key in keys):
            item(key).click()
            expect(box(key)).to_be_checked(checked=key in keys)
    for key in listed:
        expect(box(key)).to_be_checked(checked=key in keys)
    dialog.get_by_text("Launch runs to materialize").click()  # closes the list
    expect(dialog.get_by_text(re.compile(rf"^{len(keys)} partitions?$"))).to_be_visible()  # the section header


def test_ui_materializes_two_shards_of_every_per_shard_asset(stack, page):
    live, pg = stack.live, page
    selection = " or ".join(f'key:"{a}"' for a in PER_SHARD)
    materialize = pg.get_by_role("button", name="Materialize all…")
    open_page(pg, f"{live.url}/asset-groups~{urllib.parse.quote(selection, safe='')}", materialize)
    shot(pg, "01-asset-graph")

    materialize.click()
    dialog = pg.get_by_role("dialog").filter(has_text="Launch runs to materialize")
    dialog.wait_for()
    assert f"Launch runs to materialize {len(PER_SHARD)} assets" in dialog.inner_text()
    select_partitions(pg, dialog, UI_SHARDS)
    shot(pg, "02-launch-dialog")

    dialog.get_by_role("button", name="Launch backfill").click()
    toast = pg.get_by_text(re.compile(r"Created backfill \w+")).first
    toast.wait_for()
    backfill_id = re.search(r"Created backfill (\w+)", toast.inner_text()).group(1)
    shot(pg, "03-backfill-created")
    pg.goto("about:blank")  # the asset graph polls the webserver every 2 s: not while we wait

    backfill = live.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
    assert backfill["__typename"] == "PartitionBackfill", backfill
    assert sorted(backfill["partitionNames"]) == UI_SHARDS
    assert sorted(p["path"][-1] for p in backfill["assetSelection"]) == sorted(PER_SHARD)

    wait_materialized(live, PER_SHARD, UI_SHARDS, timeout=300, what=f"backfill {backfill_id} of {UI_SHARDS}",
                      run_tags={"dagster/backfill": backfill_id})
    wait_runs_succeeded(live, {"dagster/backfill": backfill_id}, f"backfill {backfill_id}")
    assert not set(partition_statuses(live, ["source_parquet"])["source_parquet"]["materializedPartitions"]) & {
        "00008"}  # only what was asked for (00008 is never materialized)

    # the UI shows it too: every asset of the backfill 100% completed (the page refreshes itself)
    from playwright.sync_api import expect

    open_page(pg, f"{live.url}/runs/b/{backfill_id}?tab=overview", pg.get_by_text("Partitions targeted").first)
    for asset in PER_SHARD:
        row = pg.locator("[class*=VirtualizedTable_row]").filter(has=pg.locator(f'a[href="/assets/{asset}"]'))
        expect(row).to_contain_text("100% completed", timeout=60_000)
    shot(pg, "04-backfill-completed")
    open_page(pg, f"{live.url}/assets/reordered_embeddings?view=partitions", pg.get_by_text("Materialized (").first)
    shot(pg, "05-reordered-embeddings-partitions")


# -- daemon-driven: a new source file goes through every per-shard asset with no manual step -----------

def test_new_source_file_flows_through_every_per_shard_asset(stack):
    live = stack.live  # the fixture dropped zz-new-00000.parquet into the source folder

    def registered():
        keys = live.graphql(PARTITION_KEYS, {"key": _key("source_parquet")})["assetNodeOrError"]["partitionKeys"]
        return set(NEW_FILE_SHARDS) <= set(keys)

    live.wait_for("the new_source_files sensor to add the new shard partition", registered, 60)

    # Read from the event log, not the partition statuses: Dagster 1.13's status cache can drop a
    # partition added while a daemon holds a CachingDynamicPartitionsLoader from before the add (its
    # definition id comes from the instance, its keys from the stale cache), here clip_embeddings
    # during the concurrent GPU backfill: the UI then shows 00009 missing although it was materialized
    def carried_through():
        runs = runs_for(live, {"dagster/partition": NEW_FILE_SHARDS[0]})
        if any(r["status"] in ("FAILURE", "CANCELED") for r in runs):
            raise live.fail(f"a run for shard {NEW_FILE_SHARDS} did not succeed: "
                            f"{[(r['runId'], r['status']) for r in runs]}")
        if any(r["status"] in IN_FLIGHT for r in runs):
            return False
        return all(materializations(live, a, NEW_FILE_SHARDS) for a in PER_SHARD)

    live.wait_for(f"automation to carry shard {NEW_FILE_SHARDS} through {PER_SHARD}", carried_through, 300,
                  interval=3)

    # each asset of the new shard was materialized once, by a run the sensor or the automation launched
    runs = wait_runs_succeeded(live, {"dagster/partition": NEW_FILE_SHARDS[0]}, f"shard {NEW_FILE_SHARDS}")
    tags = {r["runId"]: {t["key"]: t["value"] for t in r["tags"]} for r in runs}
    made_by = {}
    for asset in PER_SHARD:
        (event,) = materializations(live, asset, NEW_FILE_SHARDS)
        made_by[asset] = tags[event["runId"]].get("dagster/sensor_name")
        if asset == "source_parquet":
            assert tags[event["runId"]].get("dagster/run_key") == NEW_FILE_SHARDS[0]
    assert made_by == {a: "new_source_files" if a == "source_parquet" else "shardprep_automation" for a in PER_SHARD}


# -- a real asset backfill through GraphQL: the CLIP model loads once per run, not once per shard --------

def test_gpu_backfill_loads_the_model_once_per_run(stack):
    live, backfill_id = stack.live, stack.gpu_backfill_id  # clip_embeddings x 6 shards, launched by the fixture
    backfill = live.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
    assert sorted(backfill["partitionNames"]) == BACKFILL_SHARDS
    assert [p["path"] for p in backfill["assetSelection"]] == [["clip_embeddings"]]

    wait_materialized(live, ["clip_embeddings"], BACKFILL_SHARDS, timeout=300, what=f"GPU backfill {backfill_id}",
                      run_tags={"dagster/backfill": backfill_id})
    runs = wait_runs_succeeded(live, {"dagster/backfill": backfill_id}, f"backfill {backfill_id}")
    assert len(runs) == len(BACKFILL_SHARDS) // GPU_SHARDS_PER_RUN == 2, runs  # max_partitions_per_run = 3
    ranges = sorted((t["dagster/asset_partition_range_start"], t["dagster/asset_partition_range_end"])
                    for t in ({x["key"]: x["value"] for x in r["tags"]} for r in runs))
    assert ranges == [("00000", "00002"), ("00003", "00005")]

    events = materializations(live, "clip_embeddings", BACKFILL_SHARDS)
    run_ids = {r["runId"] for r in runs}
    events = [e for e in events if e["runId"] in run_ids]
    assert sorted(e["partition"] for e in events) == BACKFILL_SHARDS
    by_run: dict[str, list[dict]] = {}
    for e in events:
        by_run.setdefault(e["runId"], []).append(e)
    assert set(by_run) == run_ids and all(len(v) == GPU_SHARDS_PER_RUN for v in by_run.values())
    loads = {}
    for run_id, evs in by_run.items():
        pids = {e["metadata"]["pid"] for e in evs}
        assert len(pids) == 1, evs  # one process embedded the run's shards
        loads[run_id] = (pids.pop(), {e["metadata"]["model_loads_in_process"] for e in evs})
    assert len({pid for pid, _ in loads.values()}) == len(runs)  # a process per run
    assert all(n == {1} for _, n in loads.values()), loads  # each loaded the model exactly once
    assert sum(max(n) for _, n in loads.values()) == len(runs)
