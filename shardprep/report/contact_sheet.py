"""A contact sheet of one shard: for an image shard the first images of the tar as a thumbnail grid,
each with its caption underneath; for a video shard a strip of frames per clip, with its caption and
duration. A shard can be eyeballed from the Dagster UI without opening the tar."""

from __future__ import annotations

import base64
import contextlib
import functools
import glob
import io
import json
import math
import os
import re
import string
import unicodedata
from typing import Sequence

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
FONT_SIZE = 10

# Captions are in any script, so text is drawn per glyph from a chain of fonts (FallbackFont). DejaVu Sans
# first: wide coverage (Latin, Greek, Cyrillic, Arabic, Hebrew, symbols) and always there, as matplotlib
# (a dependency) ships it when the OS has no fonts.
PRIMARY_FONTS = ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "mpl-data:DejaVuSans.ttf")
# Then fonts for the scripts DejaVu lacks (CJK, Indic, Thai, emoji...), where distributions and macOS put
# them, each used only if present (no fontconfig: found the same way on every machine); globs match a
# font per script (Noto). matplotlib's STIX last: math alphanumerics (social-media captions' "bold" letters).
FALLBACK_FONTS = (
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",  # Debian, Ubuntu: fonts-noto-cjk
    "/usr/share/fonts/google-noto-cjk/NotoSansCJK-Regular.ttc",  # Fedora
    "/usr/share/fonts/noto-cjk/NotoSansCJK-Regular.ttc",  # Arch
    "/usr/share/fonts/truetype/noto/NotoSans*-Regular.ttf",  # Debian, Ubuntu: fonts-noto-core
    "/usr/share/fonts/opentype/noto/NotoSans*-Regular.otf",
    "/usr/share/fonts/google-noto/NotoSans*-Regular.ttf",  # Fedora
    "/usr/share/fonts/noto/NotoSans*-Regular.ttf",  # Arch
    "/usr/share/fonts/truetype/noto/NotoEmoji-Regular.ttf",  # monochrome emoji
    "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf",
    "/usr/share/fonts/truetype/droid/DroidSansFallback.ttf",
    "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",
    "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/usr/share/fonts/truetype/ancient-scripts/Symbola_hint.ttf",
    "/System/Library/Fonts/Supplemental/Arial Unicode.ttf",  # macOS
    "/System/Library/Fonts/Hiragino Sans GB.ttc",
    "/System/Library/Fonts/AppleSDGothicNeo.ttc",
    "mpl-data:STIXGeneral.ttf",
)
MPL_PREFIX = "mpl-data:"
# zlib's fastest level: a sheet of photographs takes 16 ms and 262 KB, where Pillow's optimize took 228 ms
# and 219 KB, once per shard (of ~6 CPU-seconds a 1,000-row shard); the UI shows a JPEG of it anyway
PNG_OPTIONS = {"compress_level": 1}


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


def _default_font(size: int):
    try:
        return ImageFont.load_default(size=size)  # FreeType default font (Pillow >= 10.1)
    except (TypeError, OSError):
        return ImageFont.load_default()


def _resolve(pattern: str) -> list[str]:
    """The font files ``pattern`` names (a path, a glob, or a file of matplotlib's mpl-data fonts)."""
    if pattern.startswith(MPL_PREFIX):
        try:
            import matplotlib  # not pyplot: only the data path is wanted
        except ImportError:
            return []
        pattern = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", pattern[len(MPL_PREFIX):])
    return sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]


def font_paths() -> list[str]:
    """The font files of the fallback chain on this machine, in order: the first primary font found,
    then every fallback font found."""
    primary = next((p for pattern in PRIMARY_FONTS for p in _resolve(pattern) if os.path.isfile(p)), None)
    fallbacks = [p for pattern in FALLBACK_FONTS for p in _resolve(pattern) if os.path.isfile(p)]
    return list(dict.fromkeys(([primary] if primary else []) + fallbacks))


@functools.lru_cache(maxsize=None)
def font_cmap(path: str) -> frozenset[int]:
    """The code points the font at ``path`` (the first of a collection) has glyphs for; none if unreadable."""
    from fontTools.ttLib import TTFont

    try:
        with TTFont(path, fontNumber=0, lazy=True) as font:
            return frozenset(font.getBestCmap() or ())
    except Exception:  # noqa: BLE001 - a broken font file is skipped: a preview never fails on one
        return frozenset()


@functools.lru_cache(maxsize=None)
def _truetype(path: str, size: int) -> ImageFont.FreeTypeFont | None:
    try:
        return ImageFont.truetype(path, size)
    except OSError:  # e.g. a colour bitmap font (Noto Color Emoji) has no glyphs at small sizes
        return None


def _sticks(ch: str) -> bool:
    # a combining mark, joiner or variation selector belongs with the character before it
    return unicodedata.category(ch)[0] == "M" or ch in "\u200c\u200d" or "\ufe00" <= ch <= "\ufe0f"


class FallbackFont:
    """Draws each character in the first font of ``paths`` whose cmap has it (a character none has in
    the first one: its missing-glyph box); a run of characters sharing a font is drawn and measured in
    one call. Measured like a PIL font (``ImageDraw.textlength`` calls ``getlength``), drawn with
    ``draw``. Without any usable path, PIL's default font draws everything. Fonts and their cmaps are
    read on first need: most captions never reach past the first font."""

    def __init__(self, paths: Sequence[str], size: int = FONT_SIZE):
        self.size = size
        self.paths = tuple(paths)
        self.primary_path = next((p for p in self.paths if _truetype(p, size) is not None), None)
        self.primary = _truetype(self.primary_path, size) if self.primary_path else _default_font(size)
        self._chosen: dict[str, str | None] = {}  # character -> path of its font (None: PIL's default)

    def font_path(self, ch: str, previous: str | None = None) -> str | None:
        """The path of the font that draws ``ch``; ``previous``: that of the character before it."""
        if previous is not None and _sticks(ch) and ord(ch) in font_cmap(previous):
            return previous
        if ch not in self._chosen:
            self._chosen[ch] = next((p for p in self.paths if ord(ch) in font_cmap(p)
                                     and _truetype(p, self.size) is not None), self.primary_path)
        return self._chosen[ch]

    def font(self, path: str | None):
        """The PIL font of ``path`` (a path ``font_path`` gave)."""
        return self.primary if path == self.primary_path else _truetype(path, self.size)

    def runs(self, text: str) -> list[tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont]]:
        """``text`` cut into (run, PIL font) pieces: consecutive characters sharing a font."""
        out = []
        start, current = 0, None
        for i, ch in enumerate(text):
            path = self.font_path(ch, current)
            if i and path != current:
                out.append((text[start:i], self.font(current)))
                start = i
            current = path
        if text:
            out.append((text[start:], self.font(current)))
        return out

    def getlength(self, text: str, *args, **kwargs) -> float:
        return sum(font.getlength(run, *args, **kwargs) for run, font in self.runs(text))

    def draw(self, draw: ImageDraw.ImageDraw, xy: tuple[int, int], text: str, fill) -> None:
        """Draw ``text`` with its top-left corner at ``xy`` (as ``draw.text`` does with one font)."""
        x, y = xy
        if not isinstance(self.primary, ImageFont.FreeTypeFont):  # the bitmap default font: no anchors
            draw.text(xy, text, fill=fill, font=self.primary)
            return
        # one baseline for all fonts (the primary's): fonts' ascents differ
        baseline = y + self.primary.getmetrics()[0]
        for run, font in self.runs(text):
            draw.text((x, baseline), run, fill=fill, font=font, anchor="ls")
            x += font.getlength(run, draw.fontmode)


@functools.lru_cache(maxsize=1)
def _font() -> FallbackFont:
    """The caption font: one object per process (``_max_chars`` is cached by font)."""
    return FallbackFont(font_paths(), FONT_SIZE)


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


def grid_size(n_images: int, thumb: int, lines: int = CAPTION_LINES) -> tuple[int, int]:
    """Pixel (width, height) of the sheet for ``n_images`` thumbnails of ``thumb`` pixels (``lines`` caption
    lines under each)."""
    cols = min(n_images, COLUMNS)
    rows = math.ceil(n_images / cols)
    cell_w, cell_h = thumb + 2 * PAD, thumb + lines * LINE_HEIGHT + 3 * PAD
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


def render_sheet(samples: list[tuple[str, bytes, str]], thumb: int = 96, lines: int = CAPTION_LINES) -> bytes:
    """PNG bytes of ``(key, image bytes, caption)`` thumbnails, ``COLUMNS`` per row (see contact_sheet),
    ``lines`` caption lines under each; a caption given as a tuple of parts (a synthetic and an original
    caption) gives each part its share of the lines."""
    width, height = grid_size(len(samples), thumb, lines)
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = _font()
    cell_w, cell_h = thumb + 2 * PAD, thumb + lines * LINE_HEIGHT + 3 * PAD
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
            font.draw(draw, (x0 + 2, y0 + thumb // 2 - 5), f"{key}: unreadable", fill=(160, 0, 0))
        parts = [p or "" for p in caption] if isinstance(caption, tuple) else [caption or key]
        shown = [line for part in parts for line in _fit(draw, part, font, thumb, max(1, lines // max(1, len(parts))))]
        for j, line in enumerate(shown[:lines]):
            font.draw(draw, (x0, y0 + thumb + PAD + j * LINE_HEIGHT), line, fill=TEXT)
    buf = io.BytesIO()
    sheet.save(buf, format="PNG", **PNG_OPTIONS)
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
        font.draw(draw, (PAD, y0), _cut(draw, label, font, width - 2 * PAD, ellipsis=False), fill=TEXT)
        y1 = y0 + LINE_HEIGHT + PAD
        try:
            strip = _frames(data, frames)
        except Exception:  # noqa: BLE001 - a preview shows a clip it cannot decode, it never fails on it
            strip = []
        if not strip:
            sheet.paste(CELL_BACKGROUND, (PAD, y1, width - PAD, y1 + thumb))
            font.draw(draw, (2 * PAD, y1 + thumb // 2 - 5), "undecodable clip", fill=(160, 0, 0))
        for j, img in enumerate(strip):
            x0 = PAD + j * (thumb + PAD)
            sheet.paste(CELL_BACKGROUND, (x0, y1, x0 + thumb, y1 + thumb))
            scale = thumb / max(img.width, img.height)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.LANCZOS)
            sheet.paste(img, (x0 + (thumb - img.width) // 2, y1 + (thumb - img.height) // 2))
    buf = io.BytesIO()
    sheet.save(buf, format="PNG", **PNG_OPTIONS)
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
