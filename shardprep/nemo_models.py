"""Tiny random-weight models for the NeMo writers, saved as real ``from_pretrained`` folders.

Used by the demo and the tests in place of the real (multi-GB, hub-hosted) checkpoints; each one
loads offline through the same code path as its real counterpart:

* ``build_tiny_t5``: a ``T5EncoderModel`` (stand-in for google-t5/t5-11b) with a real T5 fast
  tokenizer (``tokenizer.json``: a SentencePiece-style Unigram model trained here, offline, with the
  ``tokenizers`` library on a small built-in text, ``</s>`` appended like T5, 100 ``<extra_id_N>``
  sentinels). No ``spiece.model`` is written, so only ``T5TokenizerFast``/``AutoTokenizer`` load it
  (NeMo uses ``T5TokenizerFast``); that keeps ``sentencepiece`` out of the dependencies.
* ``build_tiny_autoencoder``: a ``diffusers.AutoencoderKL`` with 16 latent channels (the DiT/Cosmos
  latent width) and the real 8x spatial downsampling (4 down blocks), just very narrow.
* ``build_tiny_sd_autoencoder``: the same with 4 latent channels, as Stable Diffusion's VAE, so the
  SD precache stores mean||logvar = 8 channels.
* ``build_tiny_nemo_models``: all of them (plus ``shardprep.tiny_models.build_tiny_clip``, whose
  text tower ``nemo_encoders.ClipTextEncoder`` loads) under one root.

Every builder is idempotent: a complete folder built with the same parameters is left untouched;
files are built in a temp folder beside the target and moved in, stamp last.
"""

from __future__ import annotations

import os
import string
from typing import Callable

from shardprep.tiny_models import build_once

STAMP = "shardprep_nemo_model.json"
SEED = 1234
T5_EXTRA_IDS = 100  # T5's sentinel tokens <extra_id_0..99>, at the end of the vocabulary like the real one
T5_UNIGRAM_PIECES = 400

# Training text for the tiny T5 tokenizer: caption-like English, so common words become single pieces.
# Every printable ASCII character is in the initial alphabet, so any ASCII text round-trips.
_CORPUS = """\
a photo of a red cat sitting on a blue sofa in the living room
a dog running on the beach at sunset with waves in the background
a close up of a yellow flower with green leaves and a small bee
an old wooden house next to a lake surrounded by tall pine trees
a bowl of fresh fruit with apples oranges and bananas on a table
a city street at night with cars lights and people walking
a painting of a mountain landscape with snow and a cloudy sky
a black and white portrait of a smiling woman wearing a hat
two children playing football in a green park on a sunny day
a plate of pasta with tomato sauce basil and cheese
a small boat on the river under a bridge in the morning fog
a white bird flying over the sea near the rocks
a cup of coffee and a book on a wooden desk by the window
a colorful butterfly resting on a purple flower in the garden
the quick brown fox jumps over the lazy dog
an aerial view of a green forest with a winding road
a vintage car parked in front of a brick building
a horse standing in a field of tall grass under the blue sky
a modern kitchen with white cabinets and a large window
a group of friends laughing around a campfire at night
"""

_T5_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json")
_VAE_FILES = ("config.json", "diffusion_pytorch_model.safetensors")


def _build_once(out_dir: str, params: dict, files: tuple[str, ...], make: Callable[[str], None]) -> str:
    return build_once(out_dir, params, files, make, stamp=STAMP)


def _t5_tokenizer():
    """A T5TokenizerFast around a Unigram model trained on ``_CORPUS`` (pad 0, eos 1, unk 2, like T5)."""
    from tokenizers import SentencePieceUnigramTokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import T5TokenizerFast

    alphabet = [c for c in string.printable if not c.isspace()]
    backend = SentencePieceUnigramTokenizer()
    backend.train_from_iterator(
        _CORPUS.splitlines(), vocab_size=T5_UNIGRAM_PIECES, special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>", initial_alphabet=alphabet, show_progress=False,
    )
    tok = backend._tokenizer
    # T5 appends </s> to every sequence (the real tokenizer.json has this post-processor)
    tok.post_processor = TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                            special_tokens=[("</s>", tok.token_to_id("</s>"))])
    # the real vocabulary ends with <extra_id_99> .. <extra_id_0> (so <extra_id_0> is the last id)
    sentinels = [f"<extra_id_{i}>" for i in reversed(range(T5_EXTRA_IDS))]
    return T5TokenizerFast(tokenizer_object=tok, extra_ids=T5_EXTRA_IDS, additional_special_tokens=sentinels,
                           model_max_length=512)


def build_tiny_t5(out_dir: str, d_model: int = 32) -> str:
    """Build (once) a seeded tiny ``T5EncoderModel`` + ``T5TokenizerFast`` in ``out_dir``; returns it.

    ``d_model`` is the width of the hidden states the encoder returns (1024 for t5-11b).
    """
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 4 or d_model % 4:
        raise ValueError(f"build_tiny_t5: d_model must be a positive multiple of 4, got {d_model!r}")
    params = {"kind": "t5_encoder", "d_model": d_model, "seed": SEED, "version": 2}

    def make(tmp: str) -> None:
        import torch
        from transformers import T5Config, T5EncoderModel

        tokenizer = _t5_tokenizer()
        config = T5Config(
            vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model,
            num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=32,
            feed_forward_proj="relu",  # T5 v1.0, like t5-11b
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
        )
        with torch.random.fork_rng(devices=[]):  # seeded weights without touching the caller's RNG
            torch.manual_seed(SEED)
            model = T5EncoderModel(config).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return _build_once(out_dir, params, _T5_FILES, make)


def build_tiny_autoencoder(out_dir: str, latent_channels: int = 16) -> str:
    """Build (once) a seeded tiny ``diffusers.AutoencoderKL`` with ``latent_channels`` in ``out_dir``.

    Four down blocks, like the real SD/FLUX VAEs, so latents are 8x smaller than the image; the
    blocks are 8-16 channels wide, one resnet layer each (about 90k parameters).
    """
    if isinstance(latent_channels, bool) or not isinstance(latent_channels, int) or latent_channels < 1:
        raise ValueError(f"build_tiny_autoencoder: latent_channels must be a positive integer, got {latent_channels!r}")
    params = {"kind": "autoencoder_kl", "latent_channels": latent_channels, "seed": SEED, "version": 1}

    def make(tmp: str) -> None:
        import torch
        from diffusers import AutoencoderKL

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            vae = AutoencoderKL(
                in_channels=3, out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8,
                latent_channels=latent_channels, sample_size=64,
            ).eval()
        vae.save_pretrained(tmp, safe_serialization=True)

    return _build_once(out_dir, params, _VAE_FILES, make)


def build_tiny_sd_autoencoder(out_dir: str) -> str:
    """The Stable-Diffusion-shaped tiny VAE: 4 latent channels (precache stores mean||logvar = 8)."""
    return build_tiny_autoencoder(out_dir, latent_channels=4)


def build_tiny_nemo_models(root: str) -> dict[str, str]:
    """Every tiny model the NeMo writers need, under ``root``: {"t5", "autoencoder", "sd_autoencoder", "clip"}.

    ``clip`` is ``shardprep.tiny_models.build_tiny_clip``'s folder; ``nemo_encoders.ClipTextEncoder``
    loads its text tower (as it would openai/clip-vit-large-patch14's).
    """
    from shardprep.tiny_models import build_tiny_clip

    return {
        "t5": build_tiny_t5(os.path.join(root, "tiny-t5")),
        "autoencoder": build_tiny_autoencoder(os.path.join(root, "tiny-vae16")),
        "sd_autoencoder": build_tiny_sd_autoencoder(os.path.join(root, "tiny-vae4")),
        "clip": build_tiny_clip(os.path.join(root, "tiny-clip")),
    }
