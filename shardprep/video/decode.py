"""Read one downloaded video with PyAV (FFmpeg's libraries, bundled in the ``av`` wheels): which
container it is, its first video stream, and its frames with their presentation times.

The bytes come from anywhere, so:

* the container is recognised from its first bytes and opened with that one demuxer, never by FFmpeg's
  probing: a playlist (hls, concat) could make FFmpeg fetch other URLs past the address guard of
  ``shardprep.fetch``, and a text file would be read as FFmpeg's ``tty`` "video";
* the frame size is checked against a pixel limit before anything is decoded (and on every frame: a
  stream may change size), and a deadline is checked on every frame;
* a file that ends before the frames its index (or its header's duration) promises is ``truncated``.

Every problem is a ``VideoError`` whose message says what was wrong with the file.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator

import av

# a frame starts "at or before" a time when it is within this of it (float rounding of PTS * time base)
TIME_EPS = 1e-4
# the index may list a few frames the decoder never outputs (edit lists, a damaged last packet)
_MISSING_FRAMES_OK = 2
_HTML_STARTS = (b"<!doctype html", b"<html", b"<head", b"<body", b"<?xml")


class VideoError(Exception):
    """A downloaded file is not a usable video; the message says why (it becomes the sample's
    ``error_message``)."""


@dataclass(frozen=True)
class SourceInfo:
    """What a source video is, as found before and while decoding it."""

    container: str  # FFmpeg's demuxer name, e.g. "mov,mp4,m4a,3gp,3g2,mj2"
    codec: str
    coded_width: int  # as stored
    coded_height: int
    average_rate: Fraction | None  # frames per second over the whole stream; None when unknown
    frames: int  # from the container's index; 0 when unknown (webm, mkv)
    duration: float | None  # the container's, in seconds
    has_audio: bool


@dataclass(frozen=True)
class TimedFrame:
    time: float  # seconds from the first frame
    duration: float  # seconds it is shown (the stream's average frame duration when unknown)
    frame: av.VideoFrame


def _ffmpeg_message(e: Exception) -> str:
    """FFmpeg's error text without PyAV's ``: '<none>'`` (the in-memory file has no name)."""
    text = getattr(e, "strerror", None) or str(e)
    return str(text).strip()


def sniff_container(data: bytes) -> str:
    """The FFmpeg demuxer for ``data``, from its first bytes; ``VideoError`` when it is none we read."""
    if not data:
        raise VideoError("empty file (0 bytes)")
    head = data[:64]
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "mov"  # mp4, mov, m4v, 3gp: one demuxer
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"  # mkv and webm
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:3] == b"FLV":
        return "flv"
    if head[:4] == b"OggS":
        return "ogg"
    if len(data) > 376 and data[0] == data[188] == data[376] == 0x47:
        return "mpegts"
    if head.lstrip().lower().startswith(_HTML_STARTS):
        raise VideoError("an HTML page, not a video (an error or login page served with HTTP 200?)")
    raise VideoError(f"not a video file (starts with {head[:16]!r})")


@contextlib.contextmanager
def open_video(data: bytes, max_pixels: int, threads: int = 1) -> Iterator[tuple[Any, Any, SourceInfo]]:
    """The container, its first video stream (decoded on ``threads`` FFmpeg threads) and what it is."""
    fmt = sniff_container(data)
    try:
        container = av.open(io.BytesIO(data), mode="r", format=fmt)
    except av.FFmpegError as e:
        raise VideoError(f"unreadable {fmt} file: {_ffmpeg_message(e)}") from None
    try:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise VideoError(f"no video stream (streams: {', '.join(kinds)})")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if ctx.width * ctx.height > max_pixels:
            raise VideoError(f"video too large: {ctx.width}x{ctx.height} frames exceed max_video_pixels ({max_pixels})")
        stream.thread_type = "AUTO" if threads > 1 else "SLICE"
        ctx.thread_count = max(1, threads)
        info = SourceInfo(
            container=container.format.name,
            codec=ctx.name,
            coded_width=ctx.width,
            coded_height=ctx.height,
            average_rate=Fraction(stream.average_rate) if stream.average_rate else None,
            frames=int(stream.frames or 0),
            duration=container.duration / av.time_base if container.duration else None,
            has_audio=bool(container.streams.audio),
        )
        yield container, stream, info
    finally:
        container.close()


def decoded_frames(container, stream, info: SourceInfo, max_pixels: int, deadline: float,
                   stats: dict) -> Iterator[TimedFrame]:
    """The stream's frames in presentation order with their times from the first frame (never
    decreasing: a timestamp that goes back is taken as the previous one). ``stats`` receives ``frames``
    (decoded so far), ``end`` (when the last one stops being shown) and ``complete`` (True once the end
    of the stream was reached and nothing was missing)."""
    step = 1.0 / float(info.average_rate) if info.average_rate else 1.0 / 25
    first = last = None
    stats.update(frames=0, end=0.0, complete=False)
    frames = container.decode(stream)
    while True:
        if time.monotonic() > deadline:
            raise VideoError(f"decoding took too long (video_timeout); stopped after {stats['frames']} frames")
        try:
            frame = next(frames)
        except StopIteration:
            break
        except av.FFmpegError as e:
            raise VideoError(_decode_error(info, stats["frames"], e)) from None
        if frame.width * frame.height > max_pixels:
            raise VideoError(f"video too large: a {frame.width}x{frame.height} frame exceeds max_video_pixels "
                             f"({max_pixels})")
        if frame.time is None:  # no timestamp: one average frame after the previous one
            rel = last + step if last is not None else 0.0
        else:
            if first is None:  # the first timestamp is the origin (streams rarely start at 0)
                first = frame.time - (last + step if last is not None else 0.0)
            rel = frame.time - first
        rel = rel if last is None else max(rel, last)
        frame_duration = getattr(frame, "duration", None)  # PyAV >= 14 (FFmpeg's AVFrame.duration)
        shown = float(frame_duration * frame.time_base) if frame_duration and frame.time_base else step
        last = rel
        stats["frames"] += 1
        stats["end"] = rel + shown
        yield TimedFrame(rel, shown, frame)
    if stats["frames"] == 0:
        raise VideoError(f"no decodable video frame ({info.codec} in {info.container})")
    check_complete(info, stats["frames"], stats["end"])
    stats["complete"] = True


def _decode_error(info: SourceInfo, frames: int, e: Exception) -> str:
    # a file cut short fails inside its last packet: say so when the index promised more frames
    if info.frames and frames < info.frames:
        return (f"truncated or damaged: decode error after {frames} of the {info.frames} frames its index "
                f"lists: {_ffmpeg_message(e)}")
    return f"decode error after {frames} frames: {_ffmpeg_message(e)}"


def check_complete(info: SourceInfo, frames: int, end: float) -> None:
    """``VideoError`` when the file stopped before what its container promised: fewer frames than its
    index lists or, without an index, an end well before its header's duration."""
    if info.frames:
        if frames + max(_MISSING_FRAMES_OK, info.frames // 20) < info.frames:
            raise VideoError(f"truncated: {frames} of the {info.frames} frames its index lists could be decoded")
    elif info.duration and end < 0.9 * info.duration - 0.1:
        raise VideoError(f"truncated: frames end at {end:.2f} s of its {info.duration:.2f} s")
