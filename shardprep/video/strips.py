"""A clip's frame strip: ``n`` frames evenly spaced over an encoded clip, for a model that looks at a few
frames of a video (a chat VLM's video caption).

Frame ``i`` of ``n`` is the middle frame of the clip's ``i``-th of ``n`` equal parts (by frame count): the
first and last frames, often a fade or a cut, are not taken. The count comes from the container's index,
or from its packets when it has none (webm), read without decoding; then the clip is decoded once, up
to the last frame taken, and only the frames taken are converted to RGB. A clip with fewer than ``n``
frames gives them all.

The clips are ours (``video_shards`` transcoded them), but a tar can be damaged: the container is
recognised and opened as ``shardprep.video.decode`` does for downloads, and any problem raises (the
caller records it).
"""

from __future__ import annotations

from shardprep.video.decode import VideoError, open_video

VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")  # a clip's member in a video2dataset-layout tar
MAX_PIXELS = 8192 * 8192  # per frame: a damaged header never makes a huge allocation


def strip_indices(frames: int, n: int) -> list[int]:
    """The frames taken (0-based, increasing) of a clip of ``frames`` frames: the middle of each of ``n``
    equal parts, each frame once."""
    if frames <= 0 or n <= 0:
        return []
    return sorted({min(frames - 1, int((i + 0.5) * frames / n)) for i in range(n)})


def _frame_count(data: bytes) -> int:
    with open_video(data, MAX_PIXELS) as (container, stream, info):
        if info.frames:
            return info.frames
        return sum(1 for packet in container.demux(stream) if packet.size)  # no index: count, no decoding


def frame_strip(data: bytes, n: int) -> list:
    """``n`` frames (PIL RGB images) evenly spaced over the encoded clip ``data`` (module docstring);
    ``VideoError`` or PyAV's error when it cannot be read."""
    wanted = strip_indices(_frame_count(data), n)
    if not wanted:
        raise VideoError("no video frame")
    taken, last = set(wanted), wanted[-1]
    images = []
    with open_video(data, MAX_PIXELS) as (container, stream, _):
        for i, frame in enumerate(container.decode(stream)):
            if i in taken:
                images.append(frame.to_image())  # RGB
            if i >= last:
                break
    if not images:
        raise VideoError("no decodable video frame")
    return images
