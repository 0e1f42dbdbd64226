"""One decode of a shard's images for every pixel model of a run (issue 24).

CLIP (``shardprep.embeddings``), LAION's watermark detector (``models.watermark``) and the captioner
(``curation.captions``) each decode every image of a shard tar on their own. When they run together
(the clip_embeddings step, or its follower, with ``image_scores``' watermark column and ``captions`` in
the same run: ``shardprep_dagster.assets.pixels``), a ``PixelPass`` rides along CLIP's decode threads:
each image is decoded once (``decode``) and every model's input is made from that one RGB image.

The decode is DCT-scaled (PIL ``draft``) only as far as every consumer allows, so no model gets fewer
pixels than its own path gives it: a JPEG's draft request is the largest of the consumers' requests
(PIL then picks the smallest of their scales), and a consumer that decodes at full size (the captioner,
whose processor takes any size; CLIP's per-image preprocess) means no reduction at all. A consumer whose
own path picks the same scale gets the same pixels, bit for bit; one whose own path would have reduced
further gets the decoded image box-reduced (PIL ``reduce``) to its own scale, then its own resize: a box
average of f x f blocks is about what DCT scaling does, and it costs a fraction of resizing every pixel
of a full-size photo. Its output stays within what its own DCT-scaled path promises (pwatermark within
0.02 of the full-size preprocess, CLIP within the fast preprocess's tolerance), but a shard's embeddings
and pwatermark can differ by that much with the run that made them (alone, or beside a captioner), at the
same version. The captioner always gets the full image, as its own path does: its captions are the same.
Like the three paths, EXIF orientation is not applied (clip-retrieval and LAION's code do not either).
Measured in bench/PIXELS.md (``bench/pixels.py``, part of ``make bench``).

Each model keeps its own batches (``batch_size`` read samples, the decodable ones stacked), so its
outputs do not depend on CLIP's steps, and records a bad image exactly as its own path does: a skip with
the same reason, never a crash. Memory: the decoded images of one CLIP step (and the one being decoded)
are held until the captioner has seen them.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from shardprep.clip_samples import IMAGE_EXTS, image_ext, prepare_sample
from shardprep.curation.caption_batches import decode_failure, sample_text
from shardprep.models.clip import draft_target, resize_crop
from shardprep.models.watermark import SIZE as WATERMARK_SIZE
from shardprep.models.watermark import WatermarkScores, watermark_pixels

if TYPE_CHECKING:
    from shardprep.layout import Layout
    from shardprep.models.clip import ClipEncoder, ImageSpec

# Images decoded by ``decode`` in this process (tests count one per image per run)
DECODES = 0
_COUNT = threading.Lock()


@dataclass(frozen=True)
class Consumers:
    """The pixel models one decode feeds, as far as the decode cares."""

    clip: "ImageSpec | None" = None  # CLIP's fast preprocess
    full: bool = False  # a consumer that takes the image at full size (captioner, CLIP's exact preprocess)
    watermark: bool = False


class Decoded(NamedTuple):
    rgb: Any  # a loaded RGB PIL image, DCT-reduced or not
    original: tuple[int, int]  # (width, height) of the stored image
    format: str | None  # PIL's: "JPEG", "PNG", ...


def draft_request(consumers: Consumers, fmt: str | None, width: int, height: int) -> tuple[int, int] | None:
    """The size asked of PIL ``draft`` for an image of ``width`` x ``height``: the largest of the
    consumers' own requests (PIL keeps both sides >= it, so every consumer's scale is respected); None
    when one of them needs the full image, or the image is not a JPEG."""
    if fmt != "JPEG" or consumers.full:
        return None
    asks = []
    if consumers.clip is not None:
        target = draft_target(consumers.clip, width, height)
        if target is None:
            return None  # CLIP's own path decodes this one at full size
        asks.append(target)
    if consumers.watermark:
        asks.append((WATERMARK_SIZE, WATERMARK_SIZE))
    return (max(a[0] for a in asks), max(a[1] for a in asks)) if asks else None


def decode(data: bytes, consumers: Consumers) -> Decoded:
    """Image bytes -> the one decoded RGB image every consumer's input is made from; raises like PIL for
    an undecodable image (each consumer records its skip)."""
    global DECODES
    from PIL import Image

    with _COUNT:
        DECODES += 1
    im = Image.open(io.BytesIO(data))
    original = im.size
    request = draft_request(consumers, im.format, *original)
    if request is not None:
        im.draft("RGB", request)
    # loaded here, in the decode thread (a truncated file fails now); a loaded RGB image is used as it is
    # (no copy), the others converted as each path converts them
    im.load()
    return Decoded(im if im.mode == "RGB" else im.convert("RGB"), original, im.format)


def own_scale(request: tuple[int, int], width: int, height: int) -> int:
    """The DCT scale (1, 2, 4 or 8) PIL's JPEG ``draft`` picks for ``request``: the largest that keeps both
    sides >= it (JpegImagePlugin's rule)."""
    scale = min(width // request[0], height // request[1])
    return next((s for s in (8, 4, 2) if scale >= s), 1)


def source_for(decoded: Decoded, request: tuple[int, int] | None, reduced: dict[int, Any]) -> Any:
    """The image a consumer whose own path DCT-reduces a JPEG with ``request`` resizes from: ``decoded``,
    box-reduced (PIL ``reduce``: each f x f block averaged, about what DCT scaling does) to the scale its
    own decode would have had when the one decode kept more for another consumer: cheaper than resizing
    every pixel of a full-size photo (bench/pixels.py's decode stage, 100 images: 1.2x the three decodes'
    speed without it, 1.5x with it). ``reduced``: the reductions made so far for this image, by factor
    (the consumers share them)."""
    if request is None or decoded.format != "JPEG":
        return decoded.rgb
    have = max(1, round(decoded.original[0] / decoded.rgb.size[0]))  # the one decode's scale
    factor = own_scale(request, *decoded.original) // have
    if factor <= 1:
        return decoded.rgb
    if factor not in reduced:
        reduced[factor] = decoded.rgb.reduce(factor)  # the size DCT scaling gives too (sides rounded up)
    return reduced[factor]


def clip_crop(decoded: Decoded, spec: "ImageSpec", reduced: dict[int, Any] | None = None) -> np.ndarray:
    """CLIP's uint8 ``[H, W, 3]`` crop of ``decoded``: ``models.clip.resize_crop`` of the image at CLIP's own
    scale (``source_for``), with the area filter whenever CLIP's own path would have DCT-reduced it, PIL's
    bicubic otherwise (then ``decoded`` is the full image: the reference's pixels)."""
    request = draft_target(spec, *decoded.original) if decoded.format == "JPEG" else None
    source = source_for(decoded, request, {} if reduced is None else reduced)
    return resize_crop(source, spec, decoded.original, area=request is not None or source.size != decoded.original)


def watermark_input(decoded: Decoded, reduced: dict[int, Any] | None = None) -> np.ndarray:
    """The detector's uint8 ``[256, 256, 3]`` of ``decoded``, from the image at its own scale (``source_for``)."""
    return watermark_pixels(source_for(decoded, (WATERMARK_SIZE, WATERMARK_SIZE), {} if reduced is None else reduced))


@dataclass
class PixelPass:
    """The watermark detector and the captioner fed from CLIP's decode threads
    (``embeddings.write_clip_embeddings(pixels=...)``): ``prepare`` runs per sample in a thread, ``run``
    per CLIP step in the calling thread (while the threads decode the next step), ``flush`` at the end;
    then ``watermark_scores()`` and ``caption_rows`` hold what ``score_watermarks`` and ``caption_tar``
    would have returned."""

    detector: Any = None  # models.watermark.WatermarkDetector
    watermark_batch: int = 64
    captioner: Any = None  # models.captioner.Captioner
    caption_batch: int = 16
    prompt: str | None = None
    max_new_tokens: int = 30
    caption_rows: list[dict] = field(default_factory=list)
    _steps: dict = field(default_factory=dict)  # step -> {row: record}, filled by the decode threads
    _wm_waiting: list = field(default_factory=list)  # records read, not yet scored (< a batch)
    _cap_waiting: list = field(default_factory=list)
    _wm_keys: list = field(default_factory=list)
    _wm_scores: list = field(default_factory=list)
    _wm_skipped: list = field(default_factory=list)

    def consumers(self, encoder: "ClipEncoder | None") -> Consumers:
        fast = encoder is not None and encoder.fast_preprocess
        return Consumers(clip=encoder.image_spec if fast else None,
                         full=self.captioner is not None or (encoder is not None and not fast),
                         watermark=self.detector is not None)

    def prepare(self, sample: dict, n: int, row: int, encoder: "ClipEncoder", enable_text: bool, url: str,
                out=None) -> dict:
        """``clip_samples.prepare_sample`` of ``sample`` (row ``row`` of CLIP step ``n``) with the image
        decoded once, and the other models' inputs made from the same decode, kept for ``run(n)``."""
        decoded, error = None, None
        reduced: dict[int, Any] = {}  # box reductions of this image, shared by CLIP and the detector
        ext = image_ext(sample)
        if ext is None:
            error = ValueError("no image member (" + "/".join(IMAGE_EXTS) + ")")
        else:
            try:
                decoded = decode(sample[ext], self.consumers(encoder))
            except Exception as e:  # noqa: BLE001 - each model records the skip as its own path does
                error = e

        def clip_image(data: bytes, out_row):
            if error is not None:
                raise error
            if encoder.fast_preprocess:
                return encoder.prepare_crop(clip_crop(decoded, encoder.image_spec, reduced), out_row)
            return encoder.preprocess(decoded.rgb)

        # CLIP never looks at an image it skips for its caption; the other models still need it
        item = prepare_sample(sample, encoder, enable_text, url, out, image_of=clip_image)
        record: dict = {"key": sample["__key__"], "original": sample_text(sample)}
        if self.detector is not None:
            try:
                if error is not None:
                    raise error
                record["watermark"] = watermark_input(decoded, reduced)
            except Exception as e:  # noqa: BLE001 - a bad image is a recorded skip
                record["watermark"] = e
        if self.captioner is not None:  # its processor's per-image work here too, in the decode thread
            try:
                if error is not None:
                    raise error
                record["image"] = self.captioner.prepare(decoded.rgb)
            except Exception as e:  # noqa: BLE001 - a bad image is a recorded skip
                record["image"] = e
        self._steps.setdefault(n, {})[row] = record  # one row per thread: no lock needed
        return item

    def run(self, n: int) -> None:
        """The models on step ``n``'s records, in tar order, a full batch of each at a time."""
        rows = self._steps.pop(n, {})
        records = [rows[i] for i in sorted(rows)]
        if self.detector is not None:
            self._wm_waiting.extend(records)
            while len(self._wm_waiting) >= self.watermark_batch:
                self._score(self._wm_waiting[:self.watermark_batch])
                del self._wm_waiting[:self.watermark_batch]
        if self.captioner is not None:
            self._cap_waiting.extend(records)
            while len(self._cap_waiting) >= self.caption_batch:
                self._caption(self._cap_waiting[:self.caption_batch])
                del self._cap_waiting[:self.caption_batch]

    def flush(self) -> None:
        """The last, short batches."""
        if self._wm_waiting:
            self._score(self._wm_waiting)
            self._wm_waiting = []
        if self._cap_waiting:
            self._caption(self._cap_waiting)
            self._cap_waiting = []

    def _score(self, batch: list[dict]) -> None:
        # score_watermarks' batch: the decodable images of batch_size read samples, NaN for the others
        out = np.full(len(batch), np.nan, np.float32)
        at = [i for i, r in enumerate(batch) if not isinstance(r["watermark"], BaseException)]
        for r in batch:
            self._wm_keys.append(r["key"])
            if isinstance(r["watermark"], BaseException):
                self._wm_skipped.append({"key": r["key"], "reason": decode_failure(r["watermark"])})
        if at:
            out[at] = self.detector(np.stack([batch[i]["watermark"] for i in at]))
        self._wm_scores.append(out)

    def _caption(self, batch: list[dict]) -> None:
        # caption_tar's batch and rows (curation.captions.COLUMNS)
        images, at = [], []
        for r in batch:
            row = {"key": r["key"], "caption": None, "original_caption": r["original"], "model": self.captioner.name,
                   "prompt": self.prompt, "skip_reason": None}
            if isinstance(r["image"], BaseException):
                row["skip_reason"] = decode_failure(r["image"])
            else:
                images.append(r["image"])
                at.append(len(self.caption_rows))
            self.caption_rows.append(row)
        if images:
            texts = self.captioner.generate(images, self.prompt, self.max_new_tokens)
            for i, text in zip(at, texts, strict=True):
                self.caption_rows[i]["caption"] = text

    def watermark_scores(self) -> WatermarkScores | None:
        """What ``score_watermarks`` returns for the tar (None without a detector)."""
        if self.detector is None:
            return None
        pw = np.concatenate(self._wm_scores) if self._wm_scores else np.zeros(0, np.float32)
        return WatermarkScores(list(self._wm_keys), pw, list(self._wm_skipped), self.detector.path)


def write_caption_rows(shard: str, layout: "Layout", rows: list[dict]):
    """``curation.captions.write_captions``' file and report, from rows a ``PixelPass`` made."""
    import time

    from shardprep.curation.captions import CaptionsReport, captions_table
    from shardprep.storage import write_parquet

    start = time.perf_counter()
    write_parquet(layout.captions(shard), captions_table(rows))  # atomic (shardprep.storage)
    return CaptionsReport(shard=shard, samples=len(rows), captioned=sum(r["caption"] is not None for r in rows),
                          skipped=[{"key": r["key"], "reason": r["skip_reason"]} for r in rows
                                   if r["skip_reason"] is not None],
                          seconds=time.perf_counter() - start)
