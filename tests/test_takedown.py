"""Takedowns (issue 23, item 1): a list of URLs, keys and image hashes applied to a finished dataset leaves
no byte of the listed images anywhere under the output root, every loader reads the rest, the removal is
audited, and no later run brings a listed sample back -- nor downloads a newly appended listed row."""

import io
import json
import tarfile
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.config import load_config
from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep.nemo.balanced import load_state
from shardprep.takedown.apply import filter_tar
from shardprep.takedown.lists import (
    REMOVED,
    TakedownListError,
    TakedownSet,
    audit_records,
    read_list,
    register,
    registered,
)
from shardprep.tars import TarWriter, read_samples_by_key, sample_keys
from shardprep.verify import Target, check_takedowns
from shardprep_dagster.orchestration.runner import run_pipeline
from shardprep_dagster.orchestration.takedown import takedown
from shardprep_dagster.orchestration.verify import verify_dataset
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config

SHA = "ab" * 32


# ---------------------------------------------------------------- lists


def test_a_text_list_mixes_kinds_and_names_a_bad_line(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("# opt-outs\nhttps://a.example/x.jpg\nexample.org\n000120034\n" + SHA.upper()
                    + "\ndomain: Cdn.Example.NET.\nkey:000000001_00002\n\nhttps://a.example/x.jpg\n")
    entries = read_list(str(path))
    assert [(e.kind, e.value) for e in entries] == [
        ("url", "https://a.example/x.jpg"), ("domain", "example.org"), ("key", "000120034"), ("sha256", SHA),
        ("domain", "cdn.example.net"), ("key", "000000001_00002")]
    path.write_text("https://ok.example/a.jpg\nurl: not a url\n")
    with pytest.raises(TakedownListError, match=r"list.txt, line 2: URL 'not a url' has no scheme"):
        read_list(str(path))
    with pytest.raises(TakedownListError, match="no such takedown list"):
        read_list(str(tmp_path / "missing.txt"))


def test_table_lists_and_matching(tmp_path):
    pq.write_table(pa.table({"url": ["https://a.example/1.jpg", None], "domain": [None, "bad.example"],
                             "reason": ["DMCA 17", "opt-out"]}), tmp_path / "l.parquet")
    (tmp_path / "l.csv").write_text("kind,value,reason\nsha256,%s,hash request\nkey,000000007,\n" % SHA)
    p_entries, c_entries = read_list(str(tmp_path / "l.parquet")), read_list(str(tmp_path / "l.csv"))
    assert [(e.kind, e.value, e.reason) for e in p_entries] == [
        ("url", "https://a.example/1.jpg", "DMCA 17"), ("domain", "bad.example", "opt-out")]
    (tmp_path / "bad.csv").write_text("path\nx\n")
    with pytest.raises(TakedownListError, match="no takedown column"):
        read_list(str(tmp_path / "bad.csv"))

    layout = Layout(str(tmp_path / "out"))
    v1 = register(layout, p_entries, "l.parquet")
    v2 = register(layout, c_entries, "l.csv")
    assert register(layout, list(reversed(p_entries)), "again") == v1  # the version names the entries
    assert {r.version for r in registered(layout)} == {v1, v2}
    s = TakedownSet.of(registered(layout))
    assert s.match("000000001", "https://a.example/1.jpg")[:3] == ("url", "https://a.example/1.jpg", v1)
    assert s.match("000000001", "http://img.bad.example:8080/p.png")[:2] == ("domain", "bad.example")
    assert s.match("000000001", "http://notbad.example/p.png") is None  # a suffix is not a subdomain
    assert s.match("000000007_00003", None)[:2] == ("key", "000000007")  # a clip of a listed row
    assert s.match("000000008", "https://x.example/", SHA)[:2] == ("sha256", SHA)
    assert s.match("000000008", "https://x.example/", "cd" * 32) is None


def test_filter_tar_keeps_every_other_member_byte_for_byte(tmp_path):
    url = str(tmp_path / "t.tar")
    with TarWriter(url) as tar:
        for k in ("000000000", "000000001", "000000002"):
            tar.add(k, {"jpg": k.encode() * 100, "json": b"{}", "txt": "caption " + k})
    before = {m.name: m for m in tarfile.open(url).getmembers()}
    assert filter_tar(url, lambda k: k == "000000001") == 1
    with tarfile.open(url) as t:
        assert [m.name for m in t.getmembers()] == [n for n in before if not n.startswith("000000001")]
        for m in t.getmembers():
            assert (m.mtime, m.size, m.mode) == (before[m.name].mtime, before[m.name].size, before[m.name].mode)
    assert sample_keys(url) == ["000000000", "000000002"]
    assert filter_tar(url, lambda k: False) == 0
    assert filter_tar(url, lambda k: True) == 2 and not Path(url).exists()  # nothing left: no tar


# ---------------------------------------------------------------- a finished dataset


@pytest.fixture
def dataset(tmp_path, image_site, tiny_clip_dir, tiny_nemo_dirs):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[30], n_images=120, seed=11)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=10, image_size=32, allow_private_addresses=True, thread_count=8,
                          timeout=5, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, tar_chunk_size=4,
                          precache_keep_original=True, aesthetic_model=None, dedup=True,
                          **nemo_config(tiny_nemo_dirs))
    return config, Layout(str(tmp_path / "out")), src, image_site


def _files(root: str) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _successes(layout: Layout, shard: str) -> list[dict]:
    t = pq.read_table(layout.shard_parquet(shard)).to_pylist()
    return [r for r in t if r["status"] == "success"]


def test_a_takedown_leaves_no_byte_of_a_listed_image_and_nothing_comes_back(dataset, tmp_path):
    config, layout, src, _ = dataset
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        # three samples, named three ways: by URL (shard 0), by key (shard 1), by the sha256 of its bytes (shard 2)
        by_url, by_key, by_hash = _successes(layout, "00000")[1], _successes(layout, "00001")[2], \
            _successes(layout, "00002")[0]
        victims = {r["key"]: r for r in (by_url, by_key, by_hash)}
        images = {k: read_samples_by_key(layout.tar(f"0000{k[4]}"), {k})[k] for k in victims}
        captions = {k: im["txt"] for k, im in images.items()}
        kept = {s: sample_keys(layout.tar(s)) for s in ("00000", "00001", "00002")}
        n_img = {s: len(np.load(layout.img_emb(s))) for s in kept}
        lst = tmp_path / "takedown.txt"
        lst.write_text(f"{by_url['url']}\nkey:{by_key['key']}\nsha256:{by_hash['sha256']}\n")

        generation = json.loads(Path(layout.dedup_state).read_text()).get("generation", 0)
        report, summary = takedown(config, [str(lst)], instance=instance, in_process=True)
        assert summary is not None and summary.ok, summary.failed
        assert sorted(r["key"] for s in report.shards for r in s.removed) == sorted(victims)
        assert {r["kind"] for s in report.shards for r in s.removed} == {"url", "key", "sha256"}
        per_artifact = report.per_artifact()
        for name in ("image_shards", "clip_embeddings", "reordered_embeddings", "diffusion_samples"):
            assert per_artifact[name] == 3, per_artifact

        # no byte of a listed image, nor its caption in any tar, anywhere under the output root
        for file, data in _files(layout.root).items():
            for k, im in images.items():
                assert im["jpg"] not in data, f"{file} still holds the image of {k}"
                if file.suffix == ".tar":  # a member's data is padded with zeros (captions share prefixes)
                    assert captions[k] + b"\0" not in data, f"{file} still holds the caption of {k}"
        # every artifact lost exactly them, and reads back whole
        for shard, keys in kept.items():
            gone = {k for k in victims if k[4] == shard[-1]}
            assert sample_keys(layout.tar(shard)) == [k for k in keys if k not in gone]
            meta = pq.read_table(layout.emb_metadata(shard)).column("image_path").to_pylist()
            assert meta == sample_keys(layout.tar(shard))
            assert len(np.load(layout.img_emb(shard))) == len(np.load(layout.text_emb(shard))) == n_img[shard] - 1
            reordered = np.load(layout.reordered_img(shard))
            for k in gone:
                assert not reordered[index_of_key(k, 1)].any()
            assert not set(sample_keys(layout.diffusion_tar(shard))) & gone
            rows = {r["key"]: r for r in pq.read_table(layout.shard_parquet(shard)).to_pylist()}
            for k in gone:
                assert rows[k]["status"] == "failed_to_download" and rows[k]["error_message"] == REMOVED
                assert rows[k]["caption"] is None and rows[k]["url"] == victims[k]["url"]
            stats = json.loads(Path(layout.shard_stats(shard)).read_text())
            assert stats["successes"] == len(sample_keys(layout.tar(shard))) and stats["removed_by_takedown"] == 1
        for i in range(len(load_state(layout)["tars"])):
            assert not set(sample_keys(layout.balanced_tar(i))) & set(victims)
            if Path(layout.precached_tar(i)).exists():  # complete balanced tars only
                assert not set(sample_keys(layout.precached_tar(i))) & set(victims)
        # dedup: the samples left its index in place (it did not start over)
        state = json.loads(Path(layout.dedup_state).read_text())
        assert state.get("generation", 0) == generation and per_artifact["duplicates"] >= 1
        for shard in kept:
            assert not set(pq.read_table(layout.dedup_shard(shard)).column("key").to_pylist()) & set(victims)
        assert verify_dataset(config, instance).ok
        _loaders_read_the_rest(layout, set(victims))

        # audited: when, which list, which keys, why
        [audit] = audit_records(layout)
        assert sorted(r["key"] for r in audit["removed"]) == sorted(victims)
        assert audit["lists"][0]["version"] == report.lists[0]["version"] and audit["applied_at"] <= time.time()
        cfg = load_config(config)
        assert check_takedowns(Target(layout, cfg)).ok
        # the report and the takedowns asset show it per list version
        page = Path(layout.report_html).read_text()
        assert 'id="takedowns"' in page and report.lists[0]["version"] in page
        event = instance.get_latest_materialization_event(dg.AssetKey("takedowns"))
        assert event.asset_materialization.metadata["removed_total"].value == 3
        # each changed shard partition shows the takedown (a materialization at its version: nothing to redo)
        [shown] = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("clip_embeddings"), asset_partitions=["00001"]), limit=1).records
        assert "1 sample(s) of shard 00001 removed" in shown.asset_materialization.metadata["takedown"].value

        # a second application of the same list changes nothing; a re-run downloads nothing and adds nothing back
        again, _ = takedown(config, [str(lst)], instance=instance, in_process=True)
        assert again.shards == [] and len(audit_records(layout)) == 1
        before = _files(layout.root)
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        for shard in kept:
            assert not set(sample_keys(layout.tar(shard))) & set(victims)
        assert {p for p, d in _files(layout.root).items() if p.suffix == ".tar" and before.get(p) != d} == set()

        # a new source file repeating a listed URL: its row is recorded as removed, never requested (a request
        # would have succeeded: the image is there)
        rows = pq.read_table(next(src.glob("*.parquet"))).to_pydict()
        new = {c: v[:5] for c, v in rows.items()}
        new["url"][3] = by_url["url"]
        pq.write_table(pa.table(new), src / "appended.parquet")
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        [new_shard] = [s for s in ("00003",) if Path(layout.shard_parquet(s)).exists()]
        row = pq.read_table(layout.shard_parquet(new_shard)).to_pylist()[3]
        assert (row["status"], row["error_message"], row["caption"]) == ("failed_to_download", REMOVED, None)
        for file, data in _files(layout.root).items():
            assert images[by_url["key"]]["jpg"] not in data, file


def _loaders_read_the_rest(layout: Layout, gone: set[str]) -> None:
    """webdataset reads every image tar to its end, and megatron-energon's own loader every sample left."""
    import webdataset as wds

    for tar in sorted(Path(layout.images_dir).glob("*.tar")):
        keys = [s["__key__"] for s in wds.WebDataset(str(tar), shardshuffle=False)]
        assert keys and not set(keys) & gone
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    ds = get_train_dataset(layout.images_dir, split_part="train", batch_size=1, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, repeat=False,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    seen = {k.split("/")[-1] for batch in get_loader(ds) for k in batch.__key__}
    assert seen and not seen & gone


def test_the_cli_names_a_bad_list_and_changes_nothing(tmp_path, monkeypatch, capsys):
    from shardprep_dagster.orchestration.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    config = write_config(tmp_path / "c.yaml", source=str(tmp_path / "none.parquet"), output_root=str(tmp_path / "out"))
    bad = tmp_path / "bad.txt"
    bad.write_text("https://ok.example/a.jpg\nsha256:1234\n")
    assert main(["takedown", "--config", str(config), "--list", str(bad)]) == 2
    assert "bad.txt, line 2: sha256 '1234' is not 64 hex digits" in capsys.readouterr().err
    assert registered(Layout(str(tmp_path / "out"))) == []  # nothing registered from a list with a bad line
    good = tmp_path / "good.txt"
    good.write_text("https://ok.example/a.jpg\n")
    assert main(["takedown", "--config", str(config), "--list", str(good)]) == 0
    out = capsys.readouterr().out
    assert "0 sample(s) removed from 0 shard(s)" in out and "(1 entries, new)" in out
    assert len(registered(Layout(str(tmp_path / "out")))) == 1


@pytest.fixture(scope="module")
def video_site(tmp_path_factory):
    from tests.fixtures import videos
    from tests.fixtures.http_server import serve_directory

    d = tmp_path_factory.mktemp("video-site")
    videos.make_video_site(str(d))
    base_url, stop = serve_directory(str(d))
    yield base_url
    stop()


def test_video_clips_of_a_listed_row_are_removed_and_never_downloaded_again(video_site, tmp_path):
    from shardprep.config import config_from_dict
    from shardprep.takedown.apply import find_matches, takedown_shard
    from shardprep.takedown.lists import Entry, list_version
    from shardprep.takedown.lists import RegisteredList as Listed
    from shardprep.video.shards import write_video_shard

    names = {"h264.mp4": [[0.0, 2.0]], "vp9_opus.webm": [[0.0, 1.0], [1.0, 2.0]]}
    table = pa.table({"name": list(names), "contentUrl": [f"{video_site}/{n}" for n in names],
                      "clips": list(names.values())})
    cfg = config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"),
                            "video_url_col": "contentUrl", "video_caption_col": "name", "video_clip_col": "clips",
                            "samples_per_shard": 100, "allow_private_addresses": True, "timeout": 5})
    layout = Layout(cfg.output_root)
    assert write_video_shard(table, 0, cfg, layout.videos_dir).successes == 2
    clips = sample_keys(layout.video_tar("00000"))
    assert len(clips) == 3
    victim = [f"{video_site}/vp9_opus.webm"]
    entries = [Entry("url", victim[0])]
    listed = TakedownSet.of([Listed(list_version(entries), "t", 0.0, entries)])
    removed = find_matches(layout, "00000", "video", listed)
    assert [r["key"] for r in removed] == ["0000001_00000", "0000001_00001"]  # both clips of the row
    gone_bytes = read_samples_by_key(layout.video_tar("00000"), {"0000001_00000"})["0000001_00000"]["mp4"]
    done = takedown_shard(layout, "00000", "video", removed)
    assert done.artifacts["video_shards"] == 2
    assert sample_keys(layout.video_tar("00000")) == ["0000000_00000"]
    assert gone_bytes not in Path(layout.video_tar("00000")).read_bytes()
    rows = {r["key"]: r for r in pq.read_table(layout.video_parquet("00000")).to_pylist()}
    assert {k: rows[k]["error_message"] for k in ("0000001_00000", "0000001_00001")} == {
        "0000001_00000": REMOVED, "0000001_00001": REMOVED}
    assert find_matches(layout, "00000", "video", listed) == []  # applied: nothing left to match

    # the shard made again with the list in force: the listed row is removed before any request
    out = str(tmp_path / "again")
    report = write_video_shard(table, 0, cfg, out, takedowns=listed)
    assert report.successes == 1
    again = pq.read_table(f"{out}/00000.parquet").to_pylist()
    assert [(r["key"], r["status"], r["error_message"]) for r in again if r["key"].startswith("0000001")] == [
        ("0000001", "failed_to_download", REMOVED)]


def test_configured_lists_keep_rows_out_of_a_first_download_and_are_read_again_only_when_changed(
        tmp_path, scripted_server, monkeypatch):
    from shardprep.config import config_from_dict
    from shardprep.images.shards import write_image_shard
    from shardprep.takedown import lists
    from tests.fixtures.scripted_http import Reply

    buf = io.BytesIO()
    synthetic.render_image(2, 32, 24).save(buf, "JPEG")
    for p in ("/a.jpg", "/b.jpg", "/c.jpg"):
        scripted_server.script(p, Reply(200, buf.getvalue()))
    listed = tmp_path / "optout.txt"
    listed.write_text(scripted_server.url("/b.jpg") + "\n")
    cfg = config_from_dict({"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url",
                            "caption_col": None, "image_size": 16, "allow_private_addresses": True,
                            "respect_robots_txt": False, "extract_exif": False, "takedown_lists": [str(listed)],
                            "per_host_state_dir": str(tmp_path / "limits")})
    reads = []
    monkeypatch.setattr(lists, "read_list", lambda url, real=lists.read_list: reads.append(url) or real(url))
    layout = Layout(cfg.output_root)
    urls = pa.table({"url": [scripted_server.url(p) for p in ("/a.jpg", "/b.jpg", "/c.jpg")]})
    write_image_shard(urls, 0, cfg, layout)
    rows = pq.read_table(layout.shard_parquet("00000")).to_pylist()
    assert [(r["status"], r["error_message"]) for r in rows] == [
        ("success", None), ("failed_to_download", REMOVED), ("success", None)]
    assert scripted_server.hits("/b.jpg") == 0 and len(registered(layout)) == 1
    write_image_shard(urls, 1, cfg, layout)
    assert len(reads) == 1  # the same file: registered once, not read for every shard
    time.sleep(0.01)
    listed.write_text(scripted_server.url("/c.jpg") + "\n")
    write_image_shard(urls, 2, cfg, layout)
    assert len(reads) == 2 and len(registered(layout)) == 2
    rows = pq.read_table(layout.shard_parquet("00002")).to_pylist()
    assert [r["status"] for r in rows] == ["success", "failed_to_download", "failed_to_download"]
