"""One downloaded video to its samples: decoded once, resampled to a constant frame rate, cut into
clips, each clip shaped and encoded (``transcode``).

Clips follow video2dataset's ``ClippingSubsampler``: spans ``[start, end]`` (seconds, or
``"HH:MM:SS.fff"`` strings) from a clips column, or the whole video; each span is cut into pieces of
``clip_length`` (``max_length``), a shorter last piece kept only when longer than ``min_clip_length``
(``min_length``); strategy ``first`` keeps the first piece of each span (``max_length_strategy``).
Clip ``i`` of a row gets the key ``{key}_{i:05d}``. Unlike video2dataset's stream copy (cuts at
keyframes), every clip starts and ends where its span says, at frame precision.

Timing: output frame ``k`` of a span shows, at ``start + k / rate``, the source frame on screen at that
time (the last one starting at or before it), as FFmpeg's ``fps`` filter does. So variable frame rate
sources come out at a constant rate, and ``rate`` defaults to the source's average rate.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterator, Sequence

from shardprep.video.decode import TIME_EPS, SourceInfo, TimedFrame, VideoError, decoded_frames, open_video
from shardprep.video.encode import ClipEncoder, plan_geometry, shape_frame, upright_size

OOM_CLIP_COUNT = 5  # digits of a clip's key suffix: video2dataset's, hard-coded there too
_FALLBACK_RATE = Fraction(25)  # for a stream whose average rate FFmpeg cannot tell
_MAX_SOURCE_RATE = 240  # an "average rate" above this is a timestamp artefact, not a frame rate


@dataclass(frozen=True)
class VideoSpec:
    """What to make of every video of a shard (from the dataset config)."""

    size: int | None = None
    resize_mode: str = "scale,crop,pad"
    frame_rate: float | None = None
    max_duration: float | None = None
    clip_length: float | None = None
    min_clip_length: float = 0.0
    clip_strategy: str = "all"
    encode_format: str = "mp4"
    crf: int = 23
    preset: str = "veryfast"
    max_pixels: int = 16_777_216
    timeout: float = 600.0
    threads: int = 1  # FFmpeg threads per video (decoder and encoder each)

    @property
    def clipped(self) -> bool:
        return self.clip_length is not None


@dataclass
class Clip:
    data: bytes
    span: tuple[float, float]  # seconds of the source, from its first frame
    width: int
    height: int
    num_frames: int
    framerate: float

    @property
    def duration(self) -> float:
        return self.num_frames / self.framerate


@dataclass
class Transcoded:
    source: SourceInfo
    width: int  # upright, as displayed
    height: int
    rotation: int
    source_duration: float | None  # seconds: the decoded end, or the container's when decoding stopped early
    sha256: str
    clips: list[Clip] = field(default_factory=list)


# ---------------------------------------------------------------- spans


def seconds(t: Any) -> float:
    """A clip time as seconds: a number, or video2dataset's ``"HH:MM:SS.fff"``."""
    if isinstance(t, str):
        parsed = datetime.datetime.strptime(t, "%H:%M:%S.%f").time()
        return parsed.hour * 3600 + parsed.minute * 60 + parsed.second + parsed.microsecond / 1e6
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise ValueError(f"not a time: {t!r}")
    return float(t)


def parse_spans(value: Any) -> list[tuple[float, float]]:
    """A clips cell (``[[start, end], ...]``, or one ``[start, end]`` as video2dataset accepts) as
    sorted, non-overlapping spans in seconds; ``ValueError`` saying what is wrong otherwise."""
    if value is None or isinstance(value, (str, bytes)) or len(value) == 0:
        raise ValueError(f"no clip spans in {value!r}")
    items = list(value)
    if len(items) == 2 and all(isinstance(x, (int, float, str)) for x in items):
        items = [items]
    spans = []
    for item in items:
        pair = list(item) if isinstance(item, (list, tuple)) else [item]
        if len(pair) != 2:
            raise ValueError(f"a clip span must be [start, end], got {item!r}")
        start, end = seconds(pair[0]), seconds(pair[1])
        if not 0 <= start < end:
            raise ValueError(f"a clip span must have 0 <= start < end, got {item!r}")
        spans.append((start, end))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end - TIME_EPS:
            raise ValueError(f"clip spans must be sorted and must not overlap: {spans!r}")
    return spans


def split_span(start: float, end: float, length: float | None, min_length: float,
               strategy: str) -> list[tuple[float, float]]:
    """video2dataset's ``_split_time_frame``: full pieces of ``length``, and the rest when longer than
    ``min_length``; ``first`` keeps the first piece only. The whole video (no clips column) is cut by
    ``output_times`` instead: its end is known only once it is decoded."""
    if length is None:  # video2dataset's max_length default (999999 s): each span whole
        return [(start, end)] if end - start > min_length else []
    n_full = int((end - start) // length)
    pieces = [(start + i * length, start + (i + 1) * length) for i in range(n_full)]
    if (end - start) % length > min_length:
        pieces.append((start + n_full * length, end))
    return pieces[:1] if strategy == "first" else pieces


def output_times(spans: Sequence[tuple[float, float]] | None, rate: Fraction,
                 spec: VideoSpec) -> Iterator[tuple[int, float]]:
    """``(clip index, time)`` of every output frame, in time order. ``spans=None``: the whole video
    (clip ``floor(t / clip_length)`` when clipped), up to its end (the caller stops asking)."""
    limit = spec.max_duration if spec.max_duration is not None else float("inf")
    step = 1 / rate
    if spans is None:
        k = 0
        while (t := float(k * step)) < limit - TIME_EPS:
            clip = int((t + TIME_EPS) // spec.clip_length) if spec.clipped else 0
            if spec.clip_strategy == "first" and clip > 0:
                return
            yield clip, t
            k += 1
        return
    for clip, (start, end) in enumerate(spans):
        k = 0
        while (t := start + float(k * step)) < min(end, limit) - TIME_EPS:
            yield clip, t
            k += 1


# ---------------------------------------------------------------- frames at times


def frames_at(frames: Iterator[TimedFrame],
              times: Iterator[tuple[int, float]]) -> Iterator[tuple[int, float, TimedFrame]]:
    """For each ``(clip, time)`` the frame on screen then; stops after the last frame's end."""
    current = next(frames, None)
    if current is None:
        return
    upcoming = next(frames, None)
    for clip, t in times:
        while upcoming is not None and upcoming.time <= t + TIME_EPS:
            current, upcoming = upcoming, next(frames, None)
        if upcoming is None and t >= current.time + current.duration - TIME_EPS:
            return
        yield clip, t, current


# ---------------------------------------------------------------- one video


def output_rate(spec: VideoSpec, source: SourceInfo) -> Fraction:
    if spec.frame_rate is not None:
        return Fraction(spec.frame_rate).limit_denominator(1001)
    rate = source.average_rate
    if rate is None or not 0 < rate <= _MAX_SOURCE_RATE:
        return _FALLBACK_RATE
    return rate.limit_denominator(1001)


def _keep(clip: Clip, nominal: tuple[float, float], spec: VideoSpec) -> bool:
    """A clip cut short (by the video's end) is kept only when longer than ``min_clip_length``."""
    full = clip.duration >= (nominal[1] - nominal[0]) - 0.5 / clip.framerate
    return full or clip.duration > spec.min_clip_length


class _ClipWriter:
    """Output frames to one encoder per clip; clips come in time order, so a clip is complete (and
    encoded to bytes) when the next one starts. Each source frame is shaped once, however many output
    frames repeat it."""

    def __init__(self, spec: VideoSpec, rate: Fraction):
        self.spec, self.rate = spec, rate
        self.geometry = None
        self.rotation = 0
        self.done: list[tuple[int, Clip]] = []
        self._open: tuple[int, ClipEncoder, float] | None = None
        self._source: TimedFrame | None = None
        self._shaped = None

    def add(self, clip_id: int, t: float, timed: TimedFrame) -> None:
        if self.geometry is None:  # the first frame tells the rotation, so the upright size
            self.rotation = int(getattr(timed.frame, "rotation", 0) or 0) % 360  # display matrix, CCW
            width, height = upright_size(timed.frame.width, timed.frame.height, self.rotation)
            self.geometry = plan_geometry(width, height, self.spec.size, self.spec.resize_mode)
        if self._open is None or self._open[0] != clip_id:
            self.finish()
            encoder = ClipEncoder(self.spec.encode_format, self.rate, *self.geometry.out, crf=self.spec.crf,
                                  preset=self.spec.preset, threads=self.spec.threads)
            self._open = (clip_id, encoder, t)
        if self._source is not timed:
            self._source, self._shaped = timed, shape_frame(timed.frame, self.rotation, self.geometry)
        self._open[1].add(self._shaped)

    def finish(self) -> None:
        if self._open is None:
            return
        (clip_id, encoder, start), self._open = self._open, None
        data = encoder.finish()
        fps = float(self.rate)
        self.done.append((clip_id, Clip(data, (start, start + encoder.frames / fps), *self.geometry.out,
                                        encoder.frames, fps)))

    def abort(self) -> None:
        if self._open is not None:
            self._open[1].abort()
            self._open = None


def transcode(data: bytes, spec: VideoSpec, spans: list[tuple[float, float]] | None = None) -> Transcoded:
    """Decode ``data`` and encode its samples (one, or one per clip); ``VideoError`` when it is not a
    usable video or no clip is left. ``spans``: from the clips column (``None``: the whole video)."""
    deadline = time.monotonic() + spec.timeout
    if spans is not None:
        spans = [piece for s, e in spans
                 for piece in split_span(s, e, spec.clip_length, spec.min_clip_length, spec.clip_strategy)]
        if not spans:
            raise VideoError(f"Video had no clip_spans longer than {spec.min_clip_length}")
    with open_video(data, spec.max_pixels, spec.threads) as (container, stream, source):
        rate = output_rate(spec, source)
        stats: dict = {}
        frames = decoded_frames(container, stream, source, spec.max_pixels, deadline, stats)
        writer = _ClipWriter(spec, rate)
        try:
            for clip_id, t, timed in frames_at(frames, output_times(spans, rate, spec)):
                if time.monotonic() > deadline:  # upsampling: many output frames per decoded one
                    raise VideoError(f"encoding took too long (video_timeout); stopped at {t:.2f} s")
                writer.add(clip_id, t, timed)
            writer.finish()
        finally:
            writer.abort()
    clips = _kept_clips(writer.done, spans, spec)
    if not clips:
        raise VideoError(f"Video had no clip_spans longer than {spec.min_clip_length}" if spec.clipped or spans
                         else "no frames left to encode (max_duration shorter than one frame?)")
    width, height = upright_size(source.coded_width, source.coded_height, writer.rotation)
    duration = stats["end"] if stats.get("complete") else source.duration
    return Transcoded(source, width, height, writer.rotation, duration, hashlib.sha256(data).hexdigest(), clips)


def _kept_clips(done: list[tuple[int, Clip]], spans, spec: VideoSpec) -> list[Clip]:
    if spans is None and not spec.clipped:
        return [clip for _, clip in done]
    kept = []
    for clip_id, clip in done:
        if spans is not None:
            nominal = spans[clip_id]
        else:
            nominal = (clip_id * spec.clip_length, (clip_id + 1) * spec.clip_length)
        if _keep(clip, nominal, spec):
            clip.span = (nominal[0], min(nominal[1], clip.span[1]))
            kept.append(clip)
    return kept
