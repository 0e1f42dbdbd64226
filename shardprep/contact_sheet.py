"""A contact sheet of one shard: for an image shard the first images of the tar as a thumbnail grid,
each with its caption underneath; for a video shard a strip of frames per clip, with its caption and
duration. A shard can be eyeballed from the Dagster UI without opening the tar."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import math
import re
import string

from PIL import Image, ImageDraw, ImageFont

from shardprep.errors import ShardprepError
from shardprep.tars import TarReadError, iter_samples, read_samples_by_key

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
VIDEO_EXTENSIONS = ("mp4", "webm")
STRIP_FRAMES = 6
MAX_STRIP_DECODE = 600  # frames decoded per clip at most (clips are short; a long one shows its start)
COLUMNS = 6
CAPTION_LINES = 2
LINE_HEIGHT = 12
PAD = 4
BACKGROUND = (255, 255, 255)
CELL_BACKGROUND = (235, 235, 235)
TEXT = (20, 20, 20)


class ContactSheetError(ShardprepError, ValueError):
    """The tar cannot be turned into a contact sheet (unreadable, or no image in it)."""


def read_samples(tar_url: str, max_images: int) -> list[tuple[str, bytes, str]]:
    """(key, image bytes, caption) of the first ``max_images`` samples with an image, in tar order.

    The tar is streamed: only the members up to the last wanted sample are read."""
    out: list[tuple[str, bytes, str]] = []
    try:
        with contextlib.closing(iter_samples(tar_url)) as samples:
            for sample in samples:
                image = image_of(sample)
                if image is None:
                    continue
                out.append((sample["__key__"], image, sample.get("txt", b"").decode("utf-8", errors="replace")))
                if len(out) >= max_images:
                    break
    except (OSError, TarReadError) as e:
        raise ContactSheetError(f"shard tar {tar_url}: cannot be read ({type(e).__name__}: {e})") from e
    return out


def image_of(members: dict) -> bytes | None:
    """The image member of a sample (the first of IMAGE_EXTENSIONS it has), or None."""
    return next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)


def _font() -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=10)  # FreeType default font (Pillow >= 10.1)
    except (TypeError, OSError):
        return ImageFont.load_default()


# Captions can be any length (50,000 characters happen), so fitting one looks only at what can
# show: a line of ``width`` pixels holds fewer than ``_max_chars`` (width / narrowest glyph)
# characters, so longer words are cut to that length (they are cut on screen anyway), and measured
# widths grow with the text, so the words of a line and the cut of a line are binary searches.


@functools.lru_cache(maxsize=8)
def _max_chars(font, width: int) -> int:
    """More characters than any text of at most ``width`` pixels holds in ``font``."""
    narrowest = min(font.getlength(c) for c in string.printable if not c.isspace() or c == " ")
    return int(width / max(narrowest, 1.0)) + 1


def _last_true(ok, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ``ok(n)``, given ``ok(lo)`` and that ok turns false once."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: int, lines: int) -> list[str]:
    """The first ``lines`` lines of ``text`` greedily word-wrapped to ``width`` pixels (a word too long
    for a line alone on its line, shortened to ``_max_chars``)."""
    cap = _max_chars(font, width)
    words = (m.group()[:cap] for m in re.finditer(r"\S+", text))
    pending: list[str] = []
    wrapped: list[str] = []
    while len(wrapped) < lines:
        # a line that fits holds at most cap / 2 words (each but the last followed by a space)
        pending.extend(w for _, w in zip(range(cap // 2 + 2 - len(pending)), words))
        if not pending:
            break
        n = _last_true(lambda k: k == 1 or draw.textlength(" ".join(pending[:k]), font=font) <= width,
                       1, len(pending))
        wrapped.append(" ".join(pending[:n]))
        del pending[:n]
    return wrapped or [""]


def _fit(draw: ImageDraw.ImageDraw, text: str, font, width: int, lines: int) -> list[str]:
    """Word-wrap ``text`` into at most ``lines`` lines of ``width`` pixels; a line that does not fit
    (a long word, or the last line of a longer caption) ends in '...'."""
    wrapped = _wrap(draw, text, font, width, lines + 1)  # one line more: does the caption go on?
    out = [_cut(draw, line, font, width, ellipsis=False) for line in wrapped[:lines]]
    if len(wrapped) > lines:
        out[-1] = _cut(draw, wrapped[lines - 1] + " " + wrapped[lines], font, width, ellipsis=True)
    return out


def _cut(draw: ImageDraw.ImageDraw, line: str, font, width: int, ellipsis: bool) -> str:
    """``line`` cut to ``width`` pixels, ending in '...' when anything was cut (or ``ellipsis``)."""
    line = line[:_max_chars(font, width)]
    if not ellipsis and draw.textlength(line, font=font) <= width:
        return line
    n = _last_true(lambda k: k == 0 or draw.textlength(line[:k] + "...", font=font) <= width, 0, len(line))
    return line[:n].rstrip() + "..."


def grid_size(n_images: int, thumb: int) -> tuple[int, int]:
    """Pixel (width, height) of the sheet for ``n_images`` thumbnails of ``thumb`` pixels."""
    cols = min(n_images, COLUMNS)
    rows = math.ceil(n_images / cols)
    cell_w, cell_h = thumb + 2 * PAD, thumb + CAPTION_LINES * LINE_HEIGHT + 3 * PAD
    return cols * cell_w, rows * cell_h


def contact_sheet(tar_url: str, max_images: int = 24, thumb: int = 96) -> bytes:
    """PNG bytes: the first ``max_images`` images of the webdataset tar at ``tar_url`` as
    ``thumb``-pixel thumbnails (aspect kept), ``COLUMNS`` per row, each captioned (truncated); the
    sheet is ``grid_size(n, thumb)`` pixels for its ``n = min(max_images, samples)`` thumbnails.

    A sample whose image cannot be decoded gets a grey cell with its key, not an error."""
    if max_images < 1 or thumb < 8:
        raise ValueError(f"contact sheet: max_images must be >= 1 and thumb >= 8, got {max_images}, {thumb}")
    samples = read_samples(tar_url, max_images)
    if not samples:
        raise ContactSheetError(f"shard tar {tar_url}: holds no image sample")
    return render_sheet(samples, thumb)


def samples_of(tar_url: str, captions: dict[str, str]) -> list[tuple[str, bytes, str]]:
    """(key, image bytes, caption) of the samples named in ``captions`` (key -> caption shown), in the
    order of ``captions``; only their members are read (``tars.read_samples_by_key``)."""
    try:
        found = read_samples_by_key(tar_url, set(captions))
    except (OSError, TarReadError) as e:
        raise ContactSheetError(f"shard tar {tar_url}: cannot be read ({type(e).__name__}: {e})") from e
    return [(k, image, c) for k, c in captions.items() if k in found and (image := image_of(found[k])) is not None]


def render_sheet(samples: list[tuple[str, bytes, str]], thumb: int = 96) -> bytes:
    """PNG bytes of ``(key, image bytes, caption)`` thumbnails, ``COLUMNS`` per row (see contact_sheet)."""
    width, height = grid_size(len(samples), thumb)
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = _font()
    cell_w, cell_h = thumb + 2 * PAD, thumb + CAPTION_LINES * LINE_HEIGHT + 3 * PAD
    for i, (key, data, caption) in enumerate(samples):
        x0, y0 = (i % COLUMNS) * cell_w + PAD, (i // COLUMNS) * cell_h + PAD
        sheet.paste(CELL_BACKGROUND, (x0, y0, x0 + thumb, y0 + thumb))
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.draft("RGB", (thumb, thumb))  # JPEG: decode at reduced scale
                img = img.convert("RGB")
                # fit the cell both ways: shards are often made of small images (e.g. 64 px)
                scale = thumb / max(img.width, img.height)
                img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                 Image.LANCZOS)
                sheet.paste(img, (x0 + (thumb - img.width) // 2, y0 + (thumb - img.height) // 2))
        except (OSError, ValueError, Image.DecompressionBombError):
            draw.text((x0 + 2, y0 + thumb // 2 - 5), f"{key}: unreadable", fill=(160, 0, 0), font=font)
        for j, line in enumerate(_fit(draw, caption or key, font, thumb, CAPTION_LINES)):
            draw.text((x0, y0 + thumb + PAD + j * LINE_HEIGHT), line, fill=TEXT, font=font)
    buf = io.BytesIO()
    sheet.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _frames(data: bytes, n: int) -> list[Image.Image]:
    """``n`` evenly spaced frames of an encoded clip (fewer if it has fewer), as RGB images."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_image() for _, f in zip(range(MAX_STRIP_DECODE), container.decode(video=0))]
    if len(frames) <= n:
        return frames
    return [frames[round(i * (len(frames) - 1) / (n - 1))] for i in range(n)] if n > 1 else frames[:1]


def _label(sample: dict) -> str:
    caption = sample.get("txt", b"").decode("utf-8", errors="replace")
    try:
        duration = float(json.loads(sample.get("json", b"{}")).get("duration") or 0.0)
    except (ValueError, TypeError, AttributeError):
        duration = 0.0
    return f"{sample['__key__']} ({duration:.1f} s) {caption}"


def video_contact_sheet(tar_url: str, max_clips: int = 12, frames: int = STRIP_FRAMES, thumb: int = 64) -> bytes:
    """PNG bytes: a row per clip (the first ``max_clips`` of the video2dataset-layout tar at ``tar_url``)
    with its key, duration and caption above ``frames`` evenly spaced frames (``thumb`` pixels, aspect
    kept). A clip that cannot be decoded gets a grey row saying so, not an error."""
    if max_clips < 1 or frames < 1 or thumb < 8:
        raise ValueError(f"video contact sheet: max_clips and frames must be >= 1 and thumb >= 8, got "
                         f"{max_clips}, {frames}, {thumb}")
    clips: list[tuple[bytes, str]] = []
    try:
        with contextlib.closing(iter_samples(tar_url)) as samples:
            for sample in samples:
                data = next((sample[e] for e in VIDEO_EXTENSIONS if e in sample), None)
                if data is not None:
                    clips.append((data, _label(sample)))
                if len(clips) >= max_clips:
                    break
    except (OSError, TarReadError) as e:
        raise ContactSheetError(f"shard tar {tar_url}: cannot be read ({type(e).__name__}: {e})") from e
    if not clips:
        raise ContactSheetError(f"shard tar {tar_url}: holds no video sample")
    row_h = LINE_HEIGHT + PAD + thumb + PAD
    width = frames * (thumb + PAD) + PAD
    sheet = Image.new("RGB", (width, len(clips) * row_h + PAD), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = _font()
    for i, (data, label) in enumerate(clips):
        y0 = i * row_h + PAD
        draw.text((PAD, y0), _cut(draw, label, font, width - 2 * PAD, ellipsis=False), fill=TEXT, font=font)
        y1 = y0 + LINE_HEIGHT + PAD
        try:
            strip = _frames(data, frames)
        except Exception:  # noqa: BLE001 - a preview shows a clip it cannot decode, it never fails on it
            strip = []
        if not strip:
            sheet.paste(CELL_BACKGROUND, (PAD, y1, width - PAD, y1 + thumb))
            draw.text((2 * PAD, y1 + thumb // 2 - 5), "undecodable clip", fill=(160, 0, 0), font=font)
        for j, img in enumerate(strip):
            x0 = PAD + j * (thumb + PAD)
            sheet.paste(CELL_BACKGROUND, (x0, y1, x0 + thumb, y1 + thumb))
            scale = thumb / max(img.width, img.height)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.LANCZOS)
            sheet.paste(img, (x0 + (thumb - img.width) // 2, y1 + (thumb - img.height) // 2))
    buf = io.BytesIO()
    sheet.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def inline_image(png: bytes, max_bytes: int = 60_000) -> tuple[str, int]:
    """A ``data:`` URI of the sheet no bigger than ``max_bytes`` (base64 included), and its width in
    pixels: the PNG as is when small enough, else a JPEG at lower quality, then at smaller scales
    (photographs make large PNGs; an inlined image is stored in every metadata event)."""
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    with Image.open(io.BytesIO(png)) as img:
        img = img.convert("RGB")
        if len(uri) <= max_bytes:
            return uri, img.width
        scale = 1.0
        while True:
            for quality in (80, 60, 40):
                small = img if scale == 1.0 else img.resize(
                    (max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.LANCZOS)
                buf = io.BytesIO()
                small.save(buf, format="JPEG", quality=quality, optimize=True)
                uri = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
                if len(uri) <= max_bytes or small.width <= 64:
                    return uri, small.width
            scale *= 0.7
