"""Captions in any script on contact sheets: each character is drawn with the first font of the chain that
has a glyph for it (DejaVu Sans first, found even where the OS has no fonts), never a missing-glyph box
where a font on the machine has the glyph; wrapping measures through the same fonts."""

import io

import numpy as np
import pytest
import webdataset as wds
from PIL import Image, ImageDraw, ImageFont

import shardprep.report.contact_sheet as cs
from shardprep.report.contact_sheet import FallbackFont, _fit, _font, contact_sheet, font_cmap, font_paths, grid_size

MIXED = "Café naïve Ελληνικά λόγος Жизнь ёж Ærøskøbing ñandú Straße"
CJK = "東京の夜景"
MISSING_CANDIDATES = ("\U0010fffd", "\U000ffffd", "\U0001fffe")  # private use, nonchars: no font draws them


def _missing(paths) -> str:
    """A character none of ``paths`` has: each font draws its missing-glyph box for it."""
    ch = next((c for c in MISSING_CANDIDATES if all(ord(c) not in font_cmap(p) for p in paths)), None)
    if ch is None:
        pytest.skip("every candidate character has a glyph in some font here")
    return ch


def _render(text: str, font) -> np.ndarray:
    img = Image.new("L", (48, 24), 255)
    ImageDraw.Draw(img).text((4, 18), text, fill=0, font=font, anchor="ls")
    return np.asarray(img)


def _assert_real_glyphs(font: FallbackFont, text: str) -> None:
    """Each character of ``text`` in its chosen font: in that font's cmap, drawn with ink, and not the
    font's missing-glyph box."""
    missing = _missing(font.paths)
    for ch in dict.fromkeys(text.replace(" ", "")):
        path = font.font_path(ch)
        assert path is not None and ord(ch) in font_cmap(path), (ch, path)
        pil_font = font.font(path)
        glyph, box = _render(ch, pil_font), _render(missing, pil_font)
        assert (glyph < 128).any(), f"{ch!r} drew nothing"
        assert not np.array_equal(glyph, box), f"{ch!r} is drawn as a missing-glyph box in {path}"


def test_the_caption_font_covers_latin_greek_cyrillic_and_accents():
    font = _font()
    assert font.primary_path is not None and "DejaVuSans" in font.primary_path
    for ch in "éЖλ":
        assert ord(ch) in font_cmap(font.font_path(ch)), ch
    _assert_real_glyphs(font, MIXED)


def test_the_missing_glyph_check_catches_a_box():
    # the check above would fail for PIL's default font (Aileron, Latin only): its Ж is a box
    default = ImageFont.load_default(size=10)
    assert np.array_equal(_render("Ж", default), _render(MISSING_CANDIDATES[0], default))


def test_cjk_is_drawn_with_a_cjk_font_when_the_machine_has_one():
    font = _font()
    if not any(ord(CJK[0]) in font_cmap(p) for p in font.paths):
        pytest.skip("no font with CJK glyphs on this machine (e.g. fonts-noto-cjk, fonts-wqy-microhei)")
    _assert_real_glyphs(font, CJK)
    runs = font.runs(f"Tokyo {CJK} at night")
    assert [r for r, _ in runs] == ["Tokyo ", CJK, " at night"]


def test_dejavu_is_found_without_os_fonts(monkeypatch):
    # CI machines and users' machines may have no /usr/share/fonts: matplotlib's copy is used
    monkeypatch.setattr(cs, "PRIMARY_FONTS", ("/nonexistent/DejaVuSans.ttf", "mpl-data:DejaVuSans.ttf"))
    monkeypatch.setattr(cs, "FALLBACK_FONTS", ("/nonexistent/NotoSans*-Regular.ttf", "mpl-data:STIXGeneral.ttf"))
    paths = font_paths()
    assert [p.rsplit("/", 1)[1] for p in paths] == ["DejaVuSans.ttf", "STIXGeneral.ttf"]
    assert all("mpl-data" in p for p in paths)
    _assert_real_glyphs(FallbackFont(paths), MIXED)


def test_runs_switch_font_per_glyph_and_marks_stay_with_their_base(monkeypatch):
    monkeypatch.setattr(cs, "PRIMARY_FONTS", ("mpl-data:DejaVuSans.ttf",))
    monkeypatch.setattr(cs, "FALLBACK_FONTS", ("mpl-data:STIXGeneral.ttf",))
    font = FallbackFont(font_paths())
    dejavu, stix = font.paths
    bold = "\U0001d41b\U0001d428"  # mathematical bold "bo": STIX has it, DejaVu Sans does not
    assert ord(bold[0]) not in font_cmap(dejavu) and ord(bold[0]) in font_cmap(stix)
    runs = font.runs(f"ab {bold}\u0301 c")
    assert [r for r, _ in runs] == ["ab ", bold + "\u0301", " c"]  # the accent goes on the STIX "o"
    assert [f for _, f in runs] == [font.font(dejavu), font.font(stix), font.font(dejavu)]
    # measured as the sum of its runs, through ImageDraw.textlength like a PIL font
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    assert draw.textlength(f"ab {bold}\u0301 c", font=font) == pytest.approx(sum(f.getlength(r) for r, f in runs))


def test_wrapping_measures_non_ascii_text_through_the_fallback_chain():
    draw, font = ImageDraw.Draw(Image.new("RGB", (1, 1))), _font()
    text = f"{MIXED} {CJK} " * 5
    lines = _fit(draw, text, font, 96, 2)
    assert len(lines) == 2 and lines[-1].endswith("...")
    assert all(0 < font.getlength(line) <= 96 for line in lines)
    assert "".join(lines).replace("...", "").replace(" ", "") in text.replace(" ", "")


def test_an_unknown_character_is_drawn_in_the_primary_font():
    font = _font()
    missing = _missing(font.paths)
    assert font.font_path(missing) == font.primary_path
    assert font.runs(f"a{missing}b") == [(f"a{missing}b", font.primary)]


def test_without_any_truetype_font_pil_default_draws_captions():
    font = FallbackFont([])
    assert font.primary_path is None and font.runs("Жa") == [("Жa", font.primary)]
    img = Image.new("RGB", (60, 20), (255, 255, 255))
    font.draw(ImageDraw.Draw(img), (2, 2), "sample 1", fill=(0, 0, 0))
    assert (np.asarray(img) < 100).any()


def _write_tar(path, captions: list[str]) -> None:
    """Plain-colour PNG samples with ``captions``, through webdataset's TarWriter (as test_report_cli's)."""
    with wds.TarWriter(str(path)) as sink:
        for i, caption in enumerate(captions):
            buf = io.BytesIO()
            Image.new("RGB", (40, 30), (30 * i, 120, 200)).save(buf, format="PNG")
            sink.write({"__key__": f"{i:09d}", "png": buf.getvalue(), "json": {"i": i}, "txt": caption})


def test_an_image_shard_with_non_ascii_captions_makes_a_png(tmp_path):
    captions = [MIXED, f"{CJK} Tokyo", "Привет, мир! " * 20, "Σ αβγ e\u0301 😀", "مرحبا بالعالم"]
    _write_tar(tmp_path / "00000.tar", captions)
    png = contact_sheet(str(tmp_path / "00000.tar"), thumb=64)
    sheet = Image.open(io.BytesIO(png))
    assert sheet.format == "PNG" and sheet.size == grid_size(len(captions), 64)
    caption_band = np.asarray(sheet.convert("L").crop((cs.PAD, cs.PAD + 64 + cs.PAD, cs.PAD + 64,
                                                       cs.PAD + 64 + cs.PAD + cs.LINE_HEIGHT)))
    assert (caption_band < 100).any()


def test_a_video_shard_with_non_ascii_captions_makes_a_png(tmp_path):
    from shardprep.report.contact_sheet import video_contact_sheet
    from tests.fixtures.videos import encode

    clip = encode("mp4", "libx264", n_frames=12, options={"preset": "ultrafast"})
    with wds.TarWriter(str(tmp_path / "00001.tar")) as sink:
        for i, caption in enumerate([MIXED, f"{CJK} 🎬"]):
            sink.write({"__key__": f"{i:09d}", "mp4": clip, "txt": caption, "json": {"duration": 0.5}})
    sheet = Image.open(io.BytesIO(video_contact_sheet(str(tmp_path / "00001.tar"), frames=3, thumb=32)))
    assert sheet.format == "PNG" and sheet.size[1] == 2 * (cs.LINE_HEIGHT + 2 * cs.PAD + 32) + cs.PAD
