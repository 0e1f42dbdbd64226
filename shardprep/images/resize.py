"""Decode, resize and re-encode one image exactly like img2dataset's ``Resizer`` (OpenCV/numpy only).

img2dataset 1.47 does its resizing through albumentations (``SmallestMaxSize``, ``LongestMaxSize``,
``CenterCrop``, ``PadIfNeeded``); the same arithmetic is written out here so the output pixels
match without importing albumentations. Two checks run before any pixel is decoded:

* size from the header (PIL reads only the header on ``open``): more than ``max_image_pixels``
  is refused, so a small file that claims 50000x50000 never allocates gigabytes;
* truncation (JPEG): the stream must reach its End-Of-Image marker. Walking the marker segments
  to the first scan and then one ``bytes.find`` costs microseconds, unlike a second full decode,
  and catches a download cut short, which some OpenCV builds would decode with grey padding.

``fast_decode=True`` (the config's default; off here, so this function alone stays byte-identical
to img2dataset): a JPEG that will be downscaled is decoded at 1/2, 1/4 or 1/8 scale by libjpeg's
DCT scaling (OpenCV's ``IMREAD_REDUCED_*``, as PIL's ``draft``), choosing the largest reduction
that still leaves ``DRAFT_GAP`` times the target size, and every downscale (reduced or not, PNGs
too) is an antialiased bilinear resize (``downscale.c``: PIL's and torchvision's filter) to
exactly the size img2dataset would produce (computed from the original size), where img2dataset
uses OpenCV's area resize, which has no vectorised path at a fractional factor (twice the time).
Sizes, statuses and metadata are unchanged; pixels differ slightly (bench/IMAGES.md gives PSNR
against the exact path); upscales and ``resize_mode: no`` are the exact path's. Most of the cost of
big JPEGs is the full-size decode and the resize over every decoded pixel; both shrink with the
reduction. With ``fast_decode`` the JPEGs (RGB and greyscale) are decoded by simplejpeg, the same
libjpeg-turbo with the same settings as OpenCV's (accurate integer IDCT, fancy upsampling: the same
pixels, reduced or not), through a leaner path that costs ~15% less CPU at full scale; whatever it
refuses (a warning on corrupt data, a size it did not promise) goes to OpenCV, which decides as
before. Plain PNGs (8-bit grey, RGB, RGBA) are decoded by ``png.py`` (ISA-L's inflate, the row filters
in C): OpenCV's pixels exactly, at under half its CPU; any other PNG goes to OpenCV as before.
"""

from __future__ import annotations

import io
from typing import Iterator, NamedTuple

import cv2
import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from shardprep.images import _downscale
from shardprep.images.png import decode_png

RESIZE_MODES = ("no", "keep_ratio", "center_crop", "border", "keep_ratio_largest")
INTERPOLATIONS = {
    "nearest": cv2.INTER_NEAREST,
    "linear": cv2.INTER_LINEAR,
    "bilinear": cv2.INTER_LINEAR,
    "cubic": cv2.INTER_CUBIC,
    "bicubic": cv2.INTER_CUBIC,
    "area": cv2.INTER_AREA,
    "lanczos": cv2.INTER_LANCZOS4,
    "lanczos4": cv2.INTER_LANCZOS4,
}
_ENCODE_FLAG = {"jpg": cv2.IMWRITE_JPEG_QUALITY, "png": cv2.IMWRITE_PNG_COMPRESSION, "webp": cv2.IMWRITE_WEBP_QUALITY}

BOMB_ERROR = "image too large (decompression bomb)"
DECODE_ERROR = "Image decoding error"  # img2dataset's message
TRUNCATED_ERROR = "Image decoding error: truncated JPEG (no end-of-image marker)"

# decode/resize run inside the download threads; OpenCV's own pool would oversubscribe the cores
cv2.setNumThreads(1)

# fast_decode keeps at least this many decoded pixels per output pixel along each side, so the
# antialiased downscale still averages (PIL's ``reducing_gap`` idea). 1.5 rather than 2: a JPEG of 768 to
# 1,023 px is then decoded at half size. On the benchmark site's JPEGs decode + downscale took 3.96 ms
# an image on average against 4.30 ms at 2, and the pixels against img2dataset's went from PSNR min
# 43.5 / median 48.2 dB to 43.1 / 47.8 (1.25: min 39.3); bench/IMAGES.md
DRAFT_GAP = 1.5
_REDUCED_FLAGS = {  # (reduction, greyscale) -> imdecode flags; orientation ignored like IMREAD_UNCHANGED
    (2, False): cv2.IMREAD_REDUCED_COLOR_2, (4, False): cv2.IMREAD_REDUCED_COLOR_4,
    (8, False): cv2.IMREAD_REDUCED_COLOR_8, (2, True): cv2.IMREAD_REDUCED_GRAYSCALE_2,
    (4, True): cv2.IMREAD_REDUCED_GRAYSCALE_4, (8, True): cv2.IMREAD_REDUCED_GRAYSCALE_8,
}


class Resized(NamedTuple):
    data: bytes | None
    width: int | None
    height: int | None
    original_width: int | None
    original_height: int | None
    error: str | None


def _failed(message: str) -> Resized:
    return Resized(None, None, None, None, None, message)


def _header(data: bytes) -> tuple[tuple[int, int], str | None, str | None] | None:
    """((width, height), format, mode) from the header without decoding pixels; ``None`` if unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size, im.format, im.mode
    except Image.DecompressionBombError:
        # PIL refuses more than twice its own limit before we can look; that is a bomb by any measure
        return (1 << 31, 1 << 31), None, None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None


# start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic coded)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_header(data: bytes) -> tuple[tuple[int, int], str, str] | None:
    """What ``_header`` gives an 8-bit greyscale or colour JPEG (PIL's modes "L", "RGB"), read from its
    frame header by walking the segments before it: ~2 us, where PIL's ``open`` parses them in Python
    (~50 us a row). ``None`` for anything else (other depths and channel counts, segments that do
    not walk cleanly), which PIL then reads as before."""
    for pos, marker in _markers(data):
        if marker is None or marker == 0x01 or 0xD0 <= marker <= 0xDA:
            return None  # not a marker, a standalone one or a scan before any frame header
        if marker in _SOF:
            if pos + 10 > len(data):
                return None
            precision, height, width, components = (data[pos + 4], (data[pos + 5] << 8) | data[pos + 6],
                                                    (data[pos + 7] << 8) | data[pos + 8], data[pos + 9])
            if precision != 8 or components not in (1, 3) or not width or not height:
                return None
            return (width, height), "JPEG", "L" if components == 1 else "RGB"
    return None


def _markers(data: bytes) -> Iterator[tuple[int, int | None]]:
    """``(position, marker)`` of a JPEG's marker segments after its SOI, each stepped over by its length
    (standalone markers by their two bytes), fill bytes skipped; ``(position, None)`` where a marker
    must be and is not, and then no more. The caller stops where its question is answered."""
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            yield pos, None
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        yield pos, marker
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers
            pos += 2
        else:
            pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the image header without decoding pixels; ``None`` if PIL cannot tell."""
    h = _header(data)
    return None if h is None else h[0]


def jpeg_is_truncated(data: bytes) -> bool:
    """True when a JPEG stream stops before its End-Of-Image marker (FFD9).

    Segments before the first scan (SOS) are skipped by their lengths, so an FFD9 that ends an
    embedded EXIF thumbnail does not count; inside entropy-coded data FF is always stuffed
    (FF00) or a restart marker, so the first FFD9 after SOS is the real end.
    """
    if not data.startswith(b"\xff\xd8"):
        return False
    for pos, marker in _markers(data):
        if marker is None:
            return True  # not a marker where one must be: corrupt; treat as truncated
        if marker == 0xD9:
            return False
        if marker == 0xDA:  # start of scan: the rest is entropy-coded data + later segments
            start = pos + 2 + ((data[pos + 2] << 8) | data[pos + 3])
            if data.endswith(b"\xff\xd9") and len(data) - 2 >= start:  # the usual case, without a scan
                return False
            return data.find(b"\xff\xd9", start) < 0
    return True


def _target(height: int, width: int, scale: float) -> tuple[int, int]:
    # albumentations MaxSizeTransform.apply: round() each side (banker's rounding), at least 1
    return max(1, round(height * scale)), max(1, round(width * scale))


def _resize(img: np.ndarray, scale: float, interpolation: int, target: tuple[int, int] | None = None) -> np.ndarray:
    """Resize by ``scale`` like albumentations; ``target`` (h, w) overrides the size, for an image
    decoded at reduced scale whose size img2dataset would have computed from the original.
    ``interpolation`` ``ANTIALIASED``: ``_antialiased`` for 8-bit images, OpenCV's area resize otherwise."""
    height, width = img.shape[:2]
    new_h, new_w = target if target is not None else _target(height, width, scale)
    if (new_h, new_w) == (height, width):
        return img
    if interpolation == ANTIALIASED:
        if img.dtype == np.uint8:
            return _antialiased(img, new_w, new_h)
        interpolation = cv2.INTER_AREA  # 16-bit PNGs and the like: our kernel is uint8 only
    out = cv2.resize(img, (new_w, new_h), interpolation=interpolation)
    if img.ndim == 3 and out.ndim == 2:  # cv2 drops a single channel axis; albumentations keeps it
        out = out[..., np.newaxis]
    return out


# fast_decode's downscale: antialiased bilinear (PIL's and torchvision's filter: a triangle as wide as the
# scale factor), where OpenCV's INTER_AREA has no SIMD path at a fractional factor. Our C kernel
# (downscale.c, torch's uint8 kernel's arithmetic) spares each download process torch's import (~2 CPU-s);
# on the benchmark site's images it takes 0.22-0.27 ms an image against torch's 0.26-0.38 and OpenCV's area
# resize's ~1 ms; its pixels are torch's within a grey level; the engine's against img2dataset's in bench/IMAGES.md
ANTIALIASED = -1  # not an OpenCV flag


def _antialiased(img: np.ndarray, new_w: int, new_h: int) -> np.ndarray:
    """``img`` (HxW or HxWxC uint8) downscaled to (new_h, new_w) by antialiased bilinear, same layout."""
    src = np.ascontiguousarray(img)
    out = np.empty((new_h, new_w) + img.shape[2:], np.uint8)
    channels = 1 if img.ndim == 2 else img.shape[2]
    _downscale.downscale(src, src.shape[0], src.shape[1], channels, out, new_h, new_w)
    return out


def _center_crop(img: np.ndarray, size: int) -> np.ndarray:
    height, width = img.shape[:2]
    if height < size or width < size:
        raise ValueError(f"Crop size ({size}, {size}) is larger than the image ({height}, {width})")
    y0, x0 = (height - size) // 2, (width - size) // 2
    return img[y0:y0 + size, x0:x0 + size]


def _pad_white(img: np.ndarray, size: int) -> np.ndarray:
    # albumentations PadIfNeeded(position="center"): the extra pixel goes to the bottom/right
    height, width = img.shape[:2]
    top = int((size - height) / 2.0) if height < size else 0
    bottom = size - height - top if height < size else 0
    left = int((size - width) / 2.0) if width < size else 0
    right = size - width - left if width < size else 0
    if top == bottom == left == right == 0:
        return img
    out = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=[255, 255, 255])
    if img.ndim == 3 and out.ndim == 2:
        out = out[..., np.newaxis]
    return out


def _fitted(resize_mode: str):
    """``min`` where the shorter side is scaled to image_size (then cropped), ``max`` where the longer one is
    (then padded): img2dataset's SmallestMaxSize / LongestMaxSize."""
    return min if resize_mode in ("keep_ratio", "center_crop") else max


def _plan_reduction(size: tuple[int, int], fmt: str | None, mode: str | None, resize_mode: str,
                    image_size: int) -> tuple[int, bool]:
    """(DCT reduction 1/2/4/8, greyscale) for a fast decode; reduction 1 means decode exactly."""
    if fmt != "JPEG" or mode not in ("RGB", "L") or resize_mode == "no":
        return 1, False  # CMYK/YCCK and other formats: OpenCV's exact decode, as img2dataset
    width, height = size
    side = _fitted(resize_mode)(width, height)
    if side <= image_size:  # upscale or unchanged: nothing to gain
        return 1, False
    new_h, new_w = _target(height, width, image_size / side)
    for r in (8, 4, 2):
        # libjpeg's scaled size is ceil(side / r)
        if -(-width // r) >= DRAFT_GAP * new_w and -(-height // r) >= DRAFT_GAP * new_h:
            return r, mode == "L"
    return 1, False


def _composite_on_white(img: np.ndarray) -> np.ndarray:
    """BGRA -> BGR on white, bit-identical to img2dataset's ``rint(alpha / 255 * c + 255 - alpha)``.

    That is ``round(alpha * c / 255) + (255 - alpha)`` exactly: ``alpha * c / 255`` is never within
    1/255 of a tie, far more than float rounding moves it, and the sum never passes 255; OpenCV's
    saturating uint8 ``multiply`` (``scale=1/255``, rounded) and ``add`` compute it in SIMD
    (tests/test_fast_paths.py checks all 65,536 pairs against the float64 formula)."""
    alpha = cv2.cvtColor(cv2.extractChannel(img, 3), cv2.COLOR_GRAY2BGR)  # SIMD, unlike numpy's strided copy
    bgr = cv2.cvtColor(img, cv2.COLOR_BGRA2BGR)
    return cv2.add(cv2.multiply(bgr, alpha, scale=1 / 255), cv2.bitwise_not(alpha))


def _decode_jpeg(data: bytes, reduction: int, grey: bool) -> np.ndarray | None:
    """A JPEG decoded by simplejpeg at 1/``reduction`` scale: the array OpenCV's ``imdecode`` gives
    (``IMREAD_UNCHANGED``, or ``IMREAD_REDUCED_*`` with ``grey``), or ``None`` when simplejpeg refuses
    it or does not give that size, so that OpenCV decodes it as before."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if reduction == 1:
            grey = colorspace == "Gray"  # IMREAD_UNCHANGED: one channel stays one channel
        h, w = -(-height // reduction), -(-width // reduction)
        # min_factor with the minimum size selects exactly the 1/reduction DCT scaling
        img = simplejpeg.decode_jpeg(data, "GRAY" if grey else "BGR", min_height=h, min_width=w,
                                     min_factor=reduction)
    except ValueError:  # corrupt data (strict: a libjpeg warning too), CMYK, ...
        return None
    if img.shape[:2] != (h, w):
        return None
    return img[:, :, 0] if grey else img


def resize_image(
    data: bytes,
    *,
    image_size: int = 256,
    resize_mode: str = "border",
    resize_only_if_bigger: bool = False,
    encode_format: str = "jpg",
    encode_quality: int = 95,
    max_image_pixels: int = 89_478_485,
    upscale_interpolation: str = "lanczos",
    downscale_interpolation: str = "area",
    fast_decode: bool = False,
) -> Resized:
    """Bytes of a downloaded image → ``Resized(data, width, height, original_width, original_height, error)``.

    Never raises for a bad image: ``error`` carries the message (img2dataset: ``failed_to_resize``).
    ``fast_decode``: DCT-scaled JPEG decoding before the resize (module doc).
    """
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")
    if encode_format not in _ENCODE_FLAG:
        raise ValueError(f"encode_format must be one of {tuple(_ENCODE_FLAG)}, got {encode_format!r}")
    try:
        header = (_jpeg_header(data) if fast_decode and data[:2] == b"\xff\xd8" else None) or _header(data)
        if header is None:
            # PIL knows every web image format; an image it cannot read the header of is not
            # decoded at all, because its size could not be checked first
            return _failed(DECODE_ERROR)
        size, fmt, mode = header
        if size[0] * size[1] > max_image_pixels:
            return _failed(BOMB_ERROR)
        if jpeg_is_truncated(data):
            return _failed(TRUNCATED_ERROR)
        reduction, grey = (_plan_reduction(size, fmt, mode, resize_mode, image_size)
                           if fast_decode else (1, False))
        buf = np.frombuffer(data, np.uint8)
        img = None
        if fast_decode and fmt == "JPEG" and mode in ("RGB", "L"):
            img = _decode_jpeg(data, reduction, grey)
        elif fast_decode and fmt == "PNG":
            img = decode_png(data)  # lossless: OpenCV's pixels, or None for OpenCV to decide
        if img is None and reduction > 1:
            img = cv2.imdecode(buf, _REDUCED_FLAGS[reduction, grey] | cv2.IMREAD_IGNORE_ORIENTATION)
        if img is not None and reduction > 1 and img.shape[:2] != (-(-size[1] // reduction), -(-size[0] // reduction)):
            img = None  # not what the header promised (odd stream): decode exactly instead
        if img is None:
            reduction = 1
            img = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
        if img is None:
            return _failed(DECODE_ERROR)
        if img.ndim == 3 and img.shape[-1] == 4:
            img = _composite_on_white(img)
        if reduction > 1:
            original_width, original_height = size
        else:
            original_height, original_width = img.shape[:2]

        if resize_mode != "no":
            side = _fitted(resize_mode)
            downscale = side(original_width, original_height) > image_size
            if not resize_only_if_bigger or downscale:
                inter = INTERPOLATIONS[downscale_interpolation if downscale else upscale_interpolation]
                if fast_decode and downscale and downscale_interpolation == "area":
                    inter = ANTIALIASED
                scale = image_size / side(original_height, original_width)
                img = _resize(img, scale, inter, _target(original_height, original_width, scale))
                if resize_mode == "center_crop":
                    img = _center_crop(img, image_size)
                elif resize_mode == "border":
                    img = _pad_white(img, image_size)

        height, width = img.shape[:2]
        ok, buf = cv2.imencode(f".{encode_format}", img, params=[int(_ENCODE_FLAG[encode_format]), encode_quality])
        if not ok:
            return _failed(f"failed to encode as {encode_format}")
        return Resized(buf.tobytes(), width, height, original_width, original_height, None)
    except Exception as e:  # noqa: BLE001 - any decoder/resizer error is this image's failure, as in img2dataset
        return _failed(str(e) or type(e).__name__)
