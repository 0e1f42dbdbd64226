"""A contact sheet of one image shard: the first images of the tar as a thumbnail grid, each with its
caption underneath, so a shard can be eyeballed from the Dagster UI without opening the tar."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import math
import re
import string

from PIL import Image, ImageDraw, ImageFont

from shardprep.errors import ShardprepError
from shardprep.tars import TarReadError, iter_samples

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
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
                image = _image_of(sample)
                if image is None:
                    continue
                out.append((sample["__key__"], image, sample.get("txt", b"").decode("utf-8", errors="replace")))
                if len(out) >= max_images:
                    break
    except (OSError, TarReadError) as e:
        raise ContactSheetError(f"shard tar {tar_url}: cannot be read ({type(e).__name__}: {e})") from e
    return out


def _image_of(members: dict) -> bytes | None:
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
