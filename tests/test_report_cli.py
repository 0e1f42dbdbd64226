"""Data you can see: per-shard contact sheets (in the UI's metadata), the dataset report page, and the
`shardprep status` / `shardprep backfill` terminal commands, over one real small pipeline run with a
failed shard, and a real Dagster webserver for the backfill."""

import base64
import html
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from shardprep.config import load_config
from shardprep.layout import Layout
from shardprep.ledger import register_sources
from shardprep.report.contact_sheet import (
    CELL_BACKGROUND,
    COLUMNS,
    LINE_HEIGHT,
    PAD,
    ContactSheetError,
    _fit,
    _font,
    contact_sheet,
    grid_size,
    inline_image,
)
from shardprep_dagster.assets import clip_embeddings, image_shards, reordered_embeddings, source_parquet
from shardprep_dagster.assets.report import dataset_report
from shardprep_dagster.orchestration.runner import run_pipeline
from shardprep_dagster.orchestration.status import asset_statuses
from shardprep_dagster.resources.clip import ClipResource
from shardprep_dagster.resources.dataset import DatasetResource
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, write_config
from tests.fixtures.live_dagster import free_port, start_live_dagster

SHARD_ASSETS = ["source_parquet", "image_shards", "clip_embeddings", "reordered_embeddings"]
CLI_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SHARDPREP_AUTOMATION": "off"}


# -- contact sheets on hand-made tars (known colours, known captions) --------------------------------------

COLOURS = [(220, 30, 30), (30, 200, 40), (30, 40, 220), (240, 220, 20), (200, 30, 200), (20, 200, 200),
           (120, 60, 10), (250, 140, 0), (90, 90, 90), (0, 0, 0)]


def _write_tar(path: Path, n: int, size=(40, 30), captions=None) -> None:
    """``n`` webdataset samples (real TarWriter) whose images are plain colours, in key order."""
    with wds.TarWriter(str(path)) as sink:
        for i in range(n):
            buf = io.BytesIO()
            Image.new("RGB", size, COLOURS[i % len(COLOURS)]).save(buf, format="PNG")
            sink.write({"__key__": f"{i:09d}", "png": buf.getvalue(), "json": {"i": i},
                        "txt": (captions or {}).get(i, f"sample {i}")})


def _cell(i: int, thumb: int) -> tuple[int, int]:
    """Top-left pixel of thumbnail ``i``."""
    cell_w, cell_h = grid_size(1, thumb)
    return (i % COLUMNS) * cell_w + PAD, (i // COLUMNS) * cell_h + PAD


@pytest.mark.parametrize("n, max_images", [(9, 24), (30, 7), (3, 3)])
def test_contact_sheet_has_one_thumbnail_per_sample_up_to_max(tmp_path, n, max_images):
    tar = tmp_path / "00000.tar"
    _write_tar(tar, n)
    thumb = 48
    sheet = Image.open(io.BytesIO(contact_sheet(str(tar), max_images=max_images, thumb=thumb)))
    assert sheet.format == "PNG"
    shown = min(n, max_images)
    assert sheet.size == grid_size(shown, thumb)
    assert sheet.size[0] == min(shown, COLUMNS) * (thumb + 2 * PAD)
    rows = -(-shown // COLUMNS)
    for i in range(rows * min(shown, COLUMNS)):
        x, y = _cell(i, thumb)
        centre = sheet.getpixel((x + thumb // 2, y + thumb // 2))
        if i < shown:  # sample i's colour, in key order, with its caption (dark text) underneath
            assert np.allclose(centre, COLOURS[i % len(COLOURS)], atol=6), (i, centre)
            caption = np.asarray(sheet.crop((x, y + thumb + PAD, x + thumb, y + thumb + PAD + LINE_HEIGHT)))
            assert (caption.min(axis=2) < 100).any(), f"no caption text under thumbnail {i}"
        else:  # past the last sample: blank
            assert centre == (255, 255, 255)


def test_contact_sheet_keeps_aspect_and_marks_unreadable_images(tmp_path):
    tar = tmp_path / "00001.tar"
    _write_tar(tar, 2, size=(80, 20))
    with tarfile.open(tar, "a") as t:  # a sample whose image is not an image
        data = b"definitely not a jpeg"
        info = tarfile.TarInfo("000000009.jpg")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    sheet = Image.open(io.BytesIO(contact_sheet(str(tar), thumb=64)))
    assert sheet.size == grid_size(3, 64)
    x, y = _cell(0, 64)
    # 80x20 scaled to 64x16, centred: the cell's top and bottom stay background
    assert sheet.getpixel((x + 32, y + 2)) == CELL_BACKGROUND
    assert np.allclose(sheet.getpixel((x + 32, y + 32)), COLOURS[0], atol=6)
    x, y = _cell(2, 64)
    assert sheet.getpixel((x + 32, y + 58)) == CELL_BACKGROUND  # nothing pasted; the key is written instead
    red = np.asarray(sheet.crop((x, y, x + 64, y + 64)))
    assert ((red[..., 0] > 120) & (red[..., 1] < 60)).any()  # the "unreadable" note in red


def test_contact_sheet_errors_name_the_tar(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\x00" * 10 + b"not a tar at all" * 50)
    with pytest.raises(ContactSheetError, match="bad.tar"):
        contact_sheet(str(bad))
    empty = tmp_path / "empty.tar"
    with wds.TarWriter(str(empty)) as sink:
        sink.write({"__key__": "000000000", "json": {"i": 0}})
    with pytest.raises(ContactSheetError, match="empty.tar.*no image"):
        contact_sheet(str(empty))


def test_captions_are_wrapped_and_truncated():
    from PIL import ImageDraw

    draw, font = ImageDraw.Draw(Image.new("RGB", (1, 1))), _font()
    lines = _fit(draw, "a synthetic photo number 12 with a caption far too long for two lines", font, 96, 2)
    assert len(lines) == 2 and lines[-1].endswith("...")
    assert all(draw.textlength(line, font=font) <= 96 for line in lines)
    assert _fit(draw, "short one", font, 96, 2) == ["short one"]
    assert _fit(draw, "x" * 200, font, 96, 2)[0].endswith("...")


def test_caption_fitting_looks_at_a_bounded_prefix():
    """Fitting a caption measures a bounded amount of text, however long the caption (50,000
    characters happen): the number of ``textlength`` calls and the text they measure do not grow."""
    from PIL import ImageDraw

    draw, font = ImageDraw.Draw(Image.new("RGB", (1, 1))), _font()
    measured: list[int] = []
    real = draw.textlength
    draw.textlength = lambda text, *a, **kw: measured.append(len(text)) or real(text, *a, **kw)
    for text in ("a caption word " * 4000, "x" * 50_000, "i l . " * 10_000):
        calls = {}
        for n in (100, 5_000, 50_000):
            measured.clear()
            lines = _fit(draw, text[:n], font, 96, 2)
            calls[n] = len(measured)
            assert len(lines) == 2 or text[0] == "x"
            assert all(real(line, font=font) <= 96 for line in lines)
            assert max(measured) <= 200
        assert calls[5_000] == calls[50_000] and max(calls.values()) <= 40, calls


def test_inline_image_stays_under_the_limit():
    rng = np.random.default_rng(0)
    noisy = Image.fromarray(rng.integers(0, 255, (400, 600, 3), dtype=np.uint8))
    buf = io.BytesIO()
    noisy.save(buf, format="PNG")
    assert len(buf.getvalue()) > 200_000
    uri, width = inline_image(buf.getvalue(), max_bytes=60_000)
    assert len(uri) <= 60_000 and uri.startswith("data:image/jpeg;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).width == width
    small = io.BytesIO()
    Image.new("RGB", (50, 50), (1, 2, 3)).save(small, format="PNG")
    uri, width = inline_image(small.getvalue())
    assert uri == "data:image/png;base64," + base64.b64encode(small.getvalue()).decode() and width == 50


# -- one real pipeline run: 4 shards, shard 00003's source rows gone after registration, then a 5th
#    shard registered and not run ----------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory, image_site, tiny_clip_dir):
    from tests.fixtures.live_dagster import prepare_home

    tmp = tmp_path_factory.mktemp("report")
    src = tmp / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=2, rows_per_file=[40, 25],
                                   n_images=120, seed=3)
    config = write_config(
        tmp / "shardprep.yaml", source=f"{src}/*.parquet", output_root=str(tmp / "out"), samples_per_shard=20,
        image_size=32, resize_mode="center_crop", allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}",
        batch_size=16, thread_count=8, timeout=5, enable_nemo_text2img=False, enable_nemo_diffusion=False)
    register_sources(load_config(config))  # shards 00002 = rows 0-19, 00003 = rows 20-24 of the 2nd file
    # shard 00003 now asks for rows 20-27 of the 25-row file: its source rows are not all there
    ledger_path = tmp / "out" / "ledger.json"
    ledger = json.loads(ledger_path.read_text())
    ledger["files"][1]["segments"][0]["row_stop"] = 28
    ledger_path.write_text(json.dumps(ledger))
    home = prepare_home(tmp / "dagster_home")
    instance = dg.DagsterInstance.from_config(str(home))
    dataset = DatasetResource(config_path=config)
    defs = dg.Definitions(assets=[source_parquet, image_shards, clip_embeddings, reordered_embeddings,
                                  dataset_report], resources={"dataset": dataset, "clip": ClipResource(dataset=dataset)})
    before_report = {s.asset: s for s in asset_statuses(config)}  # nothing run yet
    summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
    # a new source file registered (as the sensor does) but not run yet: shard 00004 is missing everywhere
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[15], n_images=120, seed=9,
                                   prefix="zz-new")
    new = register_sources(load_config(config)).new_keys
    assert new == ["00004"]
    instance.add_dynamic_partitions("shards", new)
    result = dg.materialize([dataset_report], instance=instance, resources={"dataset": dataset})
    yield {"config": config, "home": home, "instance": instance, "summary": summary, "defs": defs,
           "layout": Layout(str(tmp / "out")), "before_report": before_report, "report_result": result}
    instance.dispose()


def _partition_metadata(instance: dg.DagsterInstance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1).records
    return records[0].asset_materialization.metadata


def test_image_shard_metadata_shows_its_contact_sheet(run):
    layout, instance = run["layout"], run["instance"]
    summary = run["summary"]
    assert [s for s in summary.shards if s in summary.failed] == ["00003"]
    assert "fewer rows" in summary.failed["00003"]
    for shard in ["00000", "00001", "00002"]:
        successes = pq.read_table(layout.shard_parquet(shard)).to_pandas().status.eq("success").sum()
        png = Path(layout.contact_sheet(shard)).read_bytes()
        assert png == contact_sheet(layout.tar(shard))  # the saved preview is this shard's sheet
        assert Image.open(io.BytesIO(png)).size == grid_size(min(24, successes), 96)
        meta = _partition_metadata(instance, "image_shards", shard)
        assert meta["contact_sheet_png"].value == layout.contact_sheet(shard)
        md = meta["contact_sheet"].value
        uri = re.fullmatch(r"!\[contact sheet of shard \d+\]\((data:image/(?:png|jpeg);base64,[A-Za-z0-9+/=]+)\)",
                           md).group(1)
        assert len(uri) <= 60_000
        inline = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
        full = Image.open(io.BytesIO(png))
        assert abs(inline.width / inline.height - full.width / full.height) < 0.02
    assert not Path(layout.root, "previews").joinpath("00003.png").exists()
    assert sorted(p.name for p in Path(layout.images_dir).iterdir() if "contact" in p.name or p.suffix == ".png") == []


def test_dataset_report_page_holds_the_plots_and_the_numbers(run):
    layout, result = run["layout"], run["report_result"]
    assert result.success
    page = Path(layout.report_html).read_text()
    stats = {s: json.loads(Path(layout.shard_stats(s)).read_text()) for s in ["00000", "00001", "00002"]}
    count = sum(s["count"] for s in stats.values())
    successes = sum(s["successes"] for s in stats.values())
    assert count == 20 * 3 and successes < count  # shard 00003 failed: not processed
    embedded = sum(len(np.load(layout.img_emb(s))) for s in stats)
    assert embedded == successes

    summary = re.search(r'<table id="summary">(.*?)</table>', page, re.S).group(1)
    cells = dict(re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", summary))
    assert cells["shards"] == "5" and cells["shards processed"] == "3" and cells["shards embedded"] == "3"
    assert cells["samples"] == str(count) and cells["successes"] == str(successes)
    assert cells["success rate"] == f"{successes / count:.2%}"
    assert cells["embeddings"] == str(embedded) and cells["embedding dim"] == "32"
    # failures by reason: the stats' status_dict, summed
    reasons = {}
    for s in stats.values():
        for reason, n in s["status_dict"].items():
            if reason != "success":
                reasons[reason] = reasons.get(reason, 0) + n
    table = re.search(r'<table id="failures">(.*?)</table>', page, re.S).group(1)
    shown = {html.unescape(r): int(n) for r, n in re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", table)}
    assert shown == reasons and sum(reasons.values()) == count - successes
    # per shard: success rate of each, the failed shard as not processed
    for shard, s in stats.items():
        assert f"<tr><td>{shard}</td><td>{s['count']}</td><td>{s['successes']}</td>" \
               f"<td>{s['successes'] / s['count']:.2%}</td>" in page
    assert "<tr><td>00003</td><td>not processed</td>" in page
    assert "<tr><td>00004</td><td>not processed</td>" in page
    # five plots, each a decodable PNG inlined (the page is self-contained)
    plots = re.findall(r'<figure id="(\w+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [p for p, _ in plots] == ["success_rate", "failures", "image_sizes", "caption_lengths", "embedding_norms"]
    for _, data in plots:
        assert Image.open(io.BytesIO(base64.b64decode(data))).size[0] > 200
    assert "http://" not in page.split("<body>", 1)[1].split("Failures by reason</h2>")[0]  # nothing fetched

    mat = result.asset_materializations_for_node("dataset_report")[0].metadata
    assert mat["report"].value == layout.report_html
    assert mat["successes"].value == successes and mat["samples"].value == count
    assert mat["success_rate"].value == round(successes / count, 4) and mat["shards_processed"].value == 3
    assert f"{successes / count:.2%}" in mat["summary"].value


def _status_rows(text: str) -> dict[str, list[str]]:
    lines = text.strip().splitlines()
    assert lines[0].split()[:2] == ["asset", "materialized"]
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def test_status_counts_materialized_failed_and_missing(run):
    env = {**os.environ, **CLI_ENV, "DAGSTER_HOME": str(run["home"])}
    out = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "status", "--config", run["config"]],
                         cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = _status_rows(out.stdout)
    assert set(SHARD_ASSETS) <= set(rows)
    # materialized, outdated, failed, in progress, missing, of shards. 00003: source_parquet failed, so its
    # downstream steps in that run did not materialize: failed too, as the UI shows them. 00004: missing
    for asset in SHARD_ASSETS:
        assert rows[asset][:6] == ["3", "0", "1", "0", "1", "5"], (asset, rows[asset])

    # unpartitioned: missing before the report was made, materialized (with its time) after
    before = run["before_report"]["dataset_report"]
    assert not before.partitioned and before.state == "missing"
    after = {s.asset: s for s in asset_statuses(run["config"])}
    assert after["dataset_report"].state == "materialized" and after["dataset_report"].last_materialized
    assert after["image_shards"].materialized == 3 and after["image_shards"].missing == 1
    assert after["image_shards"].failed == 1
    from shardprep_dagster.orchestration.status import format_status

    table = _status_rows(format_status(list(after.values())))
    assert table["dataset_report"][0] == "yes" and "(unpartitioned)" in table["dataset_report"]


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **CLI_ENV, "DAGSTER_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", *args], cwd=CHECKOUT, env=env,
                          capture_output=True, text=True, timeout=120)


BACKFILLS = """
query { partitionBackfillsOrError { __typename ... on PartitionBackfills { results {
  id status partitionNames assetSelection { path } } } } }"""


def test_backfill_launches_in_the_running_instance(run):
    live = start_live_dagster(run["home"], run["config"], env=CLI_ENV)
    try:
        out = _cli("backfill", "image_shards,clip_embeddings", "--partitions", "00000,00002", "--url", live.url,
                   home=run["home"])
        assert out.returncode == 0, out.stderr
        first = out.stdout.strip()
        missing = _cli("backfill", "*", "--all-missing", "--url", live.url, home=run["home"])
        assert missing.returncode == 0, missing.stderr
        second = missing.stdout.strip()
        bad = _cli("backfill", "image_shards,no_such_asset", "--partitions", "00001", "--url", live.url,
                   home=run["home"])
        assert bad.returncode == 2 and "no_such_asset" in bad.stderr
        found = {b["id"]: b for b in live.graphql(BACKFILLS)["partitionBackfillsOrError"]["results"]}
    finally:
        live.stop()
    assert re.fullmatch(r"[a-z]{8}", first) and first in found
    assert sorted(found[first]["partitionNames"]) == ["00000", "00002"]
    assert {tuple(a["path"]) for a in found[first]["assetSelection"]} == {("image_shards",), ("clip_embeddings",)}
    # every asset, every shard some asset lacks: 00003 (failed) and 00004 (never run)
    assert sorted(found[second]["partitionNames"]) == ["00003", "00004"]
    assert {"source_parquet", "reordered_embeddings"} <= {a["path"][0] for a in found[second]["assetSelection"]}


def test_backfill_against_a_dead_port_fails_clearly(tmp_path):
    port = free_port()  # nothing listens there
    out = _cli("backfill", "*", "--all-missing", "--url", f"http://127.0.0.1:{port}", home=tmp_path / "home")
    assert out.returncode == 2 and out.stdout == ""
    assert f"no Dagster webserver answers at http://127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr
