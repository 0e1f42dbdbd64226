"""`shardprep retry`: the transiently failed rows of a finished shard are downloaded again (and nothing
else: the server counts every request), the new successes merged into the same tar in key order, the
shard's downstream (asset, shard) pairs invalidated, and the next run redoes exactly those."""

import io
import json
import os

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.config import load_config
from shardprep.images.retry import downstream_shard_artifacts, parse_reasons, reason_matches, retry_shard
from shardprep.layout import Layout
from shardprep.versions import read_stamp
from shardprep_dagster.orchestration import cli
from shardprep_dagster.orchestration.retry import retry
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config
from tests.fixtures.scripted_http import Reply

# shard 00000 (rows 0-9): transient failures; shard 00001 (rows 10-19): only successes and a 404
TRANSIENT_ROWS = {2: Reply(503, b"busy"), 5: Reply(200, b"late", delay=3), 7: Reply(hang_up=True)}
NOT_FOUND_ROWS = {4, 13}  # never scripted: the server answers 404
ROWS = 20


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    synthetic.render_image(i, 48, 40).save(buf, "JPEG")
    return buf.getvalue()


def _path(i: int) -> str:
    return f"/img{i:02d}.jpg"


@pytest.fixture
def dataset(tmp_path, scripted_server, tiny_clip_dir):
    for i in range(ROWS):
        if i not in NOT_FOUND_ROWS:
            scripted_server.script(_path(i), TRANSIENT_ROWS.get(i, Reply(200, _jpeg(i))))
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"url": [scripted_server.url(_path(i)) for i in range(ROWS)],
                             "caption": [f"caption {i}" for i in range(ROWS)]}), tmp_path / "src" / "a.parquet")
    config = write_config(tmp_path / "c.yaml", source=str(tmp_path / "src" / "*.parquet"),
                          output_root=str(tmp_path / "out"), samples_per_shard=10, image_size=32,
                          allow_private_addresses=True, thread_count=4, timeout=1, retries=0,
                          clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
                          enable_nemo_text2img=False, enable_nemo_diffusion=False)
    return config, Layout(str(tmp_path / "out")), scripted_server


def _hits(server) -> dict[int, int]:
    return {i: server.hits(_path(i)) for i in range(ROWS)}


def _stamps(layout: Layout, shard: str) -> dict[str, float | None]:
    """``written_at`` of the shard's downstream stamps (diffusion_samples, captions and training_text are off
    in these tests)."""
    return {a: (read_stamp(layout, a, shard) or {}).get("written_at") for a in downstream_shard_artifacts()
            if a not in ("diffusion_samples", "captions", "training_text")}


def test_retry_fetches_only_transient_failures_and_invalidates_that_shards_downstream(dataset, capsys, monkeypatch):
    import webdataset as wds

    config, layout, server = dataset
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        before = pq.read_table(layout.shard_parquet("00000")).to_pydict()
        assert [before["status"][i] for i in (2, 4, 5, 7)] == ["failed_to_download"] * 4
        hits, image_stamp = _hits(server), read_stamp(layout, "image_shards", "00000")
        other = _stamps(layout, "00001")
        assert all(other.values()) and all(_stamps(layout, "00000").values())

        # the site is back: the transient rows now answer with images
        for i in TRANSIENT_ROWS:
            server.script(_path(i), Reply(200, _jpeg(i)))
        reports = retry(config, parse_reasons("transient"), instance=instance)
        assert [(r.shard, r.retried, r.recovered, r.still_failed, r.retry_round) for r in reports] == [
            ("00000", 3, 3, 0, 1), ("00001", 0, 0, 0, 0)]

        # only the transient rows were asked again: no 404 row, no row that had succeeded
        after_hits = _hits(server)
        assert {i: after_hits[i] - hits[i] for i in range(ROWS) if after_hits[i] != hits[i]} == dict.fromkeys(
            TRANSIENT_ROWS, 1)

        rows = pq.read_table(layout.shard_parquet("00000")).to_pydict()
        assert [s for s in rows["status"]] == ["failed_to_download" if i == 4 else "success" for i in range(10)]
        assert rows["error_message"][4] == "HTTP Error 404: Not Found" and rows["key"] == before["key"]
        assert [rows["caption"][i] for i in TRANSIENT_ROWS] == [f"caption {i}" for i in TRANSIENT_ROWS]
        samples = list(wds.WebDataset(layout.tar("00000"), shardshuffle=False))
        keys = [s["__key__"] for s in samples]
        assert keys == [k for k, s in zip(rows["key"], rows["status"]) if s == "success"] == sorted(set(keys))
        assert all(json.loads(s["json"])["key"] == s["__key__"] and s["txt"] for s in samples)
        stats = json.loads(open(layout.shard_stats("00000")).read())
        assert (stats["successes"], stats["failed_to_download"], stats["retry_round"]) == (9, 1, 1)
        assert stats["status_dict"] == {"success": 9, "HTTP Error 404: Not Found": 1}

        # the image stamp written again (new sizes); the downstream stamps of 00000 only are gone
        new_stamp = read_stamp(layout, "image_shards", "00000")
        assert new_stamp["version"] == image_stamp["version"] and new_stamp["outputs"] != image_stamp["outputs"]
        assert not any(_stamps(layout, "00000").values()) and _stamps(layout, "00001") == other
        for asset in ("clip_embeddings", "reordered_embeddings", "image_scores"):
            assert instance.get_materialized_partitions(dg.AssetKey(asset)) == {"00001"}, asset
        assert instance.get_materialized_partitions(dg.AssetKey("image_shards")) == {"00000", "00001"}
        # the partition shows the round (a materialization at the shard's version: not redone by a run)
        [shown] = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("image_shards"), asset_partitions=["00000"]), limit=1).records
        meta = shown.asset_materialization.metadata
        assert (meta["retry_round"].value, meta["recovered"].value) == (1, 3) and "contact_sheet" in meta
        preview = os.path.getmtime(layout.contact_sheet("00000"))
        assert preview > os.path.getmtime(layout.contact_sheet("00001"))  # made again with the new samples

        # the next run makes the downstream of 00000 again, keeps 00001's, downloads nothing
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        assert _hits(server) == after_hits
        assert read_stamp(layout, "image_shards", "00000")["written_at"] == new_stamp["written_at"]
        assert all(_stamps(layout, "00000").values()) and _stamps(layout, "00001") == other

        for asset in ("clip_embeddings", "reordered_embeddings", "image_scores"):
            assert instance.get_materialized_partitions(dg.AssetKey(asset)) == {"00000", "00001"}, asset

        # nothing left to retry: the CLI says so, changes nothing, and exits 0
        from shardprep_dagster.orchestration import instance as instance_module

        monkeypatch.setattr(instance_module, "get_instance", lambda: instance)
        capsys.readouterr()
        assert cli.main(["retry", "--config", config]) == 0
        out = capsys.readouterr().out
        assert "shard 00000: no row to retry" in out and "2 shard(s) looked at, 0 row(s) retried" in out
        assert read_stamp(layout, "image_shards", "00000")["written_at"] == new_stamp["written_at"]


def test_a_row_failing_again_keeps_its_new_reason_and_nothing_is_invalidated(dataset):
    config, layout, server = dataset
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True, shards="0").ok
        downstream = _stamps(layout, "00000")
        tar_before = open(layout.tar("00000"), "rb").read()
        server.script(_path(2), Reply(502, b"bad gateway"))  # still transient, another reason
        [report] = retry(config, parse_reasons("5xx"), shards="0", instance=instance)
        assert (report.retried, report.recovered, report.still_failed, report.invalidated) == (1, 0, 1, [])
        rows = pq.read_table(layout.shard_parquet("00000")).to_pydict()
        assert rows["error_message"][2] == "HTTP Error 502: Bad Gateway"
        assert rows["error_message"][5] == "timed out"  # not a 5xx: not asked again
        assert open(layout.tar("00000"), "rb").read() == tar_before
        assert _stamps(layout, "00000") == downstream


def test_an_unfinished_shard_is_skipped(dataset):
    config, layout, _ = dataset
    report = retry_shard(layout, load_config(config), "00000")
    assert report.skipped and "not finished" in report.summary()


def test_reason_classes():
    assert parse_reasons(None) == "transient" and parse_reasons("timeout,503") == {"timeout", "503"}
    with pytest.raises(ValueError, match="404"):
        parse_reasons("timeout,404")
    assert reason_matches("HTTP Error 503: Service Unavailable", {"5xx"})
    assert reason_matches("rate limited (HTTP 429, Retry-After 3600 s)", {"429"})
    assert reason_matches("timed out", {"timeout"}) and not reason_matches("timed out", {"connection"})
    assert reason_matches("connection broken: RemoteDisconnected('x')", {"connection"})
    assert not reason_matches("HTTP Error 404: Not Found", "transient")
    assert not reason_matches("HTTP Error 404: Not Found", {"5xx", "429"})
    assert downstream_shard_artifacts() == ["clip_embeddings", "reordered_embeddings", "image_scores", "captions",
                                            "training_text", "diffusion_samples"]


def test_cli_rejects_a_permanent_reason(capsys):
    assert cli.main(["retry", "--config", "nowhere.yaml", "--reasons", "404"]) == 2
    assert "not a transient reason class: 404" in capsys.readouterr().err


def test_a_shard_without_a_success_gets_its_first_tar(tmp_path, scripted_server):
    from shardprep.config import config_from_dict
    from shardprep.images.shards import write_image_shard
    from shardprep.verify import file_sizes
    from shardprep.versions import artifact_versions, write_stamp

    cfg = config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"),
                            "samples_per_shard": 10, "image_size": 32, "allow_private_addresses": True,
                            "timeout": 1, "retries": 0, "thread_count": 2, "caption_col": None})
    layout = Layout(cfg.output_root)
    for i in range(3):
        scripted_server.script(_path(i), Reply(429, b"slow down"))
    table = pa.table({"url": [scripted_server.url(_path(i)) for i in range(3)]})
    assert write_image_shard(table, 3, cfg, layout).successes == 0
    write_stamp(layout, "image_shards", artifact_versions(cfg)["image_shards"], "00003",
                file_sizes(layout.shard_outputs("image_shards", "00003")))
    assert not os.path.exists(layout.tar("00003"))

    for i in range(3):
        scripted_server.script(_path(i), Reply(200, _jpeg(i)))
    report = retry_shard(layout, cfg, "00003", parse_reasons("429"))
    assert (report.retried, report.recovered, report.retry_round) == (3, 3, 1)
    assert _tar_samples(layout.tar("00003")) == [("000030", True), ("000031", True), ("000032", True)]
    assert read_stamp(layout, "image_shards", "00003")["outputs"][layout.tar("00003")] > 0
    assert retry_shard(layout, cfg, "00003").retried == 0  # the second time: nothing qualifies


def _tar_samples(path: str) -> list[tuple[str, bool]]:
    """(key, whether its jpg member is a JPEG) of each sample, as webdataset reads them."""
    import webdataset as wds

    return [(s["__key__"], s["jpg"][:2] == b"\xff\xd8") for s in wds.WebDataset(path, shardshuffle=False)]
