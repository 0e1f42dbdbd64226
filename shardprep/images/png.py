"""Decode a plain PNG to the array OpenCV's ``imdecode(IMREAD_UNCHANGED)`` gives, at about half its CPU.

A PNG's pixels are lossless, so any decoder that reads one gives the same bytes; what costs is the
inflate. OpenCV's libpng inflates with zlib; ISA-L's inflate (``isal``) does the same work in less than
half the time, and the row filters are undone in C (``unfilter.c``). On the benchmark site's PNGs
(RGBA photos, 200-900 px) this path took 2.4 ms an image where ``cv2.imdecode`` took 5.1-5.5 (bench/IMAGES.md).

Only what has one reading is taken: 8-bit greyscale, RGB or RGBA, not interlaced, no ``tRNS`` (which
OpenCV turns into an alpha channel), no animation chunks, every chunk's CRC right, the IDAT chunks in one
run, an ``IEND``, and a zlib stream that inflates to exactly the image's bytes with nothing after it.
For anything else ``decode_png`` returns ``None`` and the caller decodes with OpenCV as before, which
then decides (a corrupt file stays OpenCV's failure). Ancillary chunks (gAMA, iCCP, text, eXIf, ...) do
not change OpenCV's pixels with ``IMREAD_UNCHANGED``, so they do not change these either.
"""

from __future__ import annotations

import cv2
import numpy as np

from shardprep.images import _unfilter

try:  # ISA-L's inflate: the same zlib stream, ~2.3x zlib's speed on the benchmark site's PNGs
    from isal import isal_zlib as _zlib
except ImportError:  # a platform without its wheel: zlib, still without libpng's per-row overhead
    import zlib as _zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 6: 4}  # colour types taken: greyscale, RGB, RGBA
_TO_BGR = {3: cv2.COLOR_RGB2BGR, 4: cv2.COLOR_RGBA2BGRA}
_CRITICAL = frozenset({b"IHDR", b"PLTE", b"IDAT", b"IEND"})
_ANIMATION = frozenset({b"acTL", b"fcTL", b"fdAT"})  # APNG: OpenCV may read these frames
_MAX_SIDE = 1_000_000  # libpng's default user limit on width and height


def decode_png(data: bytes) -> np.ndarray | None:
    """``data``'s pixels as ``cv2.imdecode(..., IMREAD_UNCHANGED)`` returns them (BGR, BGRA or HxW grey,
    uint8), or ``None`` when the file is not one this path takes (module doc)."""
    if not data.startswith(SIGNATURE):
        return None
    view, n, pos = memoryview(data), len(data), 8
    header, idat, idat_ended = None, [], False
    while True:
        if pos + 12 > n:
            return None  # ends before IEND
        length = int.from_bytes(view[pos:pos + 4], "big")
        kind = bytes(view[pos + 4:pos + 8])
        end = pos + 12 + length
        if length > 0x7FFFFFFF or end > n or not kind.isalpha() or kind in _ANIMATION:
            return None
        if _zlib.crc32(view[pos + 4:end - 4]) != int.from_bytes(view[end - 4:end], "big"):
            return None
        body = view[pos + 8:end - 4]
        if header is None:
            if kind != b"IHDR" or length != 13:
                return None
            header = bytes(body)
        elif kind == b"IDAT":
            if idat_ended:
                return None  # IDATs in two runs: libpng refuses them
            idat.append(body)
        elif kind == b"IEND":
            break
        else:
            idat_ended = bool(idat)
            if kind == b"tRNS" or (kind[0] < 0x61 and kind not in _CRITICAL) or kind == b"IHDR":
                return None  # transparency OpenCV turns into alpha; an unknown critical chunk; a second IHDR
            if kind == b"PLTE" and header[9] == 0:
                return None  # a palette in a greyscale image: libpng's error
        pos = end
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour, compression, filtering, interlace = header[8:13]
    channels = _CHANNELS.get(colour)
    if (channels is None or depth != 8 or compression or filtering or interlace or not idat
            or not 0 < width <= _MAX_SIDE or not 0 < height <= _MAX_SIDE):
        return None
    row = width * channels
    expected = height * (row + 1)
    try:
        inflater = _zlib.decompressobj()
        raw = inflater.decompress(b"".join(idat) if len(idat) > 1 else idat[0], expected)
    except _zlib.error:
        return None
    if len(raw) != expected or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        return None  # too little data, or more than the image (libpng: "Extra compressed data")
    pixels = np.empty((height, width, channels) if channels > 1 else (height, width), np.uint8)
    try:
        _unfilter.unfilter(raw, height, row, channels, pixels)
    except ValueError:
        return None  # an unknown filter type: libpng's error
    return cv2.cvtColor(pixels, _TO_BGR[channels]) if channels > 1 else pixels
