"""Synthetic captions from a vision-language model, through Hugging Face transformers.

``captioner`` (the config field) names a local model folder, or a hub id read from the local Hugging
Face cache only (``local_files_only=True``: nothing is downloaded). It is loaded with ``AutoProcessor`` and:

* ``AutoModelForVision2Seq`` first: BLIP, BLIP-2, InstructBLIP (and what else transformers maps to it);
* else ``AutoModelForImageTextToText``: newer chat VLMs (Qwen2-VL / Qwen2.5-VL, LLaVA family, Idefics...).

How the prompt is used follows the processor, not the auto class (transformers 4.57 maps some chat VLMs,
Qwen2-VL and LLaVA among them, to both classes):

* a processor with a chat template (chat VLMs): the prompt (default "Describe this image.") is the user
  turn of a one-image conversation through that template, with the generation prompt added; batches are
  padded on the left, as decoder-only generation needs. Such a model is ``multi_image``: a video clip's
  frame strip (``generate_strips``) is one user turn of its N images then the prompt (default "Describe
  this video.");
* without one (BLIP, BLIP-2, InstructBLIP): the prompt, when given, is passed as the text (BLIP: the
  start of the caption, e.g. "a photograph of"; InstructBLIP: the instruction); None: unconditional. One
  image per caption: no video captions (``curation.video_captions`` records why).

Output: when the generated ids start with the input ids (decoder-only models), those are cut off before
decoding; a caption that starts with the prompt as the tokenizer writes it back (BLIP echoes it,
lowercased) has it stripped.

Tested (tests/test_captions.py, tiny random-weight models built there): BLIP (the non-chat path) and
Qwen2-VL (the chat path: one image, batches of different lengths left-padded, frame strips), each equal
to transformers' own calls. Other families go through the same two paths, untested here: BLIP-2 and
InstructBLIP like BLIP; Qwen2.5-VL, LLaVA, Idefics like Qwen2-VL (a strip's images are passed nested,
one list per conversation, which their processors take).

Florence-2 as Microsoft publishes it (``microsoft/Florence-2-*``) is remote code (``trust_remote_code``),
which is never run: not loadable offline. (transformers 4.57's native ``Florence2ForConditionalGeneration``,
for checkpoints converted to it, goes through the ``AutoModelForImageTextToText`` path; untested.)

Generation is greedy (``do_sample=False``, one beam): the same model, images and settings give the same
captions. Whitespace in the output is normalised (runs of spaces/newlines -> one space, stripped).
A model is loaded once per process per (spec, device), in eval mode, on the resolved device, in bfloat16
on a GPU (float32 on the CPU).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from shardprep.errors import ShardprepError

DEFAULT_CHAT_PROMPT = "Describe this image."
DEFAULT_VIDEO_PROMPT = "Describe this video."  # a chat VLM given a clip's frame strip
LOAD_COUNT = 0  # models loaded by this process (worker metadata)


class CaptionerError(ShardprepError, ValueError):
    """The captioner cannot be loaded, or is not an image-to-text model."""


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class Captioner:
    spec: str  # as configured
    device: str
    processor: Any
    model: Any
    chat: bool  # its processor has a chat template: the prompt goes through it

    @property
    def name(self) -> str:
        return self.spec

    @property
    def multi_image(self) -> bool:
        """It captions several images together (a video's frame strip): a chat template's user turn holds
        any number of image entries; a model without one (BLIP) takes one image per caption."""
        return self.chat

    @property
    def per_image(self) -> bool:
        """Its processor makes each image's tensor on its own, of one fixed size (BLIP's): ``prepare`` can
        run in the decode threads, leaving the model's thread only the batching. Other processors (chat
        VLMs' variable patch grids, BLIP-2's query tokens in the text) see the whole batch."""
        return type(self.processor).__name__ == "BlipProcessor"

    def prepare(self, image):
        """``image`` (PIL) as ``generate`` takes it, made in the caller's thread: with a ``per_image``
        processor its pixel values (float32 [C, H, W], exactly the batch call's row), else the RGB image."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        if not self.per_image:
            return rgb
        return self.processor.image_processor(rgb, return_tensors="np")["pixel_values"][0]

    def _inputs(self, images: list, prompt: str | None):
        import numpy as np

        if images and isinstance(images[0], np.ndarray):  # prepared in the decode threads (``prepare``)
            import torch
            from transformers import BatchFeature

            # the text as BlipProcessor tokenises it (no token_type_ids: generate refuses them)
            text = {} if prompt is None else dict(self.processor.tokenizer(
                [prompt] * len(images), padding=True, return_token_type_ids=False, return_tensors="pt"))
            return BatchFeature({"pixel_values": torch.from_numpy(np.stack(images)), **text})
        if self.chat:
            text = self._chat_text(prompt or DEFAULT_CHAT_PROMPT)
            return self.processor(images=images, text=[text] * len(images), return_tensors="pt", padding=True)
        if prompt is None:
            return self.processor(images=images, return_tensors="pt")
        return self.processor(images=images, text=[prompt] * len(images), return_tensors="pt", padding=True)

    def _chat_text(self, prompt: str, images: int = 1) -> str:
        messages = [{"role": "user", "content": [*[{"type": "image"}] * images, {"type": "text", "text": prompt}]}]
        template = getattr(self.processor, "apply_chat_template", None)
        if template is None or getattr(self.processor, "chat_template", None) is None:
            return prompt  # e.g. PaliGemma: the processor adds the image tokens itself
        return template(messages, add_generation_prompt=True)

    def generate(self, images: list, prompt: str | None = None, max_new_tokens: int = 30) -> list[str]:
        """One caption per image of ``images``: PIL images, or what ``prepare`` made of them (one batch: the
        caller batches), greedy."""
        if not images:
            return []
        rgb = [im if not hasattr(im, "mode") or im.mode == "RGB" else im.convert("RGB") for im in images]
        texts = self._generate(self._inputs(rgb, prompt), max_new_tokens)
        if prompt is not None and not self.chat:
            echoed = self._rendered(prompt)
            texts = [normalise(t[len(echoed):]) if echoed and t.startswith(echoed) else t for t in texts]
        return texts

    def generate_strips(self, strips: list[list], prompt: str | None = None, max_new_tokens: int = 30) -> list[str]:
        """One caption per strip of ``strips`` (a list of PIL images each: a video clip's frames), the
        strip's images and then the prompt (default "Describe this video.") in one user turn; one batch,
        greedy. Only for a ``multi_image`` captioner."""
        if not self.multi_image:
            raise CaptionerError(f"captioner {self.spec!r}: takes one image per caption, not a frame strip")
        if not strips:
            return []
        rgb = [[im if im.mode == "RGB" else im.convert("RGB") for im in strip] for strip in strips]
        text = [self._chat_text(prompt or DEFAULT_VIDEO_PROMPT, len(strip)) for strip in rgb]
        # nested: each text's images (Qwen2-VL flattens them in order; Idefics-style processors need it)
        return self._generate(self.processor(images=rgb, text=text, return_tensors="pt", padding=True),
                              max_new_tokens)

    def _generate(self, inputs, max_new_tokens: int) -> list[str]:
        import torch

        inputs = inputs.to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with torch.inference_mode():
            out = self.model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
        ids = inputs.get("input_ids")
        if ids is not None and out.shape[1] >= ids.shape[1] and torch.equal(out[:, :ids.shape[1]], ids):
            out = out[:, ids.shape[1]:]  # a decoder-only model returns its input first
        return [normalise(t) for t in self.processor.batch_decode(out, skip_special_tokens=True)]

    def _rendered(self, prompt: str) -> str:
        """``prompt`` as the model writes it back (tokenised then decoded: BLIP's tokenizer lowercases)."""
        tok = getattr(self.processor, "tokenizer", self.processor)
        return normalise(tok.decode(tok(prompt, add_special_tokens=False)["input_ids"], skip_special_tokens=True))


_CACHE: dict[tuple[str, str], Captioner] = {}
_LOCK = threading.Lock()


def load_captioner(spec: str, device: str = "auto") -> Captioner:
    """The captioner ``spec`` names (a local folder, or a hub id in the local cache), on ``device``
    (``auto``: CUDA when there is one); once per process per (spec, device)."""
    from shardprep.models.clip import resolve_device

    resolved = resolve_device(device)
    key = (spec, resolved)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(spec, resolved)
        return _CACHE[key]


def _load(spec: str, device: str) -> Captioner:
    global LOAD_COUNT
    import warnings

    from transformers import AutoConfig, AutoModelForImageTextToText, AutoModelForVision2Seq, AutoProcessor

    from shardprep.models.nemo import compute_dtype, hf_dtype_kwarg

    where = "local folder" if os.path.isdir(spec) else "hub id (local cache only)"
    try:
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - named with its cause
        first = (str(e).splitlines() or [""])[0]
        raise CaptionerError(f"captioner {spec!r} ({where}): cannot be loaded ({type(e).__name__}: "
                             f"{first[:300] + '...' if len(first) > 300 else first})") from e
    model = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AutoModelForVision2Seq's deprecation notice in transformers >= 4.5x
        for auto in (AutoModelForVision2Seq, AutoModelForImageTextToText):
            if type(config) not in auto._model_mapping:
                continue
            try:
                # bfloat16 on a GPU (as the NeMo encoders): half the memory and the tensor cores' speed
                model = auto.from_pretrained(spec, local_files_only=True, **hf_dtype_kwarg(compute_dtype(device)))
            except Exception as e:  # noqa: BLE001
                raise CaptionerError(f"captioner {spec!r}: cannot load its weights ({type(e).__name__}: {e})") from e
            break
    if model is None:
        raise CaptionerError(f"captioner {spec!r}: a {config.model_type!r} model is not an image-to-text model "
                             "(neither AutoModelForVision2Seq nor AutoModelForImageTextToText takes it)")
    try:
        processor = AutoProcessor.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise CaptionerError(f"captioner {spec!r}: cannot load its processor ({type(e).__name__}: {e})") from e
    if not hasattr(processor, "image_processor"):
        raise CaptionerError(f"captioner {spec!r}: its processor ({type(processor).__name__}) takes no images")
    chat = getattr(processor, "chat_template", None) is not None
    if chat and getattr(processor, "tokenizer", None) is not None:
        processor.tokenizer.padding_side = "left"  # decoder-only generation continues every row at its end
    LOAD_COUNT += 1
    return Captioner(spec, device, processor, model.eval().to(device), chat)
