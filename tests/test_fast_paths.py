"""The fast paths of the engines (issue 5), each against its exact path or the real upstream code.

* image resize: ``fast_decode`` (DCT-reduced JPEG decode, antialiased bilinear downscale: PIL's
  filter) keeps img2dataset's sizes and stays within a few grey levels; ``fast_decode=False`` stays
  byte-identical to img2dataset's own ``Resizer``, large JPEGs included; the alpha-compositing lookup
  table equals img2dataset's formula exactly;
* the shard engine with ``fast_decode``/``decode_threads``, against the exact engine, over HTTP;
* the direct tar parser against ``tarfile``, and webdataset's grouping in the decoder loader;
* CLIP: the preprocess spec read off all_clip's preprocess objects, the fast decode against the
  reference transforms (under a grey level on average; PIL's decoded pixels exactly), fast vs exact
  embeddings (cosine > 0.995 on small images, > 0.99 on large photo-like ones, each row nearest its
  own), the uint8 (GPU-style) batch path, text padding trimming.
"""

import io
import os
import random
import subprocess
import sys
import tarfile

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from shardprep.config import ConfigError, config_from_dict
from shardprep.embeddings import write_clip_embeddings
from shardprep.images import resize
from shardprep.images.shards import decode_slots, write_image_shard
from shardprep.layout import Layout
from shardprep.storage import open_read
from shardprep.tars import TarReadError, iter_members
from tests.fixtures import synthetic
from tests.fixtures.embedding_checks import assert_close_rows
from tests.fixtures.http_server import serve_directory

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _jpeg(w, h, seed=0, quality=90, mode="RGB"):
    img = synthetic.render_image(seed, w, h)
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _pixels(data):
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED).astype(np.float64)


def _psnr(a, b):
    mse = ((a - b) ** 2).mean()
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


@pytest.fixture(scope="module")
def big_jpegs():
    # sides from 2.5x to 8x the 256 px target: every DCT reduction (1/2, 1/4, 1/8) is used
    return [_jpeg(w, h, seed=i) for i, (w, h) in enumerate([(1300, 900), (700, 1100), (2100, 1400), (640, 641)])]


# ---------------------------------------------------------------------------------------------
# resize


def test_exact_path_is_byte_identical_to_img2dataset_on_large_jpegs(big_jpegs):
    from img2dataset.resizer import Resizer

    for data in big_jpegs + [_jpeg(900, 700, mode="L"), _jpeg(800, 600, mode="CMYK")]:
        for mode in ("border", "center_crop", "keep_ratio"):
            theirs = Resizer(256, mode, False)(io.BytesIO(data))
            ours = resize.resize_image(data, image_size=256, resize_mode=mode, fast_decode=False)
            assert tuple(ours) == tuple(theirs), mode


def test_fast_decode_keeps_sizes_and_stays_close(big_jpegs):
    reduced = 0
    for data in big_jpegs + [_jpeg(1800, 1200, mode="L", seed=9)]:
        for mode in ("border", "center_crop", "keep_ratio", "keep_ratio_largest"):
            exact = resize.resize_image(data, image_size=256, resize_mode=mode)
            fast = resize.resize_image(data, image_size=256, resize_mode=mode, fast_decode=True)
            assert fast[1:] == exact[1:], mode  # width, height, original size, no error
            a, b = _pixels(fast.data), _pixels(exact.data)
            assert a.shape == b.shape
            assert _psnr(a, b) > 38, mode
            assert np.abs(a - b).mean() < 1.0
            reduced += fast.data != exact.data
    assert reduced >= 10  # the reduced decode really ran (it changes some pixels)


def test_fast_decode_downscales_small_images_pngs_and_cmyk_antialiased():
    """Images fast_decode does not reduce still take its antialiased downscale: img2dataset's sizes,
    close to its area resize; upscales and resize_mode "no" are the exact path's, byte for byte."""
    small = _jpeg(400, 300)  # needs 2x the target per side to reduce: 400 < 2 x 256
    png = io.BytesIO()
    synthetic._with_alpha(synthetic.render_image(1, 1200, 900)).save(png, "PNG")
    cmyk = _jpeg(1600, 1200, mode="CMYK")
    grey = _jpeg(450, 330, mode="L")
    for data in (small, png.getvalue(), cmyk, grey):
        for mode in ("border", "center_crop", "keep_ratio", "keep_ratio_largest"):
            exact = resize.resize_image(data, image_size=256, resize_mode=mode)
            fast = resize.resize_image(data, image_size=256, resize_mode=mode, fast_decode=True)
            assert fast[1:] == exact[1:], mode  # width, height, original size, no error
            assert fast.data != exact.data, mode  # the antialiased filter really ran
            a, b = _pixels(fast.data), _pixels(exact.data)
            # 44-51 dB, 0.3-1.2 grey levels: the two filters differ most on the synthetic sensor noise
            assert a.shape == b.shape and _psnr(a, b) > 42 and np.abs(a - b).mean() < 1.5, mode
    # 16-bit PNGs (torch's kernel is uint8 only) keep OpenCV's area resize: the exact path's bytes
    for shape in ((500, 700), (500, 700, 3), (500, 700, 4)):
        deep = cv2.imencode(".png", np.random.default_rng(3).integers(0, 65536, shape).astype(np.uint16))[1].tobytes()
        exact = resize.resize_image(deep, image_size=256)
        assert exact.error is None and resize.resize_image(deep, image_size=256, fast_decode=True) == exact
    # upscaling and resize_mode "no" never take the fast path
    assert resize.resize_image(small, image_size=512, fast_decode=True) == resize.resize_image(small, image_size=512)
    big = _jpeg(1200, 900)
    assert resize.resize_image(big, resize_mode="no", fast_decode=True) == resize.resize_image(big, resize_mode="no")


@pytest.mark.parametrize("shape", [(300, 400, 3), (301, 517, 3), (333, 250), (260, 700, 1), (999, 257, 3)])
def test_antialiased_downscale_is_pils_bilinear_filter(shape):
    """The fast downscale is PIL's BILINEAR (antialiased) resize, within a grey level per pixel, in
    every layout the decoders give (colour, greyscale 2-D, one channel 3-D), and keeps the layout."""
    img = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    img = cv2.GaussianBlur(img, (0, 0), 1.5).reshape(shape)  # photo-like: neighbours correlate
    h, w = shape[:2]
    new_w, new_h = max(1, round(w * 120 / max(h, w))), max(1, round(h * 120 / max(h, w)))
    out = resize._antialiased(img, new_w, new_h)
    assert out.shape == (new_h, new_w) + shape[2:] and out.dtype == np.uint8 and out.flags.c_contiguous
    plane = img if img.ndim == 2 else img[:, :, 0] if shape[2] == 1 else img
    ref = np.asarray(Image.fromarray(plane).resize((new_w, new_h), Image.BILINEAR))
    assert np.abs(out.reshape(ref.shape).astype(int) - ref).max() <= 1


@pytest.mark.parametrize("shape", [(300, 400, 3), (333, 250), (260, 700, 1), (201, 303, 4), (40, 1000, 3)])
def test_antialiased_downscale_is_torchs_kernel_within_a_grey_level(shape):
    """The C downscale (``downscale.c``) is torch's ``interpolate(antialias=True)`` within a grey level (its
    passes run in the other order), in every channel count, from a view (a crop) as from a whole array,
    into C-contiguous HWC; the SIMD and scalar paths give the same bytes, narrow rows (under one SIMD
    block) and row ends (an overlapping last block) included."""
    torch = pytest.importorskip("torch")
    img = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    for src, (new_h, new_w) in ((img, (97, 61)), (img[7:250, 11:240], (97, 61)), (img, (5, 9)), (img, (31, 33))):
        planes = src[:, :, np.newaxis] if src.ndim == 2 else src
        tensor = torch.from_numpy(np.ascontiguousarray(planes)).permute(2, 0, 1).unsqueeze(0)
        ref = torch.nn.functional.interpolate(tensor, size=(new_h, new_w), mode="bilinear", antialias=True,
                                              align_corners=False)[0].permute(1, 2, 0).numpy()
        out = resize._antialiased(src, new_w, new_h)
        assert out.flags.c_contiguous and out.shape == (new_h, new_w) + src.shape[2:]
        assert np.abs(out.reshape(ref.shape).astype(int) - ref).max() <= 1
        scalar = np.empty_like(out)
        whole = np.ascontiguousarray(src)
        resize._downscale.downscale(whole, whole.shape[0], whole.shape[1], planes.shape[2], scalar, new_h, new_w, False)
        assert np.array_equal(scalar, out)


def test_antialiased_downscale_refuses_buffers_of_another_size():
    img = np.zeros((20, 30, 3), np.uint8)
    with pytest.raises(ValueError, match="20x30x3 to 10x15"):
        resize._downscale.downscale(img, 20, 30, 3, np.empty((10, 14, 3), np.uint8), 10, 15)
    with pytest.raises(ValueError, match="21x30x3"):
        resize._downscale.downscale(img, 21, 30, 3, np.empty((10, 15, 3), np.uint8), 10, 15)


def test_fast_decode_never_imports_torch(tmp_path):
    """A download process resizes without loading torch (its import alone costs ~2 CPU-seconds)."""
    (tmp_path / "big.jpg").write_bytes(_jpeg(1200, 900))
    code = ("import sys; from shardprep.images import resize; "
            f"r = resize.resize_image(open({str(tmp_path / 'big.jpg')!r}, 'rb').read(), fast_decode=True); "
            "assert r.error is None and (r.width, r.height) == (256, 256), r; "
            "assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_fast_decode_keeps_failures():
    whole = _jpeg(1200, 900)
    assert resize.resize_image(whole[:-2000], fast_decode=True).error == resize.TRUNCATED_ERROR
    assert resize.resize_image(whole, max_image_pixels=1000, fast_decode=True).error == resize.BOMB_ERROR
    assert resize.resize_image(b"not an image", fast_decode=True).error == resize.DECODE_ERROR


def test_composite_lookup_equals_img2dataset_formula():
    alpha, value = np.meshgrid(np.arange(256), np.arange(256))
    img = np.stack([value, 255 - value, value, alpha], -1).astype(np.uint8)
    a = img[:, :, 3, np.newaxis]
    reference = np.rint((a / 255 * img[..., :3] + 255 - a).clip(0, 255)).astype(np.uint8)
    assert np.array_equal(resize._composite_on_white(img), reference)


# ---------------------------------------------------------------------------------------------
# shard engine


@pytest.fixture(scope="module")
def big_site(tmp_path_factory, big_jpegs):
    d = tmp_path_factory.mktemp("big-site")
    (d / "images").mkdir()
    for i, data in enumerate(big_jpegs):
        (d / "images" / f"{i}.jpg").write_bytes(data)
    base_url, stop = serve_directory(str(d))
    yield base_url, len(big_jpegs)
    stop()


def test_engine_fast_and_exact_agree(big_site, tmp_path):
    base_url, n = big_site
    urls = [f"{base_url}/images/{i % n}.jpg" for i in range(10)] + [f"{base_url}/missing.jpg"]
    table = pa.table({"url": urls, "caption": [f"c{i}" for i in range(len(urls))]})
    base = {"source": "x", "samples_per_shard": 20, "image_size": 128, "thread_count": 4,
            "allow_private_addresses": True}
    exact = Layout(str(tmp_path / "exact"))
    fast = Layout(str(tmp_path / "fast"))
    r1 = write_image_shard(table, 0, config_from_dict({**base, "output_root": exact.root, "fast_decode": False}), exact)
    r2 = write_image_shard(table, 0, config_from_dict({**base, "output_root": fast.root, "decode_threads": 1}), fast)
    assert (r1.successes, r1.failed_to_download) == (r2.successes, r2.failed_to_download) == (10, 1)
    p1, p2 = pq.read_table(exact.shard_parquet("00000")), pq.read_table(fast.shard_parquet("00000"))
    for col in ("key", "status", "error_message", "width", "height", "original_width", "original_height", "sha256"):
        assert p1[col].to_pylist() == p2[col].to_pylist(), col
    s1 = list(wds.WebDataset(exact.tar("00000"), shardshuffle=False))
    s2 = list(wds.WebDataset(fast.tar("00000"), shardshuffle=False))
    assert [s["__key__"] for s in s1] == [s["__key__"] for s in s2]
    for a, b in zip(s1, s2):
        assert np.abs(_pixels(a["jpg"]) - _pixels(b["jpg"])).mean() < 1.0


def test_images_are_decoded_on_the_shards_decode_threads_at_most_decode_threads_at_once(big_site, tmp_path, monkeypatch):
    """Download threads hand their bytes to the shard's decode threads (``decode_threads`` of them): no
    download thread decodes, and never more images are decoded at once than there are decode threads."""
    import threading
    import time

    from shardprep.images import shards

    base_url, n = big_site
    seen: list[tuple[str, int]] = []
    lock, busy = threading.Lock(), [0]
    real = shards.resize_image

    def watched(data, **kw):
        with lock:
            busy[0] += 1
            seen.append((threading.current_thread().name, busy[0]))
        try:
            time.sleep(0.01)  # long enough for a third to start if nothing bounded them
            return real(data, **kw)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(shards, "resize_image", watched)
    urls = [f"{base_url}/images/{i % n}.jpg" for i in range(24)]
    layout = Layout(str(tmp_path / "out"))
    cfg = config_from_dict({"source": "x", "output_root": layout.root, "samples_per_shard": 30, "image_size": 64,
                            "thread_count": 8, "decode_threads": 2, "allow_private_addresses": True})
    report = write_image_shard(pa.table({"url": urls, "caption": ["c"] * len(urls)}), 0, cfg, layout)
    assert report.successes == 24 and len(seen) == 24
    assert {name.rsplit("_", 1)[0] for name, _ in seen} == {"shardprep-decode"}
    assert max(b for _, b in seen) == 2  # both threads at work, never a third
    assert not [t for t in threading.enumerate() if t.name.startswith("shardprep-decode")]  # none outlives the shard


def test_decode_config_fields():
    base = {"source": "x", "output_root": "y"}
    assert config_from_dict(base).fast_decode is True
    assert decode_slots(config_from_dict({**base, "decode_threads": 3})) == 3
    assert decode_slots(config_from_dict(base)) == len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="'decode_threads'"):
        config_from_dict({**base, "decode_threads": -1})
    with pytest.raises(ConfigError, match="'fast_decode'"):
        config_from_dict({**base, "fast_decode": "yes"})


# ---------------------------------------------------------------------------------------------
# tar parsing


def iter_tar_members(url):
    with open_read(url) as f:
        yield from iter_members(f, url)


def _make_tar(path, fmt, gz=False):
    rng = random.Random(3)
    names = ["a.jpg", "a.txt", "d/b.json", "ü/ñame.txt", "x" * 120 + "/long.jpg", "__meta__.json"]
    if fmt != tarfile.USTAR_FORMAT:
        names.append("y" * 200 + ".txt")
    with tarfile.open(path, "w:gz" if gz else "w", format=fmt) as t:
        for n in names:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 1500)))
            info = tarfile.TarInfo(n)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("somedir")
        info.type = tarfile.DIRTYPE
        t.addfile(info)
    return path


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("gz", [False, True])
def test_tar_parser_matches_tarfile(tmp_path, fmt, gz):
    path = _make_tar(str(tmp_path / "t.tar"), fmt, gz)
    with tarfile.open(path) as t:
        expected = [(m.name, t.extractfile(m).read()) for m in t.getmembers() if m.isreg()]
    assert list(iter_tar_members(path)) == expected


def test_tar_parser_errors_name_the_file(tmp_path):
    path = _make_tar(str(tmp_path / "t.tar"), tarfile.PAX_FORMAT)
    data = open(path, "rb").read()
    (tmp_path / "cut.tar").write_bytes(data[:1800])
    with pytest.raises(TarReadError, match="cut.tar.*truncated"):
        list(iter_tar_members(str(tmp_path / "cut.tar")))
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(TarReadError, match="empty.tar.*empty file"):
        list(iter_tar_members(str(tmp_path / "empty.tar")))
    with tarfile.open(path) as t:
        second = t.getmembers()[1].offset  # the second member's first header block
    bad = bytearray(data)
    bad[second + 10] ^= 0xFF  # inside its name field: the checksum no longer matches
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    with pytest.raises(TarReadError, match="bad.tar"):
        list(iter_tar_members(str(tmp_path / "bad.tar")))


def test_loader_grouping_matches_webdataset(tmp_path):
    from webdataset.tariterators import tarfile_to_samples

    from shardprep.dataloaders.decoder import tar_samples

    path = str(tmp_path / "g.tar")
    with tarfile.open(path, "w") as t:
        for name in ["k1.jpg", "k1.TXT", "__meta__", "k2.jpg", "dir/k3.seg.png", "k1.json", "noext", "k4.a.b"]:
            info = tarfile.TarInfo(name)
            info.size = 3
            t.addfile(info, io.BytesIO(name.encode()[:3].ljust(3)))
    ours = list(tar_samples([{"url": path}]))
    theirs = list(tarfile_to_samples()([{"url": path}]))
    assert ours == theirs
    # a duplicate part goes through the handler in both
    with tarfile.open(str(tmp_path / "d.tar"), "w") as t:
        for name in ["k.jpg", "k.jpg", "m.jpg"]:
            info = tarfile.TarInfo(name)
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
    skip = wds.handlers.ignore_and_continue
    assert [s["__key__"] for s in tar_samples([{"url": str(tmp_path / "d.tar")}], handler=skip)] == ["k", "m"]
    with pytest.raises(ValueError, match="duplicate file name"):
        list(tar_samples([{"url": str(tmp_path / "d.tar")}]))


_MALLOC_PROBE = """
import ctypes, sys
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
from shardprep.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else None
mapped = libc.mallinfo2().hblkhd
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblkhd - mapped
libc.free(block)
print(applied, mapped, libc.mallinfo2().fordblks)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("env", [{}, {"MALLOC_TOP_PAD_": "131072"}], ids=["ours", "user-chosen"])
def test_keep_freed_memory_serves_image_sized_blocks_from_the_heap_and_keeps_them(env):
    """A 16 MiB block (a decoded 2,300 x 2,300 image) is mapped afresh with glibc's defaults; with
    ``keep_freed_memory`` it comes from the heap and stays there once freed, for the next image. Where
    the user set malloc's environment, nothing is changed."""
    def probe(mode):
        out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()
        return out[0], int(out[1]), int(out[2])

    assert probe("default")[1] >= 16 << 20  # glibc's own: mapped
    applied, mapped, free_in_heap = probe("tuned")
    if env:
        assert applied == "False" and mapped >= 16 << 20
    else:
        assert applied == "True" and mapped == 0 and free_in_heap >= 16 << 20


def test_collector_paused_until_the_last_of_overlapping_threads_leaves():
    import gc
    import threading

    from shardprep.allocator import collector_paused

    assert gc.isenabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with collector_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with collector_paused():
            second_in.set()
            first_out.wait(5)
            seen["after the first left"] = gc.isenabled()
        seen["after both left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after the first left": False, "after both left": True}
    gc.disable()  # the caller's own choice is what is restored
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _in_fresh_python(code: str, *args: str) -> list[str]:
    """The words of the last line ``code`` prints, run in a new interpreter from the checkout (where
    nothing was imported, frozen or collected before)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(__file__))).stdout.splitlines()[-1].split()


def test_freeze_startup_objects_freezes_once_per_process():
    code = ("import gc\nfrom shardprep.allocator import freeze_startup_objects\n"
            "freeze_startup_objects(); first = gc.get_freeze_count()\n"
            "later = [[i] for i in range(1000)]\n"
            "freeze_startup_objects(); print(first, gc.get_freeze_count())\n")
    first, second = map(int, _in_fresh_python(code))
    assert first > 1000 and second == first  # the later objects stay with the collector


# ---------------------------------------------------------------------------------------------
# CLIP


@pytest.fixture(scope="module")
def encoder(tiny_clip_dir):
    from shardprep.models.clip import load_clip_encoder

    return load_clip_encoder(f"hf_clip:{tiny_clip_dir}", device="cpu")


def test_loading_clip_leaves_the_collector_on_and_the_model_frozen(tiny_clip_dir):
    # in a fresh process, where nothing else froze anything: loaded with the collector paused
    # (shardprep.allocator), it is on again after and the model's objects are frozen
    code = ("import gc, sys\nfrom shardprep.models.clip import load_clip_encoder\n"
            "before = gc.get_freeze_count()\n"
            "load_clip_encoder('hf_clip:' + sys.argv[1], device='cpu')\n"
            "print(gc.isenabled(), before, gc.get_freeze_count())\n")
    out = _in_fresh_python(code, tiny_clip_dir)
    assert out[0] == "True" and int(out[1]) == 0 and int(out[2]) > 10_000  # (all_clip prints before)


def test_resolving_the_device_imports_torch_with_the_collector_paused():
    # often a run worker's first import of torch (the embedding thread gets there before any download
    # resizes): in a fresh process, no collection runs while it imports, and the collector is on after.
    # Only then: a later call (each shard resolves its device) freezes nothing more
    code = ("import gc\nfrom shardprep.models.clip import resolve_device\nruns = []\n"
            "gc.callbacks.append(lambda phase, info: phase == 'start' and runs.append(info['generation']))\n"
            "device = resolve_device('cpu')\nimport torch\ncollections, frozen = len(runs), gc.get_freeze_count()\n"
            "later = [[i] for i in range(1000)]\nresolve_device('cpu')\n"
            "print(device, gc.isenabled(), collections, frozen > 10_000, gc.get_freeze_count() == frozen)\n")
    assert _in_fresh_python(code) == ["cpu", "True", "0", "True", "True"]


def test_reading_a_parquet_or_a_shards_rows_imports_neither_pandas_nor_pyarrow_dataset_and_exits_cleanly(tmp_path):
    # pq.read_table goes through pyarrow.dataset, which imports pandas: ~0.4 CPU-seconds in every run
    # worker, download process and CLI that reads one parquet file; the same tables come from ParquetFile
    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.table({"url": [f"http://x/{i}" for i in range(50)], "n": list(range(50))}), path, row_group_size=16)
    code = ("import sys\nfrom shardprep.sources import read_rows\nfrom shardprep.storage import read_parquet\n"
            "whole, part = read_parquet(sys.argv[1], columns=['n']), read_rows(sys.argv[1], 10, 40)\n"
            "print(whole.column('n').to_pylist() == list(range(50)), part.column('n').to_pylist() == list(range(10, 40)),"
            " 'pandas' in sys.modules, 'pyarrow.dataset' in sys.modules)\n")
    # three processes: pyarrow's threaded read from a Python file object aborted the interpreter at its
    # exit in about half of them (storage.read_parquet); _in_fresh_python fails on that exit status
    for _ in range(3):
        assert _in_fresh_python(code, path) == ["True", "True", "False", "False"]


def test_image_spec_is_read_off_the_preprocess(encoder):
    import torchvision.transforms as T
    from clip.clip import _transform

    from shardprep.models.clip import image_spec_of

    spec = encoder.image_spec
    assert encoder.fast_preprocess and (spec.resize, spec.crop, spec.round_offsets) == (32, (32, 32), False)
    assert spec.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    tv = image_spec_of(_transform(224))  # OpenAI CLIP's (and open_clip's) torchvision pipeline
    assert (tv.resize, tv.crop, tv.round_offsets) == (224, (224, 224), True)
    assert image_spec_of(T.Compose([T.RandomResizedCrop(224), T.ToTensor()])) is None
    assert image_spec_of(lambda im: im) is None
    assert not encoder.exact().fast_preprocess and encoder.exact().model is encoder.model


@pytest.mark.parametrize("size", [(45, 31), (64, 48), (33, 90), (50, 50), (20, 20), (29, 40)])
def test_fast_decode_stays_within_a_grey_level_of_the_reference_on_small_images(size):
    import torchvision.transforms as T
    from transformers import CLIPImageProcessor

    from shardprep.models.clip import ImageSpec, decode_for_clip

    data = _jpeg(*size, seed=sum(size))
    im = Image.open(io.BytesIO(data)).convert("RGB")
    # torchvision (rounded crop offsets) and Hugging Face (floored) reference pipelines, uint8 before ToTensor
    tv = np.asarray(T.Compose([T.Resize(29, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(27)])(im))
    ours_tv = decode_for_clip(data, ImageSpec(29, (27, 27), (0, 0, 0), (1, 1, 1), round_offsets=True))
    proc = CLIPImageProcessor(size={"shortest_edge": 29}, crop_size={"height": 27, "width": 27},
                              do_rescale=False, do_normalize=False)
    hf = np.asarray(proc(im, return_tensors="np").pixel_values[0]).transpose(1, 2, 0).round().astype(np.uint8)
    ours_hf = decode_for_clip(data, ImageSpec(29, (27, 27), (0, 0, 0), (1, 1, 1), round_offsets=False))
    for ours, ref in ((ours_tv, tv), (ours_hf, hf)):
        assert ours.shape == ref.shape == (27, 27, 3)
        diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
        if size == (29, 40):  # already the resized size: no resize, the reference's pixels exactly
            assert not diff.any()
        # OpenCV's bicubic against PIL's: under a grey level on average (a crop one pixel off: 6-10)
        assert diff.mean() < 1.0 and diff.max() <= 8, (diff.mean(), diff.max())


def test_jpegs_decode_as_pil_decodes_them():
    # libjpeg-turbo through simplejpeg for the full-size decode: PIL's pixels exactly, grey ones too;
    # truncated or not-quite JPEGs fall back to PIL, which records them as it always did
    from shardprep.models.clip import ImageSpec, _decode_jpeg_rgb

    spec = ImageSpec(224, (224, 224), (0, 0, 0), (1, 1, 1), round_offsets=True)
    for mode in ("RGB", "L"):
        data = _jpeg(300, 260, seed=3, mode=mode)
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert np.array_equal(_decode_jpeg_rgb(data, spec), ref)
    whole = _jpeg(300, 260, seed=4)
    assert _decode_jpeg_rgb(whole[:-2000], spec) is None
    assert _decode_jpeg_rgb(b"\xff\xd8 broken", spec) is None
    assert _decode_jpeg_rgb(_jpeg(1600, 1200, seed=4), spec) is None  # DCT-reduced through PIL draft
    cmyk = _jpeg(300, 260, seed=5, mode="CMYK")
    assert _decode_jpeg_rgb(cmyk, spec) is None


def test_fast_embeddings_close_to_exact_on_small_and_large(encoder):
    exact = encoder.exact()
    small = [_jpeg(64, 48, seed=i) for i in range(6)]
    large = [_jpeg(1600, 1200, seed=i) for i in range(3)] + [_jpeg(900, 2000, seed=7)]
    for datas, min_cos in ((small, 0.995), (large, 0.99)):
        fast = encoder.encode_prepared([encoder.prepare_image(d) for d in datas])
        ref = exact.encode_prepared([exact.prepare_image(d) for d in datas])
        assert_close_rows(fast, ref, min_cos)


def test_large_jpegs_take_the_reduced_decode():
    from transformers import CLIPImageProcessor

    from shardprep.models.clip import ImageSpec, decode_for_clip

    data = _jpeg(1600, 1200, seed=4)
    proc = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                              do_rescale=False, do_normalize=False)
    with Image.open(io.BytesIO(data)) as im:
        ref = np.asarray(proc(im.convert("RGB"), return_tensors="np").pixel_values[0]).transpose(1, 2, 0)
    ours = decode_for_clip(data, ImageSpec(224, (224, 224), (0, 0, 0), (1, 1, 1), round_offsets=False))
    diff = np.abs(ours.astype(np.float64) - ref)
    assert diff.max() > 0  # not PIL's full-size resize: the DCT-reduced decode ran
    assert diff.mean() < 2.0  # ... and it shows the same picture


def test_uint8_batch_path_matches_float_path(encoder):
    from shardprep.models.clip import decode_for_clip

    # the GPU path: uint8 planes, normalised after the copy to the device (here: the CPU)
    datas = [_jpeg(80, 60, seed=i) for i in range(4)]
    floats = np.stack([encoder.prepare_image(d) for d in datas])
    planes = np.stack([decode_for_clip(d, encoder.image_spec).transpose(2, 0, 1) for d in datas])
    assert floats.dtype == np.float32 and planes.dtype == np.uint8
    np.testing.assert_allclose(encoder.encode_image_arrays(planes).astype(np.float32),
                               encoder.encode_image_arrays(floats).astype(np.float32), atol=2e-3)


def test_text_padding_trim_changes_nothing(encoder):
    assert encoder.trim_text_padding
    tokens = encoder.tokenizer(["a", "a photo of a cat on a mat", "東京 " * 40, ""])
    trimmed = encoder.encode_tokens(tokens)
    encoder.trim_text_padding = False
    try:
        full = encoder.encode_tokens(tokens)
    finally:
        encoder.trim_text_padding = True
    np.testing.assert_allclose(trimmed.astype(np.float32), full.astype(np.float32), atol=1e-3)


def test_write_clip_embeddings_fast_and_exact_align_around_skips(tmp_path, encoder):
    from shardprep.embeddings import CPU_STEP, GPU_DECODE_THREADS, thread_split

    rng = random.Random(0)
    samples = []
    for i in range(CPU_STEP + 9):  # two steps: buffers are reused, the second partly filled
        key = f"00000{i:03d}"
        jpg = _jpeg(rng.randrange(40, 90), rng.randrange(40, 90), seed=i) if i % 17 != 5 else b"\xff\xd8 broken"
        samples.append({"__key__": key, "jpg": jpg, "txt": f"caption {i}".encode(), "json": b'{"i": 1}'})
    (tmp_path / "images").mkdir()
    with wds.TarWriter(str(tmp_path / "images" / "00000.tar")) as w:
        for s in samples:
            w.write(s)
    layout = Layout(str(tmp_path))
    fast = write_clip_embeddings("00000", layout, encoder, batch_size=256)
    f_img = np.load(layout.img_emb("00000"))
    exact = write_clip_embeddings("00000", layout, encoder.exact(), batch_size=256)
    e_img = np.load(layout.img_emb("00000"))
    assert fast.samples == exact.samples == len(samples) - len(fast.skipped)
    assert [s["key"] for s in fast.skipped] == [s["key"] for s in exact.skipped] and fast.skipped
    assert_close_rows(f_img, e_img)
    assert thread_split("cpu")[1] >= 1 and thread_split("cuda")[1] == 0
    assert 2 <= thread_split("cuda")[0] <= GPU_DECODE_THREADS  # more threads prepare fewer images (GIL)


def _header_cases():
    """JPEGs of every kind the web serves (colour, grey, CMYK, progressive, with EXIF and ICC
    segments), then the same with bytes of their segment area damaged."""
    rng = random.Random(7)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    cases = [_jpeg(64, 48), _jpeg(33, 17, mode="L"), _jpeg(40, 40, mode="CMYK")]
    im = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    for kw in ({"progressive": True}, {"exif": exif}, {"icc_profile": b"\0" * 700},
               {"optimize": True}, {"comment": b"hello"}):
        buf = io.BytesIO()
        im.save(buf, "JPEG", **kw)
        cases.append(buf.getvalue())
    damaged = []
    for data in cases:
        for _ in range(40):
            b = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(2, min(len(b), 900))] = rng.randrange(256)
            damaged.append(bytes(b))
        damaged.append(data[:rng.randrange(2, 300)])
    return cases, damaged


def test_fast_jpeg_header_reads_what_pil_reads():
    """The segment walk gives PIL's size, format and mode, or nothing (PIL decides then): never a
    different answer, on whole JPEGs and on damaged ones. Where damage is in a table PIL checks
    (quantisation, Huffman) PIL refuses the header and the walk does not: the decoder decides then,
    as in img2dataset, which decodes with OpenCV alone."""
    cases, damaged = _header_cases()
    for data in cases:
        ours = resize._jpeg_header(data)
        if ours is not None:
            assert ours == resize._header(data)
    assert sum(resize._jpeg_header(d) is not None for d in cases) == len(cases) - 1  # CMYK goes to PIL
    both = 0
    for data in damaged:
        ours, pils = resize._jpeg_header(data), resize._header(data)
        if ours is not None and pils is not None:
            both += 1
            assert ours == pils, data[:40]
    assert both > len(damaged) // 4  # damage in scan data or unknown segments leaves the header readable
