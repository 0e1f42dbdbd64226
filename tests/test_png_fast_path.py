"""The fast PNG path (``shardprep.images.png``) against OpenCV's ``imdecode(IMREAD_UNCHANGED)``, its oracle.

PNGs here come from PIL and OpenCV's own encoders (their adaptive filters) and from a writer in this file
that sets every row's filter type, so that each of the five filters, the chunk layouts and each way a
file can be wrong are met on purpose. What the path takes must decode to OpenCV's bytes exactly; what it
does not take (other depths and colour types, interlacing, transparency, animation, any corruption) it
must hand back (``None``), so that OpenCV decides as before.
"""

import io
import struct
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image

from shardprep.images import _unfilter, resize
from shardprep.images.png import decode_png
from tests.fixtures import synthetic
from tests.fixtures.synthetic import _png_chunk


def _filtered(rows: np.ndarray, bpp: int, types: list[int]) -> bytes:
    """PNG's filters applied (spec section 9) to ``rows`` (h x row_bytes uint8), row y by ``types[y]``."""
    out = []
    prev = np.zeros(rows.shape[1], np.int32)
    for y, t in enumerate(types):
        x = rows[y].astype(np.int32)
        a = np.concatenate([np.zeros(bpp, np.int32), x[:-bpp]])[:len(x)]
        c = np.concatenate([np.zeros(bpp, np.int32), prev[:-bpp]])[:len(x)]
        if t == 0:
            f = x
        elif t == 1:
            f = x - a
        elif t == 2:
            f = x - prev
        elif t == 3:
            f = x - (a + prev) // 2
        else:
            pa, pb, pc = np.abs(prev - c), np.abs(a - c), np.abs(a + prev - 2 * c)
            f = x - np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, prev, c))
        out.append(bytes([t]) + (f % 256).astype(np.uint8).tobytes())
        prev = x
    return b"".join(out)


def _png(pixels: np.ndarray, *, types=None, idats: int = 1, before=(), after=(), colour=None, depth=8,
         interlace=0, stream=None, trailer=b"") -> bytes:
    """A PNG of ``pixels`` (h x w [x c], RGB order, uint8), written by hand: ``types`` each row's filter
    (default: all five in turn), the zlib stream in ``idats`` IDAT chunks, extra chunks ``before`` and
    ``after`` them, ``stream`` instead of the real zlib stream, ``trailer`` after IEND."""
    h, w = pixels.shape[:2]
    c = 1 if pixels.ndim == 2 else pixels.shape[2]
    colour = {1: 0, 3: 2, 4: 6}[c] if colour is None else colour
    types = [y % 5 for y in range(h)] if types is None else types
    data = zlib.compress(_filtered(pixels.reshape(h, w * c), c, types)) if stream is None else stream
    step = -(-len(data) // idats)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, interlace)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + b"".join(_png_chunk(k, b) for k, b in before)
            + b"".join(_png_chunk(b"IDAT", data[i:i + step]) for i in range(0, len(data), step))
            + b"".join(_png_chunk(k, b) for k, b in after) + _png_chunk(b"IEND", b"") + trailer)


def _opencv(data: bytes) -> np.ndarray | None:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)


def _assert_opencvs(data: bytes) -> None:
    ours, theirs = decode_png(data), _opencv(data)
    assert ours is not None and theirs is not None
    assert ours.dtype == theirs.dtype == np.uint8 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def _photo(w: int, h: int, seed: int, channels: int) -> np.ndarray:
    rgb = np.asarray(synthetic.render_image(seed, w, h))
    if channels == 1:
        return np.asarray(Image.fromarray(rgb).convert("L"))
    if channels == 4:
        return np.asarray(synthetic._with_alpha(Image.fromarray(rgb)))
    return rgb


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_every_filter_and_chunk_layout_decodes_to_opencvs_pixels(channels):
    rng = np.random.default_rng(channels)
    for w, h in ((1, 1), (1, 7), (7, 1), (2, 3), (31, 17), (300, 211)):
        pixels = _photo(max(w, 16), max(h, 16), w * h, channels)[:h, :w]
        for filters in ([0] * h, [1] * h, [2] * h, [3] * h, [4] * h, list(rng.integers(0, 5, h))):
            _assert_opencvs(_png(pixels, types=filters))
        noise = rng.integers(0, 256, pixels.shape, dtype=np.uint8)  # every byte value, sums that wrap
        _assert_opencvs(_png(noise))
    pixels = _photo(120, 90, 7, channels)
    _assert_opencvs(_png(pixels, idats=9))  # the stream split over many IDATs
    _assert_opencvs(_png(pixels, idats=2, after=[(b"IDAT", b"")]))  # an empty one ending the run
    ancillary = [(b"gAMA", struct.pack(">I", 45455)), (b"tEXt", b"Comment\x00hello"), (b"pHYs", bytes(9)),
                 (b"sRGB", b"\x00"), (b"eXIf", b"MM\x00*\x00\x00\x00\x08\x00\x01\x01\x12\x00\x03\x00\x00\x00\x01"
                                               b"\x00\x06\x00\x00\x00\x00\x00\x00")]
    # gamma, text, an EXIF rotation: none changes OpenCV's pixels with IMREAD_UNCHANGED, nor ours
    _assert_opencvs(_png(pixels, before=ancillary, after=[(b"tEXt", b"After\x00idat")], trailer=b"junk after IEND"))
    if channels > 1:  # a suggested palette in a colour image is only a hint
        _assert_opencvs(_png(pixels, before=[(b"PLTE", bytes(range(48)))]))


def test_pil_and_opencv_encoded_photos_decode_to_opencvs_pixels():
    for seed, (w, h) in enumerate(((640, 480), (333, 500), (900, 257))):
        for channels in (1, 3, 4):
            pixels = _photo(w, h, seed, channels)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, "PNG", compress_level=seed * 3)
            _assert_opencvs(buf.getvalue())
            bgr = pixels if channels == 1 else cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR if channels == 3
                                                            else cv2.COLOR_RGBA2BGRA)
            _assert_opencvs(cv2.imencode(".png", bgr)[1].tobytes())


def test_what_the_path_does_not_take_is_left_to_opencv():
    rgb = _photo(64, 48, 1, 3)
    good = _png(rgb)
    assert decode_png(good) is not None
    grey = _photo(64, 48, 1, 1)
    deep = cv2.imencode(".png", (rgb.astype(np.uint16) * 257))[1].tobytes()
    palette = io.BytesIO()
    Image.fromarray(rgb).quantize(16).save(palette, "PNG")
    grey_alpha = io.BytesIO()
    Image.fromarray(grey).convert("LA").save(grey_alpha, "PNG")
    stream = zlib.compress(_filtered(rgb.reshape(48, -1), 3, [0] * 48))
    ihdr_at = good.index(b"IHDR")
    bad_crc = bytearray(good)
    bad_crc[good.index(b"IDAT") + 10] ^= 1
    unknown_filter = bytearray(_filtered(rgb.reshape(48, -1), 3, [0] * 48))
    unknown_filter[0] = 5  # the first row's filter type: 0-4 exist
    text = _png_chunk(b"tEXt", b"a\x00b")
    cases = {
        "16-bit": deep,
        "palette": palette.getvalue(),
        "grey + alpha": grey_alpha.getvalue(),
        "interlaced": _png(rgb, interlace=1),  # the header says Adam7: not read further
        "tRNS": _png(rgb, before=[(b"tRNS", bytes(6))]),
        "animated": _png(rgb, before=[(b"acTL", struct.pack(">II", 1, 0))]),
        "unknown critical chunk": _png(rgb, before=[(b"XYZW", b"")]),
        "palette in a grey image": _png(grey, before=[(b"PLTE", bytes(48))]),
        "a bad CRC": bytes(bad_crc),
        "a bad CRC in an ancillary chunk": _png(rgb, before=[(b"tEXt", b"a\x00b")]).replace(
            text, text[:-1] + bytes([text[-1] ^ 1])),
        "no IEND": good[:-12],
        "cut inside IDAT": good[:len(good) // 2],
        "IDATs in two runs": _split_idats(rgb),
        "too little pixel data": _png(rgb, stream=zlib.compress(_filtered(rgb[:40].reshape(40, -1), 3, [0] * 40))),
        "more than the image": _png(rgb, stream=zlib.compress(_filtered(rgb.reshape(48, -1), 3, [0] * 48) + b"x")),
        "data after the zlib stream": _png(rgb, stream=stream + b"\x00\x00"),
        "a bad filter type": _png(rgb, stream=zlib.compress(bytes(unknown_filter))),
        "a broken zlib stream": _png(rgb, stream=stream[:10] + bytes(20) + stream[30:]),
        "a wrong IHDR length": good[:ihdr_at - 4] + _png_chunk(b"IHDR", good[ihdr_at + 4:ihdr_at + 17] + b"\x00")
        + good[ihdr_at + 21:],
        "not a PNG": b"GIF89a" + good[6:],
    }
    for name, data in cases.items():
        assert decode_png(data) is None, name
    # the engine's fast path still decodes those OpenCV can, through OpenCV, and fails the others as before
    for name in ("palette", "grey + alpha", "tRNS", "16-bit", "a bad CRC", "no IEND"):
        fast = resize.resize_image(cases[name], fast_decode=True)
        exact = resize.resize_image(cases[name])
        assert (fast.error, fast[1:5]) == (exact.error, exact[1:5]), name


def _split_idats(rgb: np.ndarray) -> bytes:
    """A PNG whose IDAT chunks are interrupted by an ancillary chunk (libpng refuses it)."""
    data = zlib.compress(_filtered(rgb.reshape(rgb.shape[0], -1), 3, [0] * rgb.shape[0]))
    half = len(data) // 2
    ihdr = struct.pack(">IIBBBBB", rgb.shape[1], rgb.shape[0], 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", data[:half])
            + _png_chunk(b"tEXt", b"a\x00b") + _png_chunk(b"IDAT", data[half:]) + _png_chunk(b"IEND", b""))


def test_the_engine_decodes_plain_pngs_without_opencv(monkeypatch):
    """resize_image's fast path takes plain PNGs through png.py: with OpenCV's decoder gone it still gives
    the bytes it gave with it (the same pixels, then the same resize and encode)."""
    buf = io.BytesIO()
    synthetic._with_alpha(synthetic.render_image(2, 700, 500)).save(buf, "PNG")
    data = buf.getvalue()
    before = resize.resize_image(data, fast_decode=True)
    assert before.error is None

    def no_decoder(*args, **kwargs):
        raise AssertionError("OpenCV's imdecode was called")

    monkeypatch.setattr(resize.cv2, "imdecode", no_decoder)
    assert resize.resize_image(data, fast_decode=True) == before
    # the exact path (fast_decode off) is img2dataset's own: OpenCV's decoder, which is gone here
    assert resize.resize_image(data).error == "OpenCV's imdecode was called"


def test_unfilter_refuses_buffers_of_another_size_and_names_a_bad_row():
    out = np.empty((2, 6), np.uint8)
    with pytest.raises(ValueError, match="2 rows of 6 bytes"):
        _unfilter.unfilter(bytes(13), 2, 6, 3, out)
    with pytest.raises(ValueError, match="row 1 has filter type 9"):
        _unfilter.unfilter(bytes(7) + b"\x09" + bytes(6), 2, 6, 3, out)
