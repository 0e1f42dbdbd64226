"""Image shards against the real img2dataset and webdataset, on a real HTTP server on 127.0.0.1.

img2dataset is the oracle: the same URL parquet goes through ``img2dataset.download`` and through
``write_image_shard``; names, json, parquet schema, statuses, stats and pixels must agree.
"""

import inspect
import io
import json
import os
import re
import socket
import tarfile
from collections import OrderedDict

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations would look for updates online
os.environ.setdefault("WANDB_MODE", "disabled")

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shardprep import keys
from shardprep.config import config_from_dict
from shardprep.fetch import fetch, make_pool
from shardprep.images.resize import BOMB_ERROR, jpeg_is_truncated, resize_image
from shardprep.images.shards import write_image_shard
from shardprep.layout import Layout
from tests.fixtures import synthetic
from tests.fixtures.http_server import serve_directory

# img2dataset's own deprecation noise (albumentations "value", fire "pipes", "imghdr")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydantic.*",
                                        "ignore::DeprecationWarning:fire.*", "ignore::DeprecationWarning:img2dataset.*")

N_IMAGES = 24
# some sides below image_size (64) so the upscale path (lanczos) runs too
SIZES = ((96, 64), (64, 64), (160, 120), (50, 75), (120, 40), (30, 30))
ADDITIONAL = ["source_id"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("i2d-site")
    synthetic.make_demo_site(str(d), n_images=N_IMAGES, seed=3, sizes=SIZES)
    base_url, stop = serve_directory(str(d), slow_seconds=10)
    yield str(d), base_url
    stop()


def _cfg(tmp_path, **kw):
    fields = {"source": str(tmp_path / "src"), "output_root": str(tmp_path / "out"), "url_col": "url",
              "caption_col": "caption", "save_additional_columns": ADDITIONAL, "samples_per_shard": 16,
              "image_size": 64, "resize_mode": "border", "encode_format": "jpg", "encode_quality": 95,
              "timeout": 5, "retries": 0, "thread_count": 4, "allow_private_addresses": True}
    fields.update(kw)
    return config_from_dict(fields)


def _members(tar_path):
    """[(name, bytes, TarInfo)] in archive order."""
    with tarfile.open(tar_path) as tf:
        return [(m.name, tf.extractfile(m).read(), m) for m in tf.getmembers()]


def _samples(tar_path):
    """key -> OrderedDict(ext -> bytes), in archive order."""
    out = OrderedDict()
    for name, data, _ in _members(tar_path):
        key, ext = name.split(".", 1)
        out.setdefault(key, OrderedDict())[ext] = data
    return out


def _assert_close(ours, theirs, key):
    """Our fast_decode pixels against img2dataset's: same shape, within ~a grey level. Ours downscale with
    an antialiased bilinear filter (img2dataset: OpenCV's area resize), after a DCT-reduced decode for
    large JPEGs; on these noisy synthetic images taken down to 64-256 px and re-encoded at quality 80-95,
    that is 0.1-2.6 grey levels on average (the most at 64 px: the two filters average the noise
    differently), PSNR 36.6 dB and up; a crop or pad one pixel off gives 6-10 grey levels."""
    assert ours.shape == theirs.shape, key
    mse = ((ours - theirs) ** 2).mean()
    assert np.abs(ours - theirs).mean() <= 3.0 and (mse == 0 or 10 * np.log10(255 ** 2 / mse) > 35), key


def _decode(data):
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED).astype(np.float64)


def _read_back_with_webdataset(tar_path):
    import webdataset as wds

    return list(wds.WebDataset(str(tar_path), shardshuffle=False))


def _assert_readable_by_webdataset(tar_path, expected_keys, exts):
    """The real webdataset reader sees every sample, with exactly the members we wrote."""
    samples = _read_back_with_webdataset(tar_path)
    assert [s["__key__"] for s in samples] == sorted(expected_keys)
    for s in samples:
        assert {k for k in s if not k.startswith("__")} == set(exts)
        assert json.loads(s["json"])["key"] == s["__key__"]


def _json(data):
    return json.loads(data, object_pairs_hook=OrderedDict)


# ---------------------------------------------------------------------------------------------
# the real img2dataset.download, end to end (spawned worker, reader, writer), three shards


def test_shards_match_real_img2dataset(site, tmp_path):
    import img2dataset

    _, base_url = site
    src = synthetic.make_source_parquets(str(tmp_path / "src"), base_url, 1, 40, n_images=N_IMAGES,
                                         broken_share=0.3, broken_kinds=("missing", "not_image", "truncated", "bomb"),
                                         seed=5)[0]
    i2d_dir = tmp_path / "i2d"
    img2dataset.download(url_list=src, input_format="parquet", url_col="url", caption_col="caption",
                         output_format="webdataset", output_folder=str(i2d_dir), number_sample_per_shard=16,
                         processes_count=1, thread_count=4, image_size=64, resize_mode="border",
                         save_additional_columns=ADDITIONAL, timeout=5)
    cfg = _cfg(tmp_path)
    layout = Layout(cfg.output_root)
    table = pq.read_table(src)
    reports = [write_image_shard(table.slice(16 * s, 16), s, cfg, layout) for s in range(3)]
    assert [r.count for r in reports] == [16, 16, 8]

    truncated_urls = {u for u in table["url"].to_pylist() if u.endswith(synthetic.TRUNCATED)}
    bomb_urls = {u for u in table["url"].to_pylist() if u.endswith(synthetic.BOMB)}
    all_statuses = set()
    for report in reports:
        shard = report.shard
        # --- parquet: same schema, same status per key
        ours_pq = pq.read_table(layout.shard_parquet(shard))
        theirs_pq = pq.read_table(i2d_dir / f"{shard}.parquet")
        assert ours_pq.schema.names == theirs_pq.schema.names
        assert [f.type for f in ours_pq.schema] == [f.type for f in theirs_pq.schema]
        ours_rows = ours_pq.to_pylist()
        theirs_rows = sorted(theirs_pq.to_pylist(), key=lambda r: r["key"])  # theirs: completion order
        assert [r["key"] for r in ours_rows] == [r["key"] for r in theirs_rows]
        for o, t in zip(ours_rows, theirs_rows):
            all_statuses.add((o["status"], o["error_message"]))
            for col in ("source_id", "caption", "url", "status", "width", "height",
                        "original_width", "original_height", "sha256"):
                assert o[col] == t[col], (o["key"], col)
            if o["url"] in truncated_urls:  # ours says why (theirs: plain "Image decoding error")
                assert o["error_message"].startswith(t["error_message"]) and "truncated" in o["error_message"]
            elif o["url"] in bomb_urls:  # refused from the header (theirs: OpenCV's pixel-limit assertion)
                assert o["error_message"] == BOMB_ERROR and "CV_IO_MAX_IMAGE_PIXELS" in t["error_message"]
            else:
                assert o["error_message"] == t["error_message"], o["key"]

        # --- stats: same fields, same counts
        ours_stats = json.loads(open(layout.shard_stats(shard)).read())
        theirs_stats = json.loads((i2d_dir / f"{shard}_stats.json").read_text())
        assert list(ours_stats) == list(theirs_stats)
        for k in ("count", "successes", "failed_to_download", "failed_to_resize"):
            assert ours_stats[k] == theirs_stats[k] == getattr(report, k)
        assert sum(ours_stats["status_dict"].values()) == ours_stats["count"]
        assert ours_stats["status_dict"] == report.status_dict

        # --- tar: same member names, same per-sample order, same header conventions
        ours_tar, theirs_tar = layout.tar(shard), i2d_dir / f"{shard}.tar"
        ours_m, theirs_m = _members(ours_tar), _members(theirs_tar)
        assert {n for n, _, _ in ours_m} == {n for n, _, _ in theirs_m}
        ours_s, theirs_s = _samples(ours_tar), _samples(theirs_tar)
        assert list(ours_s) == sorted(ours_s)  # ours: key order
        for key, members in ours_s.items():
            assert list(members) == list(theirs_s[key]) == sorted(members) == ["jpg", "json", "txt"]
            assert members["txt"] == theirs_s[key]["txt"]
            oj, tj = _json(members["json"]), _json(theirs_s[key]["json"])
            assert list(oj) == list(tj)  # key order
            oj.pop("exif"), tj.pop("exif")
            assert oj == tj
            _assert_close(_decode(members["jpg"]), _decode(theirs_s[key]["jpg"]), key)
        for (_, _, om), (_, _, tm) in zip(ours_m, theirs_m):
            assert (om.uname, om.gname, om.mode, om.type) == (tm.uname, tm.gname, tm.mode, tm.type)
        for path in (ours_tar, theirs_tar):
            with open(path, "rb") as f:
                assert f.read(512)[257:265] == b"ustar\x0000"  # USTAR, as webdataset's TarWriter
        assert report.tar_written and report.tar_bytes == os.path.getsize(ours_tar)
        _assert_readable_by_webdataset(ours_tar, list(ours_s), {"jpg", "json", "txt"})

    # the comparison covered every kind of outcome
    assert {s for s, _ in all_statuses} == {"success", "failed_to_download", "failed_to_resize"}
    messages = {m for _, m in all_statuses}
    assert {"HTTP Error 404: File not found", "Image decoding error", BOMB_ERROR} <= messages
    assert any(m and "truncated" in m for m in messages)


# ---------------------------------------------------------------------------------------------
# pixels for every resize mode: img2dataset's own shard downloader, run in this process


def _run_img2dataset_shard(table, shard_id, out_dir, mode, fmt, quality):
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer
    from img2dataset.writer import WebDatasetSampleWriter

    columns = [*ADDITIONAL, "caption", "url"]
    feather = out_dir / "_tmp" / f"{shard_id}.feather"
    feather.parent.mkdir(parents=True)
    with pa.OSFile(str(feather), "wb") as f, pa.ipc.new_file(f, table.select(columns).schema) as w:
        w.write_table(table.select(columns))
    # thread_count=1: img2dataset redirects fds 1/2 while it decodes; one thread keeps that race-free
    Downloader(WebDatasetSampleWriter, Resizer(64, mode, False, encode_format=fmt, encode_quality=quality),
               thread_count=1, save_caption=True, extract_exif=True, output_folder=str(out_dir),
               column_list=columns, timeout=5, number_sample_per_shard=100, oom_shard_count=5,
               compute_hash="sha256", verify_hash_type=None, encode_format=fmt, retries=0,
               user_agent_token=None, disallowed_header_directives=["noai"]).download_shard((shard_id, str(feather)))


@pytest.mark.parametrize("mode,fmt,quality", [("no", "jpg", 95), ("border", "png", 3), ("keep_ratio", "jpg", 90),
                                              ("keep_ratio_largest", "webp", 80), ("center_crop", "jpg", 95)])
def test_pixels_match_img2dataset_for_each_resize_mode(site, tmp_path, mode, fmt, quality):
    _, base_url = site
    cols = synthetic.source_rows(base_url, N_IMAGES, n_images=N_IMAGES)
    table = pa.table({"url": cols["url"], "caption": cols["caption"], "source_id": cols["source_id"]})
    _run_img2dataset_shard(table, 2, tmp_path / "i2d", mode, fmt, quality)
    cfg = _cfg(tmp_path, samples_per_shard=100, resize_mode=mode, encode_format=fmt, encode_quality=quality)
    report = write_image_shard(table, 2, cfg, Layout(cfg.output_root))
    assert report.successes == N_IMAGES

    ours, theirs = _samples(Layout(cfg.output_root).tar("00002")), _samples(tmp_path / "i2d" / "00002.tar")
    assert list(ours) == sorted(theirs) and len(ours) == N_IMAGES
    shapes = set()
    for key, members in ours.items():
        assert list(members) == list(theirs[key]) == sorted([fmt, "json", "txt"])
        a, b = _decode(members[fmt]), _decode(theirs[key][fmt])
        _assert_close(a, b, key)
        oj, tj = _json(members["json"]), _json(theirs[key]["json"])
        assert (oj["width"], oj["height"]) == (tj["width"], tj["height"]) == (a.shape[1], a.shape[0])
        shapes.add(a.shape[:2])
    assert len(shapes) > 1 if mode in ("no", "keep_ratio", "keep_ratio_largest") else shapes == {(64, 64)}
    _assert_readable_by_webdataset(Layout(cfg.output_root).tar("00002"), list(ours), {fmt, "json", "txt"})


# ---------------------------------------------------------------------------------------------
# failures: recorded with a message, never raised, never hanging


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return port


@pytest.mark.timeout(60)
def test_bad_urls_and_images_are_recorded_failures(site, tmp_path):
    _, base_url = site
    urls = {
        "good": f"{base_url}/{synthetic.image_name(1)}",
        "missing": f"{base_url}/missing/nothing.jpg",
        "not_image": f"{base_url}/{synthetic.NOT_AN_IMAGE}",
        "truncated": f"{base_url}/{synthetic.TRUNCATED}",
        "bomb": f"{base_url}/{synthetic.BOMB}",
        "slow": f"{base_url}/slow/{synthetic.image_name(2)}",
        "closed_port": f"http://127.0.0.1:{_closed_port()}/x.jpg",
        "no_url": None,
    }
    table = pa.table({"url": pa.array(list(urls.values()), pa.string()), "caption": [f"c {k}" for k in urls],
                      "source_id": list(range(len(urls)))})
    cfg = _cfg(tmp_path, timeout=1)
    layout = Layout(cfg.output_root)
    report = write_image_shard(table, 0, cfg, layout)
    rows = {k: r for k, r in zip(urls, pq.read_table(layout.shard_parquet("00000")).to_pylist())}
    expected = {
        "good": ("success", None),
        "missing": ("failed_to_download", "HTTP Error 404: File not found"),
        "not_image": ("failed_to_resize", "Image decoding error"),
        "bomb": ("failed_to_resize", BOMB_ERROR),
        "slow": ("failed_to_download", "timed out"),
    }
    for k, (status, message) in expected.items():
        assert (rows[k]["status"], rows[k]["error_message"]) == (status, message), k
    assert rows["truncated"]["status"] == "failed_to_resize" and "truncated" in rows["truncated"]["error_message"]
    assert rows["no_url"]["status"] == "failed_to_download" and "invalid url" in rows["no_url"]["error_message"]
    assert rows["closed_port"]["status"] == "failed_to_download"
    assert rows["closed_port"]["error_message"].startswith("<urlopen error [Errno")  # urllib's wording
    assert "Connection refused" in rows["closed_port"]["error_message"]
    assert (report.successes, report.failed_to_download, report.failed_to_resize) == (1, 4, 3)
    assert report.status_dict["timed out"] == 1
    assert list(_samples(layout.tar("00000"))) == [rows["good"]["key"]]
    _assert_readable_by_webdataset(layout.tar("00000"), [rows["good"]["key"]], {"jpg", "json", "txt"})


def test_without_caption_column_there_is_no_txt(site, tmp_path):
    _, base_url = site
    table = pa.table({"link": [f"{base_url}/{synthetic.image_name(i)}" for i in range(3)]})
    cfg = _cfg(tmp_path, url_col="link", caption_col=None, save_additional_columns=[], samples_per_shard=10)
    report = write_image_shard(table, 12, cfg, Layout(cfg.output_root))
    assert report.shard == "00012" and report.successes == 3
    samples = _samples(Layout(cfg.output_root).tar("00012"))
    assert list(samples) == ["000120", "000121", "000122"]  # 10 samples per shard: 1 index digit
    assert all(list(m) == ["jpg", "json"] for m in samples.values())
    assert list(_json(samples["000121"]["json"]))[:3] == ["url", "key", "status"]
    assert pq.read_table(Layout(cfg.output_root).shard_parquet("00012")).schema.names[:2] == ["url", "key"]
    _assert_readable_by_webdataset(Layout(cfg.output_root).tar("00012"), list(samples), {"jpg", "json"})


@pytest.mark.timeout(60)
def test_guard_refuses_private_and_non_http_urls_and_writes_no_tar(site, tmp_path):
    _, base_url = site
    port = base_url.rsplit(":", 1)[1]
    urls = ["http://169.254.169.254/latest/meta-data", "file:///etc/passwd",
            f"{base_url}/{synthetic.image_name(0)}", f"http://localhost:{port}/{synthetic.image_name(0)}",
            "http://[::1]/x.jpg", "http://10.1.2.3/x.jpg", "ftp://example.com/x.jpg"]
    table = pa.table({"url": urls, "caption": ["c"] * len(urls), "source_id": list(range(len(urls)))})
    layout = Layout(str(tmp_path / "out"))

    # an earlier run of shard 4 had successes (only the loopback server, allowed there) ...
    first = write_image_shard(table.slice(2, 1), 4, _cfg(tmp_path, allow_private_addresses=True), layout)
    assert first.tar_written and os.path.exists(layout.tar("00004"))

    # ... the guarded rerun refuses everything: parquet and stats, and no tar (the old one is gone)
    report = write_image_shard(table, 4, _cfg(tmp_path, allow_private_addresses=False), layout)
    assert (report.count, report.successes, report.failed_to_download) == (len(urls), 0, len(urls))
    assert not report.tar_written and report.tar_bytes == 0
    assert not os.path.exists(layout.tar("00004"))
    rows = pq.read_table(layout.shard_parquet("00004")).to_pylist()
    assert [r["status"] for r in rows] == ["failed_to_download"] * len(urls)
    messages = [r["error_message"] for r in rows]
    assert "link-local" in messages[0] and "unsupported URL scheme 'file'" in messages[1]
    assert all("loopback" in m for m in messages[2:5]) and "private" in messages[5] and "'ftp'" in messages[6]
    assert all(m.startswith("refused") for m in messages)
    stats = json.loads(open(layout.shard_stats("00004")).read())
    assert (stats["count"], stats["successes"], stats["failed_to_download"]) == (len(urls), 0, len(urls))


def test_guard_sends_nothing_to_refused_addresses():
    pool = make_pool(2)
    got = fetch("http://169.254.169.254/latest/meta-data", pool=pool, timeout=1)
    assert got.data is None and "link-local" in got.error
    assert pool.connections_made == 0  # no connection was even created for the address

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    try:
        got = fetch(f"http://127.0.0.1:{listener.getsockname()[1]}/x.jpg", pool=pool, timeout=1)
        assert "loopback" in got.error
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_fetch_redirects_limits_and_headers(site):
    site_dir, base_url = site
    port = base_url.rsplit(":", 1)[1]
    pool = make_pool(2)
    image = open(os.path.join(site_dir, synthetic.image_name(0)), "rb").read()
    from urllib.parse import quote

    def redirect_to(target):
        return f"{base_url}/redirect?to={quote(target, safe='')}"

    ok = fetch(redirect_to(f"/{synthetic.image_name(0)}"), pool=pool, timeout=2, allow_private=True)
    assert ok == (image, None)
    # every hop is checked: 127.0.0.1 is trusted here, the hop to "localhost" is not
    hop = fetch(redirect_to(f"http://localhost:{port}/{synthetic.image_name(0)}"), pool=pool, timeout=2,
                trusted_hosts=("127.0.0.1",))
    assert hop.data is None and "loopback" in hop.error
    assert fetch(redirect_to("file:///etc/passwd"), pool=pool, timeout=2, allow_private=True).error.startswith(
        "refused: unsupported URL scheme 'file'")
    assert "too many redirects" in fetch(f"{base_url}/loop/0", pool=pool, timeout=2, allow_private=True).error
    assert fetch(f"{base_url}/noai/{synthetic.image_name(0)}", pool=pool, timeout=2, allow_private=True).error == \
        "Use of image disallowed by X-Robots-Tag directive"
    big = fetch(f"{base_url}/{synthetic.image_name(0)}", pool=pool, timeout=2, allow_private=True, max_bytes=100)
    assert big.data is None and "too large" in big.error
    # a body dripped slower than the total deadline is cut off, though no single read times out
    drip = fetch(f"{base_url}/drip/{synthetic.image_name(0)}", pool=pool, timeout=2, allow_private=True,
                 total_timeout=1.0)
    assert drip == (None, "timed out")
    # successes keep their connection alive for the next download from the same host
    fresh = make_pool(2)
    for _ in range(3):
        assert fetch(f"{base_url}/{synthetic.image_name(0)}", pool=fresh, timeout=2, allow_private=True).data == image
    assert fresh.connections_made == 1 and fresh.idle_connections() == 1


# ---------------------------------------------------------------------------------------------
# resizer and keys against img2dataset's own functions


def test_resize_is_byte_identical_to_img2dataset_resizer():
    from img2dataset.resizer import Resizer

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (37, 91, 3), dtype=np.uint8), rng.integers(0, 256, (120, 45), dtype=np.uint8),
              rng.integers(0, 256, (64, 80, 4), dtype=np.uint8)]  # colour, grey, colour + alpha
    for arr in arrays:
        data = cv2.imencode(".png", arr)[1].tobytes()
        for mode in ("no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"):
            for only_bigger in (False, True):
                theirs = Resizer(64, mode, only_bigger)(io.BytesIO(data))
                ours = resize_image(data, image_size=64, resize_mode=mode, resize_only_if_bigger=only_bigger)
                assert tuple(ours) == tuple(theirs), (arr.shape, mode, only_bigger)


def test_bombs_and_truncated_jpegs_are_refused_before_decoding(tmp_path):
    buf = io.BytesIO()
    synthetic.render_image(0, 100, 100).save(buf, "JPEG")
    whole = buf.getvalue()
    assert not jpeg_is_truncated(whole)
    assert jpeg_is_truncated(whole[:-2]) and jpeg_is_truncated(whole[: len(whole) // 2])
    assert resize_image(whole[: len(whole) // 2]).error.startswith("Image decoding error")
    # header says 100x100: refused above max_image_pixels, fine at the limit
    assert resize_image(whole, max_image_pixels=9_999).error == BOMB_ERROR
    assert resize_image(whole, max_image_pixels=10_000).error is None
    assert resize_image(synthetic.bomb_png()).error == BOMB_ERROR
    with Image.open(io.BytesIO(synthetic.bomb_png(300, 200))) as im:
        assert im.size == (300, 200)


@settings(max_examples=300, deadline=None)
@given(spp=st.sampled_from([1, 10, 1000, 5000, 10000, 10001]), oom_shard_count=st.sampled_from([1, 5]),
       shard_id=st.integers(0, 10**6), data=st.data())
def test_compute_key_matches_img2dataset(spp, oom_shard_count, shard_id, data):
    from img2dataset.downloader import compute_key

    index = data.draw(st.integers(0, spp - 1))
    oom = keys.oom_sample_per_shard(spp)
    assert keys.compute_key(index, shard_id, oom, oom_shard_count) == compute_key(index, shard_id, oom, oom_shard_count)


@settings(max_examples=300, deadline=None)
@given(name=st.one_of(
    st.text(alphabet="ab._/_0", max_size=12),
    st.builds("/".join, st.lists(st.sampled_from(["000123", "x.y", "__key__", "a", ".hidden", "img.jpg"]), max_size=4))))
def test_member_names_split_like_webdataset(name):
    """The key and field of a tar member, and which members are metadata, exactly as webdataset reads them."""
    from webdataset.tariterators import base_plus_ext, tar_file_iterator

    theirs = base_plus_ext(name)
    assert keys.split_member_name(name) == (None if theirs == (None, None) else theirs)
    skip_meta = inspect.signature(tar_file_iterator).parameters["skip_meta"].default
    assert keys.is_meta_member(name) == bool(re.match(skip_meta, name))
