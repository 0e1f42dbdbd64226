"""The picture side of a video sample: upright frames at the target size, encoded into one file.

Resize modes are video2dataset's ``ResolutionSubsampler`` ones (``scale``, ``crop``, ``pad`` and their
comma-separated combinations, all to ``video_size``), with the cases FFmpeg's filters would fail on
done the way the combination means:

* ``scale`` alone: height ``video_size``, width keeping the aspect ratio, rounded to even (FFmpeg's
  ``scale=-2:size``, as video2dataset);
* ``scale`` + ``crop``: the short side to ``video_size``, then a centred square crop. video2dataset
  scales the height and crops, which fails on portrait videos (narrower than the crop);
* ``scale`` + ``pad``: the long side to ``video_size``, then black padding to a centred square.
  video2dataset scales the height and pads, which fails on landscape videos; its pad is top-left;
* ``crop`` / ``pad`` without ``scale``: each side cropped to at most / padded to at least the size.

Frames are turned upright (the container's display rotation applied to the pixels, as the FFmpeg
command line and torchcodec do; PyAV returns frames as stored), so width and height are the displayed
ones and outputs carry no rotation. Sides are made even (4:2:0 needs it): an odd side loses a pixel.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

CODECS = {"mp4": "libx264", "webm": "libvpx-vp9"}


@dataclass(frozen=True)
class Geometry:
    """From an upright ``width`` x ``height`` source: scale to ``scaled``, then crop or pad (centred)
    to ``out``."""

    scaled: tuple[int, int]  # (width, height) after scaling, upright
    out: tuple[int, int]  # (width, height) of the output

    @property
    def reshapes(self) -> bool:
        return self.scaled != self.out


def _even_rescale(target: int, num: int, den: int) -> int:
    """``target * num / den`` rounded to the nearest even number, at least 2 (FFmpeg's ``-2``)."""
    return max(2, 2 * ((target * num + den) // (2 * den)))


def _even(n: int) -> int:
    return max(2, n - n % 2)


def plan_geometry(width: int, height: int, size: int | None, mode: str) -> Geometry:
    """Output sizes for an upright ``width`` x ``height`` source."""
    if size is None:  # odd sides lose a pixel by scaling (the 4:2:0 planes need even ones)
        return Geometry((_even(width), _even(height)), (_even(width), _even(height)))
    modes = set(mode.split(","))
    w, h = width, height
    if "scale" in modes:
        if "crop" in modes:  # cover: the short side becomes the size
            by_height = h <= w
        elif "pad" in modes:  # fit: the long side becomes the size
            by_height = h >= w
        else:
            by_height = True
        if by_height:
            w, h = _even_rescale(size, width, height), size
        else:
            w, h = size, _even_rescale(size, height, width)
    w, h = _even(w), _even(h)
    out_w, out_h = w, h
    if "crop" in modes:
        out_w, out_h = min(out_w, size), min(out_h, size)
    if "pad" in modes:
        out_w, out_h = max(out_w, size), max(out_h, size)
    return Geometry((w, h), (_even(out_w), _even(out_h)))


def upright_size(width: int, height: int, rotation: int) -> tuple[int, int]:
    return (height, width) if rotation % 180 else (width, height)


def _interpolation(src: tuple[int, int], dst: tuple[int, int]) -> str:
    # area averaging when shrinking (no aliasing), bicubic when enlarging
    return "AREA" if dst[0] * dst[1] < src[0] * src[1] else "BICUBIC"


# Turning, cropping and padding work on the YUV 4:2:0 planes the encoders take (a full-size Y, quarter-size
# U and V), never through RGB: one conversion fewer per frame, a third of the bytes to move.
_BLACK = (16, 128, 128)  # Y, U, V of black (limited range)


def _planes(frame: av.VideoFrame) -> list[np.ndarray]:
    """Y, U, V of an even-sized yuv420p frame (PyAV gives them one after the other, as I420)."""
    flat = frame.to_ndarray().reshape(-1)
    h, w = frame.height, frame.width
    n = h * w
    return [flat[:n].reshape(h, w), flat[n:n + n // 4].reshape(h // 2, w // 2),
            flat[n + n // 4:n + n // 2].reshape(h // 2, w // 2)]


def _frame(planes: list[np.ndarray]) -> av.VideoFrame:
    h, w = planes[0].shape
    flat = np.concatenate([p.reshape(-1) for p in planes])  # reshape copies the turned (strided) planes
    return av.VideoFrame.from_ndarray(flat.reshape(h * 3 // 2, w), format="yuv420p")


def _centre(plane: np.ndarray, out_w: int, out_h: int, fill: int, unit: int) -> np.ndarray:
    """``plane`` in the middle of an ``out_w`` x ``out_h`` canvas, cropped where larger and ``fill`` where
    smaller, offsets in multiples of ``unit`` (2 for Y, 1 for U and V at half size: the planes stay
    aligned, a crop or pad never splits a 2x2 chroma block)."""
    h, w = plane.shape
    y0, x0 = max(0, (h - out_h) // (2 * unit)) * unit, max(0, (w - out_w) // (2 * unit)) * unit
    plane = plane[y0:y0 + out_h, x0:x0 + out_w]
    h, w = plane.shape
    if (w, h) == (out_w, out_h):
        return plane
    canvas = np.full((out_h, out_w), fill, dtype=np.uint8)
    y1, x1 = (out_h - h) // (2 * unit) * unit, (out_w - w) // (2 * unit) * unit
    canvas[y1:y1 + h, x1:x1 + w] = plane
    return canvas


def shape_frame(frame: av.VideoFrame, rotation: int, geometry: Geometry) -> av.VideoFrame:
    """``frame`` scaled, upright, cropped/padded: a new yuv420p frame for the encoders."""
    stored = upright_size(*geometry.scaled, rotation)  # scaled as stored, turned after
    small = frame.reformat(width=stored[0], height=stored[1], format="yuv420p",
                           interpolation=_interpolation((frame.width, frame.height), stored))
    if rotation % 360 == 0 and not geometry.reshapes:
        return small
    turns = (rotation // 90) % 4  # np.rot90 turns counter-clockwise, as FFmpeg's display rotation does
    out_w, out_h = geometry.out
    y, u, v = (np.rot90(p, k=turns) for p in _planes(small))
    return _frame([_centre(y, out_w, out_h, _BLACK[0], 2),
                   _centre(u, out_w // 2, out_h // 2, _BLACK[1], 1),
                   _centre(v, out_w // 2, out_h // 2, _BLACK[2], 1)])


def check_encoder(fmt: str) -> None:
    """Fail at once, not on every video, when this PyAV build lacks the encoder of ``fmt``."""
    try:
        av.codec.Codec(CODECS[fmt], "w")
    except ValueError as e:  # av.codec.codec.UnknownCodecError
        raise RuntimeError(f"video_encode_format {fmt!r} needs FFmpeg's {CODECS[fmt]} encoder, which this PyAV "
                           f"build ({av.__version__}) lacks: {e}") from None


class ClipEncoder:
    """One output file (``fmt``: mp4 with H.264 or webm with VP9) of ``width`` x ``height`` frames at a
    constant ``rate``, built in memory. ``add`` frames in order, then ``finish`` for the bytes."""

    def __init__(self, fmt: str, rate: Fraction, width: int, height: int, *, crf: int = 23,
                 preset: str = "veryfast", threads: int = 1):
        self.frames = 0
        self._buf = io.BytesIO()
        self._out = av.open(self._buf, mode="w", format=fmt)
        try:
            stream = self._out.add_stream(CODECS[fmt], rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.time_base = 1 / rate
            stream.codec_context.thread_count = max(1, threads)
            if fmt == "mp4":
                stream.options = {"crf": str(crf), "preset": preset}
            else:  # constant quality (b=0), libvpx's faster "good" speeds
                stream.options = {"crf": str(crf), "b": "0", "deadline": "good", "cpu-used": "5", "row-mt": "1"}
        except Exception:
            self._out.close()
            raise
        self._stream = stream
        self._time_base = 1 / rate

    def add(self, frame: av.VideoFrame) -> None:
        frame.pts = self.frames
        frame.time_base = self._time_base
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
        self.frames += 1

    def finish(self) -> bytes:
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        return self._buf.getvalue()

    def abort(self) -> None:
        try:
            self._out.close()
        except av.FFmpegError:
            pass  # closing a file that will be discarded
