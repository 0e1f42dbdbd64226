"""Random-weight CLIP models for the benchmarks, built like ``tests.fixtures.tiny_clip.build_tiny_clip``
(a Hugging Face ``CLIPModel`` folder with OpenAI's BPE vocabulary, loadable as ``hf_clip:<dir>``),
with the geometry as a parameter.

``SMALL_224`` is the CPU benchmark model: real CLIP input geometry (224 px, 32 px patches, 77 text
tokens) with thin towers, so that, as for ViT-B/32 on a GPU, preprocessing rather than the model
decides the throughput. ``VIT_B_32`` and ``VIT_L_14`` have the real models' sizes (GPU only).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from tests.fixtures.tiny_clip import CLIP_MEAN, CLIP_STD, CONTEXT_LENGTH, SEED, VOCAB_SIZE, _openai_bpe_files

SMALL_224 = dict(image_size=224, patch_size=32, width=64, layers=2, heads=2, text_width=64, text_layers=2,
                 text_heads=2, embed_dim=64)
VIT_B_32 = dict(image_size=224, patch_size=32, width=768, layers=12, heads=12, text_width=512, text_layers=12,
                text_heads=8, embed_dim=512)
VIT_L_14 = dict(image_size=224, patch_size=14, width=1024, layers=24, heads=16, text_width=768, text_layers=12,
                text_heads=12, embed_dim=768)


def vision_flops(g: dict) -> float:
    """Forward FLOPs of the image tower per image (2 x multiply-adds of the matmuls and convs)."""
    n = (g["image_size"] // g["patch_size"]) ** 2 + 1
    d = g["width"]
    patch = 2 * (g["image_size"] // g["patch_size"]) ** 2 * (3 * g["patch_size"] ** 2) * d
    per_layer = 2 * n * (4 * d * d + 2 * d * 4 * d) + 2 * 2 * n * n * d  # qkv+out, mlp; scores+values
    return patch + g["layers"] * per_layer + 2 * d * g["embed_dim"]


def text_flops(g: dict, tokens: int = CONTEXT_LENGTH) -> float:
    d = g["text_width"]
    per_layer = 2 * tokens * (4 * d * d + 2 * d * 4 * d) + 2 * 2 * tokens * tokens * d
    return g["text_layers"] * per_layer + 2 * d * g["embed_dim"]


def build_random_clip(out_dir: str, geometry: dict, dtype: str = "float32") -> str:
    """Build (once) a seeded random CLIP of ``geometry`` in ``out_dir``; returns the folder."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizerFast

    stamp = os.path.join(out_dir, "bench_clip.json")
    params = {**geometry, "dtype": dtype, "seed": SEED, "version": 1}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == params:
                return out_dir
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".clip-", dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        g = geometry
        config = CLIPConfig(
            text_config={"vocab_size": VOCAB_SIZE, "max_position_embeddings": CONTEXT_LENGTH,
                         "hidden_size": g["text_width"], "intermediate_size": 4 * g["text_width"],
                         "num_hidden_layers": g["text_layers"], "num_attention_heads": g["text_heads"],
                         "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 0},
            vision_config={"image_size": g["image_size"], "patch_size": g["patch_size"], "hidden_size": g["width"],
                           "intermediate_size": 4 * g["width"], "num_hidden_layers": g["layers"],
                           "num_attention_heads": g["heads"]},
            projection_dim=g["embed_dim"],
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = CLIPModel(config).eval()
        if dtype != "float32":
            model = model.to(getattr(torch, dtype))
        model.save_pretrained(tmp, safe_serialization=True)
        _openai_bpe_files(tmp)
        tokenizer = CLIPTokenizerFast.from_pretrained(tmp, model_max_length=CONTEXT_LENGTH)
        processor = CLIPImageProcessor(size={"shortest_edge": g["image_size"]},
                                       crop_size={"height": g["image_size"], "width": g["image_size"]},
                                       image_mean=CLIP_MEAN, image_std=CLIP_STD)
        CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(tmp)
        with open(os.path.join(tmp, "bench_clip.json"), "w") as f:
            json.dump(params, f)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
